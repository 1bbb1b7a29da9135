"""transformers' own generation tests with every `generate` routed to ``sampler="flash"``.

Runs, for each architecture, the tests that `GenerationTesterMixin`
(``tests/generation/test_utils.py``) defines, as collected from
``tests/models/<arch>/test_modeling_<arch>.py``, twice: stock (plain transformers) and routed
(the `route_flash` plugin, ``FLASHSPEC_ROUTE=1``, one JSON line per `generate` call). Prints
tests run, stock and routed passes, the tests that pass on stock and fail routed (with their
failure's first line and their calls' outcomes), the calls by outcome (RAN / RAN_MATERIALIZED
/ DEFERRED / REFUSED / CRASHED, by reason), the share flashspec ran, and whether greedy calls
it ran gave stock's tokens (and, where not, whether stock's own scores tie there); writes all
of it as JSON to ``--out`` (the junit XML, pytest logs and the call log beside it).

``--tests-root`` is the root of transformers' tests: by default ``upstream/`` beside this
file, the part of them that Llama's, GPT-2's and Bloom's tests need (vendored, see its
README), which CI runs (tests/test_transformers_suite.py); or a transformers checkout's root
(``tests/``, ``conftest.py``, ``pyproject.toml``, and ``src/transformers`` where
``tests/pipelines`` finds it: a link to the installed package does) matching the installed
transformers, for the 23 architectures of `ARCHS`. The tests import ``parameterized`` (in
flashspec's test extra) and, in a checkout, ``timeout_decorator`` (opt) and (``tests/pipelines``,
never run here) ``datasets``; ``--pythonpath`` adds a folder holding them (a stub ``datasets``
module is enough). A file that fails to collect is named in a warning. The testers draw their
inputs from an unseeded `random.Random`, so counts can move by a call or two between runs.

    python tests/transformers_suite/run_suite.py                      # the vendored three
    python tests/transformers_suite/run_suite.py --tests-root /tmp/tf_tests \
        --pythonpath /tmp/tf_deps --out /tmp/tf_suite_out/result.json -n 2    # 23 architectures
    ... --archs llama,gpt2 --no-compare      # two architectures, no greedy token check
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UPSTREAM = os.path.join(HERE, "upstream")
ARCHS = ("llama mistral mixtral qwen2 qwen3 gemma gemma2 phi phi3 gpt2 gptj gpt_neo gpt_neox "
         "opt bloom falcon codegen stablelm starcoder2 olmo cohere granite mamba").split()


def archs_in(root: str) -> list[str]:
    """The architectures of `ARCHS` whose test file `root` holds."""
    return [a for a in ARCHS
            if os.path.exists(os.path.join(root, f"tests/models/{a}/test_modeling_{a}.py"))]


def environment(pythonpath: str = "", flashspec: str = REPO) -> dict:
    """The tests' environment: the plugin's folder, `flashspec`'s and `pythonpath` importable,
    one thread per process, Triton's interpreter without CUDA, routing off."""
    import torch

    paths = [p for p in (pythonpath, HERE, os.path.abspath(flashspec),
                         os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    for name in ("FLASHSPEC_ROUTE", "FLASHSPEC_ROUTE_LOG", "FLASHSPEC_ROUTE_COMPARE",
                 "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(name, None)
    return env


def run_routed(root: str, ids: list[str], env: dict, workers: int, out: str,
               compare: bool = True, timeout: float | None = None) -> tuple[dict, list[dict]]:
    """The tests run with every `generate` routed to flashspec: their results (`run_pytest`)
    and one record per call (`route_flash`)."""
    log = os.path.join(out, "calls.jsonl")
    if os.path.exists(log):
        os.remove(log)
    routed_env = {**env, "FLASHSPEC_ROUTE": "1", "FLASHSPEC_ROUTE_LOG": log,
                  "FLASHSPEC_ROUTE_COMPARE": "1" if compare else "0"}
    results = run_pytest(root, ids, routed_env, workers, out, "routed", timeout)
    calls = []
    if os.path.exists(log):
        with open(log) as lines:
            calls = [json.loads(line) for line in lines]
    return results, calls


def mixin_tests(root: str) -> set[str]:
    """The test names `GenerationTesterMixin` defines."""
    tree = ast.parse(open(os.path.join(root, "tests/generation/test_utils.py")).read())
    mixin = next(n for n in tree.body if isinstance(n, ast.ClassDef)
                 and n.name == "GenerationTesterMixin")
    return {f.name for f in mixin.body if isinstance(f, ast.FunctionDef)
            and f.name.startswith("test_")}


def collect(root: str, archs: list[str], env: dict) -> list[str]:
    """Node ids of the mixin's tests (parameterized expansions included) in the archs' files."""
    files = [f"tests/models/{a}/test_modeling_{a}.py" for a in archs]
    missing = [f for f in files if not os.path.exists(os.path.join(root, f))]
    if missing:
        raise SystemExit(f"no such test files: {missing}")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *files], cwd=root, env=env,
                          capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"collection failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    for arch, file in zip(archs, files):
        if not any(i.startswith(file + "::") for i in ids):
            errors = [line for line in done.stdout.splitlines() if line.startswith("E ")]
            print(f"warning: nothing collected from {file} ({'; '.join(errors)[:300]})")
    names = mixin_tests(root)
    pattern = re.compile(r"(%s)(_\d+(_\w+)?)?" % "|".join(map(re.escape, sorted(names))))
    return [i for i in ids if pattern.fullmatch(i.rsplit("::", 1)[-1])]


def run_pytest(root: str, ids: list[str], env: dict, workers: int, out: str, label: str,
               timeout: float | None = None) -> dict:
    """Runs the tests (a `subprocess.TimeoutExpired` after `timeout` seconds); their results
    by node id: (status, first line of the failure)."""
    junit = os.path.join(out, f"{label}.junit.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
               "route_flash", f"--junitxml={junit}", "-o", "junit_family=xunit1", *ids]
    if workers > 1:
        command[3:3] = ["-n", str(workers), "--dist", "loadfile"]
    started = time.time()
    with open(os.path.join(out, f"{label}.log"), "w") as log:
        subprocess.run(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                       timeout=timeout)
    print(f"{label}: {len(ids)} tests in {time.time() - started:.0f} s", flush=True)
    return parse_junit(junit)


def parse_junit(path: str) -> dict:
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module, cls = case.get("classname").rsplit(".", 1)
        nodeid = f"{module.replace('.', '/')}.py::{cls}::{case.get('name')}"
        status, message = "passed", ""
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(child)
            if found is not None:
                status = name
                message = (found.get("message") or found.text or "").strip().split("\n")[0][:240]
                break
        results[nodeid] = (status, message)
    return results


def summarize(ids, stock, routed, calls) -> dict:
    def count(results, status):
        return sum(1 for s, _ in results.values() if s == status)

    by_test = collections.defaultdict(list)
    for call in calls:
        by_test[call["test"]].append(call["outcome"] + (f" {call['reason']}" if call.get("reason") else ""))
    regressions = [{"test": i, "routed": routed.get(i, ("missing", ""))[0],
                    "failure": routed.get(i, ("", ""))[1],
                    "calls": dict(collections.Counter(by_test.get(i, [])))}
                   for i in ids if stock.get(i, ("",))[0] == "passed"
                   and routed.get(i, ("",))[0] != "passed"]
    fixed = [i for i in ids if stock.get(i, ("",))[0] in ("failed", "error")
             and routed.get(i, ("",))[0] == "passed"]
    outcomes = collections.Counter(c["outcome"] for c in calls)
    reasons = {o: dict(collections.Counter(c.get("reason") for c in calls if c["outcome"] == o)
                       .most_common()) for o in outcomes}
    ran = outcomes["RAN"] + outcomes["RAN_MATERIALIZED"]
    compared = [c for c in calls if c.get("tokens_equal") is not None]
    return {
        "tests": len(ids),
        "stock": {s: count(stock, s) for s in ("passed", "failed", "error", "skipped")},
        "routed": {s: count(routed, s) for s in ("passed", "failed", "error", "skipped")},
        "regressions": regressions, "fixed_by_routing": fixed,
        "calls": len(calls), "outcomes": dict(outcomes), "reasons": reasons,
        "ran_percent": round(100 * ran / len(calls), 1) if calls else None,
        "greedy_compared": len(compared),
        "greedy_equal": sum(c["tokens_equal"] for c in compared),
        "greedy_different": [{k: c.get(k) for k in ("test", "model", "outcome", "reason",
                                                     "divergence", "scores_dtype", "tie_in_stock")}
                             for c in compared if not c["tokens_equal"]],
        "greedy_different_ties": sum(bool(c.get("tie_in_stock")) for c in compared
                                     if not c["tokens_equal"]),
        "compare_errors": [c for c in calls if c.get("compare_error")],
        "crashes": [{k: c.get(k) for k in ("test", "model", "error", "traceback")}
                    for c in calls if c["outcome"] == "CRASHED"],
        "refusals": [{k: c.get(k) for k in ("test", "model", "error")}
                     for c in calls if c["outcome"] == "REFUSED"],
    }


def report(s: dict) -> None:
    print(f"\ntests: {s['tests']} collected, {s['tests'] - s['stock']['skipped']} not skipped on "
          f"stock\n  stock:  {s['stock']}\n  routed: {s['routed']}")
    print(f"\npass on stock, fail routed: {len(s['regressions'])}")
    for r in s["regressions"]:
        print(f"  {r['test']}  [{r['routed']}] {r['failure']}\n      calls: {r['calls']}")
    if s["fixed_by_routing"]:
        print(f"fail on stock, pass routed: {s['fixed_by_routing']}")
    print(f"\ncalls: {s['calls']}   flashspec ran {s['ran_percent']}%")
    for outcome in ("RAN", "RAN_MATERIALIZED", "DEFERRED", "REFUSED", "CRASHED"):
        n = s["outcomes"].get(outcome, 0)
        detail = ", ".join(f"{k} {v}" for k, v in s["reasons"].get(outcome, {}).items() if k)
        print(f"  {outcome:17s} {n:5d}  {detail}")
    print(f"\ngreedy calls flashspec ran, compared with stock: {s['greedy_equal']} of "
          f"{s['greedy_compared']} gave stock's tokens; of the others, "
          f"{s['greedy_different_ties']} at a tie of stock's own scores")
    for d in s["greedy_different"]:
        print(f"  different: {d}")
    for c in s["crashes"]:
        print(f"  crash: {c['test']} {c['model']}: {c['error']}\n      {c['traceback']}")


def flashspec_version(root: str, env: dict) -> dict:
    """Where the routed run's flashspec came from (imported as pytest does, from the tests'
    root), and the git state of its checkout."""
    where = subprocess.run([sys.executable, "-c", "import flashspec; print(flashspec.__file__)"],
                           cwd=root, env=env, capture_output=True, text=True).stdout.strip()
    git = ["git", "-C", os.path.dirname(where)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--short", "--", "."], capture_output=True,
                           text=True).stdout.split("\n") if head else []
    marker = os.path.join(os.path.dirname(os.path.dirname(where)), "COMMIT")   # an export's
    if not head and os.path.exists(marker):
        head = open(marker).read().strip() + " (export)"
    return {"path": where, "git_head": head or None, "uncommitted": [d for d in dirty if d]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests-root", default=UPSTREAM)
    parser.add_argument("--archs", default=None,
                        help="comma-separated (default: those of ARCHS the root holds)")
    parser.add_argument("--out", default="/tmp/tf_suite_out/result.json")
    parser.add_argument("-n", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--pythonpath", default="", help="extra folders for the tests' imports")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip rerunning greedy calls on stock to compare tokens")
    parser.add_argument("--flashspec", default=REPO,
                        help="folder holding the flashspec package to route to (default: this "
                             "checkout; e.g. a `git archive HEAD flashspec` export)")
    parser.add_argument("--skip-stock", action="store_true",
                        help="reuse the stock junit XML already in --out's folder")
    args = parser.parse_args()

    out = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out, exist_ok=True)
    env = environment(args.pythonpath, args.flashspec)
    archs = ([a.strip() for a in args.archs.split(",") if a.strip()] if args.archs
             else archs_in(args.tests_root))
    ids = collect(args.tests_root, archs, env)
    print(f"{len(ids)} GenerationTesterMixin tests in {len(archs)} architectures", flush=True)

    stock = (parse_junit(os.path.join(out, "stock.junit.xml")) if args.skip_stock
             else run_pytest(args.tests_root, ids, env, args.n, out, "stock"))
    routed, calls = run_routed(args.tests_root, ids, env, args.n, out, not args.no_compare)

    summary = summarize(ids, stock, routed, calls)
    summary.update(archs=archs, tests_root=os.path.abspath(args.tests_root),
                   flashspec=flashspec_version(args.tests_root, {**env, "FLASHSPEC_ROUTE": "1"}),
                   results={i: {"stock": stock.get(i), "routed": routed.get(i)} for i in ids})
    report(summary)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nwrote {args.out} (calls: {os.path.join(out, 'calls.jsonl')})")


if __name__ == "__main__":
    main()
