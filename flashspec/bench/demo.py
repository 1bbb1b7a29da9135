"""flashspec demo: a code model pair, stock transformers next to flashspec.

Loads the built-in tiny pair (a target and a draft trained on the Python standard library,
`flashspec/assets/tiny_pair`, made by `scripts/train_tiny_pair.py`) or any pair given by
hub id or path, completes a few code prompts with stock `generate` and with
`generate(sampler="flash")` (plain, prompt lookup, assistant, and an EAGLE-3 head: the
pair's own, `flashspec/assets/tiny_pair/eagle3`, or --eagle3), and prints the text, the
acceptance statistics and the speed side by side. CPU or GPU, whichever is there.

    python -m flashspec [--target ID_OR_PATH --draft ID_OR_PATH [--eagle3 ID_OR_PATH]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import Eagle3, from_pretrained
from ..assets import tiny_pair_path
from ..generation.cpu import SMALL_STEP_BYTES, weight_bytes

TINY_PAIR = tiny_pair_path()

_FUNCTION = '''def _parse_header(line, default=None):
    """Split a header line into its name and value."""
    name, sep, value = line.partition(":")
    if not sep:
        return default
    name = name.strip().lower()
    value = value.strip()
    return name, value
'''
PROMPTS = {
    "open: a function": "def read_config(path):\n    \"\"\"Read a configuration file",
    "open: a class": "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
    # Editing code the prompt already holds: prompt lookup can copy long stretches.
    "edit: rename a function": (_FUNCTION + "\n\n# The same, renamed to parse_header:\n"
                                "def parse_header(line, default=None):\n"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashspec",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(TINY_PAIR / "target"),
                        help="target model: hub id or folder (default: the built-in tiny pair)")
    parser.add_argument("--draft", default=str(TINY_PAIR / "draft"),
                        help="draft model with the same tokenizer: hub id or folder")
    parser.add_argument("--eagle3", default=None,
                        help="EAGLE-3 head trained for --target: hub id or folder (default: the "
                             "built-in pair's with the built-in target, none otherwise)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per completion")
    parser.add_argument("--num-drafts", type=int, default=4,
                        help="drafts per verification (assistant and prompt lookup)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where to run (auto: CUDA when available)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="weights dtype (auto: float32 for the built-in pair and on CPU, "
                             "where greedy tokens must equal stock's exactly; bfloat16 for other "
                             "models on CUDA, where fp32 accumulation may break near-ties "
                             "differently from stock)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled comparison")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each mode per prompt, in turn; the table gives the median")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_drafts < 1 or args.repeats < 1:
        parser.error("--max-new-tokens, --num-drafts and --repeats must be >= 1")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    builtin = args.target == str(TINY_PAIR / "target")
    if args.eagle3 is None and builtin:
        args.eagle3 = str(TINY_PAIR / "eagle3")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "auto": torch.bfloat16 if device == "cuda" and not builtin else torch.float32}[args.dtype]
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    threads = torch.get_num_threads()
    try:
        return _demo(args, device, dtype)
    finally:
        torch.set_num_threads(threads)      # the demo may run on one (`_demo`)


def _demo(args, device: str, dtype: torch.dtype) -> int:
    for name in (args.target, args.draft, args.eagle3 or ""):
        if name.startswith(str(TINY_PAIR)) and not Path(name).is_dir():
            raise SystemExit(f"{name} is missing: train the pair with scripts/train_tiny_pair.py "
                             "or pass --target/--draft")
    tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")
    target = from_pretrained(args.target, dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(device).eval()
    eagle3 = Eagle3.from_pretrained(args.eagle3, target) if args.eagle3 else None
    millions = lambda m: sum(p.numel() for p in m.parameters()) / 1e6  # noqa: E731
    threads = torch.get_num_threads()
    weights = [*target.parameters(), *draft.parameters()]
    if device == "cpu" and weight_bytes(weights) < SMALL_STEP_BYTES:
        # Stock's rows too: models this small decode fastest on one thread (flashspec's
        # CPU decode steps choose it themselves), and on a busy machine many times faster.
        torch.set_num_threads(1)
        print(f"torch threads: 1 for every row, of {threads} ({SMALL_STEP_BYTES >> 20} MiB "
              "of weights or fewer: `flashspec.generation.cpu`)")
    print(f"target {args.target} ({millions(target):.1f}M params), draft {args.draft} "
          f"({millions(draft):.1f}M), {device}, {str(dtype).replace('torch.', '')}, "
          f"{args.max_new_tokens} new tokens, greedy unless said, times the median of "
          f"{args.repeats} runs")
    print("On a CPU this shows exactness (the same tokens as stock) and acceptance at stock's "
          "speed or better; on a GPU flashspec's fused LM head and captured steps add "
          "speed (BENCHMARKS.md).\n" if device == "cpu" else "")

    draft.generation_config.num_assistant_tokens = args.num_drafts
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    modes = {
        "stock HF": dict(),
        "stock HF + prompt lookup": dict(prompt_lookup_num_tokens=args.num_drafts),
        "stock HF + assistant": dict(assistant_model=draft),
        "flash": dict(sampler="flash"),
        "flash + prompt lookup": dict(sampler="flash", prompt_lookup_num_tokens=args.num_drafts),
        "flash + assistant": dict(sampler="flash", assistant_model=draft,
                                  num_assistant_tokens=args.num_drafts),
    }
    if eagle3 is not None:      # stock transformers has no EAGLE-3 to compare with
        modes["flash + EAGLE-3"] = dict(sampler="flash", drafter=eagle3,
                                        num_assistant_tokens=args.num_drafts)
    warm_up = tokenizer("import os\n", return_tensors="pt").to(device)
    for kwargs in modes.values():       # first calls pay for allocation and compilation
        _timed(target, warm_up, max_new_tokens=4, do_sample=False,
               pad_token_id=tokenizer.pad_token_id, **kwargs)
    for label, prompt in PROMPTS.items():
        inputs = tokenizer(prompt, return_tensors="pt").to(device)
        common = dict(max_new_tokens=args.max_new_tokens, do_sample=False,
                      pad_token_id=tokenizer.pad_token_id)
        results = _median_runs(target, inputs, modes, common, args.repeats)
        stock = results["stock HF"][0]
        completion = tokenizer.decode(stock[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"=== {label} ===\n{prompt}\033[1m{completion}\033[0m\n")
        print(f"  {'mode':22s} {'tokens':>6s} {'ms':>8s} {'tok/s':>7s} {'tok/forward':>11s}"
              f"  {'acceptance by draft position':28s} same as stock")
        for name, (sequences, seconds, stats) in results.items():
            new = sequences.shape[1] - inputs["input_ids"].shape[1]
            per_forward = f"{stats.mean_accepted_length:11.2f}" if stats is not None else " " * 11
            alphas = (" ".join(f"{a:.2f}" for a in stats.per_position_acceptance.tolist())
                      if stats is not None else "")
            same = torch.equal(sequences.cpu(), stock.cpu())
            print(f"  {name:22s} {new:6d} {seconds * 1e3:8.1f} {new / seconds:7.1f} {per_forward}"
                  f"  {alphas:28s} {same}")
        print()

    inputs = tokenizer(PROMPTS["open: a function"], return_tensors="pt").to(device)
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.8,
                    top_p=0.95, seed=args.seed, pad_token_id=tokenizer.pad_token_id)
    plain = _timed(target, inputs, sampler="flash", **sampling)[0]
    drafted = {"assistant": dict(assistant_model=draft)}
    if eagle3 is not None:
        drafted["EAGLE-3"] = dict(drafter=eagle3)
    same = all(torch.equal(plain, _timed(target, inputs, sampler="flash",
                                         num_assistant_tokens=args.num_drafts, **kwargs,
                                         **sampling)[0])
               for kwargs in drafted.values())
    print(f"sampled (T=0.8, top_p=0.95, top_k=50, seed={args.seed}): flash and flash + "
          f"{' / '.join(drafted)} emit the same tokens: {same}")
    print(tokenizer.decode(plain[0], skip_special_tokens=True))
    return 0


def _median_runs(model, inputs, modes: dict, common: dict, repeats: int) -> dict:
    """Per mode: (sequences, median seconds, stats) of `repeats` runs, the modes taken in
    turn so that each sees the same machine (a shared CPU's load moves from run to run)."""
    runs = {name: [] for name in modes}
    for _ in range(repeats):
        for name, kwargs in modes.items():
            runs[name].append(_timed(model, inputs, **common, **kwargs))
    return {name: (timed[0][0], statistics.median(t[1] for t in timed), timed[0][2])
            for name, timed in runs.items()}


def _timed(model, inputs, **kwargs):
    """(sequences, seconds, flashspec stats or None) of one generate call."""
    flash = kwargs.get("sampler") == "flash"
    if flash:
        kwargs["return_dict_in_generate"] = True
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs)
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return (out.sequences, seconds, out.flash_stats) if flash else (out, seconds, None)


if __name__ == "__main__":
    raise SystemExit(main())
