"""Do two trees generate the same tokens, and where does a call's host time go? Run a tree's
``scripts/tok_per_s.py`` and record a digest of every call's output sequences; with
``--profile DIR``, one more call per row under cProfile (``DIR/row<i>.txt``: the functions by
own time, then by cumulative time) and, on CUDA, one under torch.profiler
(``DIR/row<i>_kernels.txt``: the call's kernels by device time), to compare two trees' host
and device work.

Run from the tree's root (its ``flashspec`` is the one imported), with this file's path and
tok_per_s's own arguments after ``--``; the digests go to ``--digests``, one per row that ran
(keyed by variant, batch size and drafts), with the sequences' shape and their SHA-256:

    cd .ab/c1bb73c && PYTHONPATH=. python /path/to/probes/sequence_digests.py \\
        --digests $OUT/old.json -- --pair qwen3 --batch-sizes 8,32 ...

Works with any tree whose tok_per_s (the script, or ``flashspec.bench.tok_per_s`` it
imports) runs each row through a module-level ``run_variant(name, case, ...)`` and turns a
call's output into sequences through ``_sequences`` (every tree since the script gained its
token check); issue 45 compares today's tokens with c1bb73c's this way. Two files compare
with ``--compare A.json B.json``, row by row (one pair per run).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import cProfile
import io
import json
import pathlib
import pstats
import sys


def _load_script():
    path = pathlib.Path.cwd() / "scripts" / "tok_per_s.py"
    spec = importlib.util.spec_from_file_location("tok_per_s_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recording(modules: list, digests: list[dict], save) -> None:
    """Wrap each module's ``run_variant`` (to know the row) and ``_sequences`` so every row's
    sequences are digested under the row's key (variant, batch size, drafts; ``#n`` for a
    repeat) and saved at once (a run stopped by a timeout keeps the rows it finished)."""
    current = {"key": None}
    seen: dict[str, int] = {}
    for module in modules:
        if hasattr(module, "run_variant"):
            run_variant = module.run_variant

            def keyed(name, case, *args, run_variant=run_variant, **kwargs):
                key = f"{name} B={case.batch_size} G={case.num_drafts}"
                seen[key] = seen.get(key, 0) + 1
                current["key"] = f"{key} #{seen[key]}"
                return run_variant(name, case, *args, **kwargs)

            module.run_variant = keyed
        original = module._sequences

        def recorded(output, original=original):
            sequences = original(output)
            data = sequences.detach().to("cpu").contiguous().numpy().tobytes()
            digests.append({"row": current["key"], "shape": list(sequences.shape),
                            "sha256": hashlib.sha256(data).hexdigest()})
            save()
            return sequences

        module._sequences = recorded


def _profiling(modules: list, directory: pathlib.Path) -> None:
    """Wrap each module's ``timed_calls`` so that each row's timed calls are followed by one
    call under cProfile."""
    import torch

    rows = [0]
    for module in modules:
        if not hasattr(module, "timed_calls"):
            continue
        original = module.timed_calls

        def profiled(generate, reps, cuda, original=original):
            result = original(generate, reps, cuda)
            profiler = cProfile.Profile()
            profiler.enable()
            generate()
            if cuda:
                torch.cuda.synchronize()
            profiler.disable()
            text = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(30)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"row{rows[0]}.txt").write_text(text.getvalue())
            if cuda:
                (directory / f"row{rows[0]}_kernels.txt").write_text(_kernel_table(generate))
            rows[0] += 1
            return result

        module.timed_calls = profiled


def _kernel_table(generate) -> str:
    """One more call under torch.profiler: its wall time, the device time of its kernels
    (those its CUDA graphs replay included) and the kernels by total device time."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        started = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.device_time for e in events)
    head = (f"wall {wall * 1e3:.2f} ms (under the profiler); device kernels {len(events)}, "
            f"{device_us / 1e3:.2f} ms\n")
    return head + trace.key_averages().table(sort_by="device_time_total", row_limit=40)


def record(digests_path: pathlib.Path, script_args: list[str],
           profile: pathlib.Path | None = None) -> int:
    script = _load_script()
    modules = [script] if hasattr(script, "_sequences") else []
    try:
        library = importlib.import_module("flashspec.bench.tok_per_s")
    except ImportError:
        library = None
    if library is not None and hasattr(library, "_sequences"):
        modules.append(library)
    if not modules:
        raise SystemExit("sequence_digests.py: this tree's tok_per_s has no _sequences to wrap")
    digests: list[dict] = []

    def save() -> None:
        digests_path.parent.mkdir(parents=True, exist_ok=True)
        digests_path.write_text(json.dumps({"args": script_args, "calls": digests}, indent=1) + "\n")

    _recording(modules, digests, save)
    if profile is not None:
        _profiling(modules, profile)
    sys.argv = ["tok_per_s.py", *script_args]
    save()
    status = script.main()
    print(f"wrote {digests_path} ({len(digests)} calls)")
    return status


def compare(first: pathlib.Path, second: pathlib.Path) -> int:
    """The rows both files hold, matched by key: how many give the same sequences."""
    a = {call["row"]: call for call in json.loads(first.read_text())["calls"]}
    b = {call["row"]: call for call in json.loads(second.read_text())["calls"]}
    both = sorted(set(a) & set(b))
    different = [row for row in both if a[row]["sha256"] != b[row]["sha256"]]
    print(f"{len(both) - len(different)} of the {len(both)} rows both ran give the same "
          f"sequences ({first.name}: {len(a)} rows, {second.name}: {len(b)})")
    for row in different:
        print(f"  different: {row}")
    for row in sorted(set(a) ^ set(b)):
        print(f"  only in {first.name if row in a else second.name}: {row}")
    return 0 if not different and set(a) == set(b) else 1


def main() -> int:
    argv = sys.argv[1:]
    script_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, script_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--digests", type=pathlib.Path, help="where to write this run's digests")
    group.add_argument("--compare", type=pathlib.Path, nargs=2, metavar=("A", "B"),
                       help="two digest files: how many calls agree")
    parser.add_argument("--profile", type=pathlib.Path,
                        help="a folder: one more call per row under cProfile, its stats there")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    return record(args.digests, script_args, args.profile)


if __name__ == "__main__":
    sys.exit(main())
