"""The tok/s report for people: the table printed last by scripts/tok_per_s.py and its
plot (a panel per pair, bars of tok/s grouped by (B, decoding))."""

from __future__ import annotations

import math
from pathlib import Path

from flashspec.bench.cli import pyplot_or_note
from flashspec.bench.tok_per_s import RANDOM_PROMPTS, VARIANTS


# Bar colours (tab20 indices): stock in greys and muted hues, each flash drafter one hue, its
# materialized twin the lighter shade of it.
VARIANT_COLORS = {"hf": 15, "hf_static_compile": 14, "hf_assisted_self": 11, "hf_assisted": 17,
                  "hf_lookup": 13, "flash_plain": 0, "flash_self": 2, "flash_self_materialized": 3,
                  "flash_draft": 4, "flash_draft_materialized": 5, "flash_lookup": 6,
                  "flash_lookup_materialized": 7, "flash_eagle3": 8,
                  "flash_mtp": 9}
G_HATCHES = ("", "//", "..", "xx", "\\\\", "++")


def _plot_series(report: dict, pair: str) -> dict:
    """(variant, G) -> {(B, decoding): tok/s} for the rows of `pair` that ran, in table order."""
    series = {}
    for row in report["rows"]:
        if row["pair"] == pair and row["tok_s"] is not None:
            bars = series.setdefault((row["variant"], row["num_drafts"]), {})
            bars[row["batch_size"], row["decoding"]] = row["tok_s"]
    return dict(sorted(series.items(),
                       key=lambda item: (list(VARIANTS).index(item[0][0]), item[0][1] or 0)))


def _minor_tick_label(value: float, every: bool) -> str:
    """`value` written plainly (not 2x10^2), where `every` minor tick is labelled or `value`
    is 2 or 5 times a power of ten (all of them would crowd an axis over a decade tall)."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if every or round(mantissa) in (2, 5) else ""


def _plot_pair(ax, report: dict, pair: str) -> None:
    """Bars of tok/s: x groups (B, decoding), a bar per (variant, G) that ran, coloured by
    variant and, when more than one G ran, hatched by G and labelled with it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    args = report["args"]
    groups = [(batch, decoding) for batch in args["batch_sizes"] for decoding in args["decoding"]]
    series = _plot_series(report, pair)
    sweep = len(args["num_drafts"]) > 1
    palette = plt.get_cmap("tab20")
    width = 0.8 / max(len(series), 1)
    for index, ((name, num_drafts), tok_s) in enumerate(series.items()):
        bars = [(group + index * width, tok_s[key]) for group, key in enumerate(groups)
                if key in tok_s]
        hatch = "" if num_drafts is None or not sweep else G_HATCHES[
            args["num_drafts"].index(num_drafts) % len(G_HATCHES)]
        label = name if num_drafts is None or not sweep else f"{name} G={num_drafts}"
        ax.bar(*zip(*bars), width=width, color=palette(VARIANT_COLORS[name]), hatch=hatch,
               edgecolor="0.25", linewidth=0.3, label=label)
    ax.set_xticks([group + 0.4 - width / 2 for group in range(len(groups))],
                  [f"B={batch}, {decoding}" for batch, decoding in groups])
    described = report["pairs"][pair]
    ax.set(yscale="log", ylabel="tokens / s",
           title=f"{pair}: {described['target']} + {described['draft'] or 'no draft'} "
                 f"({described['weights']}); {report['device']}{_ranks_text(report)}, "
                 f"{report['prompts']['source']} prompts")
    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # not 10^2
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda value, _: _minor_tick_label(value, every=high / low < 10)))
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def write_plot(report: dict, path: Path) -> None:
    """One panel per pair (see _plot_pair), wide enough for its bars; log y axis."""
    plt = pyplot_or_note(path)
    if plt is None:
        return
    pairs = list(report["pairs"])
    groups = len(report["args"]["batch_sizes"]) * len(report["args"]["decoding"])
    bars = groups * max(len(_plot_series(report, pair)) for pair in pairs)
    fig, axes = plt.subplots(len(pairs), 1, figsize=(min(40.0, max(10.0, 3.0 + 0.15 * bars)),
                                                     4.5 * len(pairs)), squeeze=False)
    for ax, pair in zip(axes[:, 0], pairs):
        _plot_pair(ax, report, pair)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def _fmt(value, width: int, digits: int = 0) -> str:
    if value is None or isinstance(value, str):
        return f"{value or '-':>{width}}"
    return f"{value:{width}.{digits}f}"


def _steps_text(steps: dict | None) -> str:
    if steps is None:
        return "-"
    if "plain" in steps:
        return f"plain {steps['plain']:.3f}"
    return f"draft {steps['draft_round']:.3f} + verify {steps['verify']:.3f}"


def _assumed_text(row: dict, length: float | None) -> str:
    assumed = (row["expected_tok_s"] or {}).get("at_assumed_acceptance")
    return "" if assumed is None else f"  @{length:g}: {assumed:.1f} tok/s"


TABLE_LEGEND = """\
tok/s = B * new tokens / median s; 1st s = seconds of the first call (compilation and graph
capture included); x_stc, x_hf = / hf_static_compile, / hf; x_stk = / the stock
twin (assisted or lookup, same G); x_mat = fused / materialized (same G); acc = accepted /
drafted; len = tokens per target forward; exp@1 = tok/s the step graphs allow at acceptance 1;
bw = weight bytes read per s / copy bandwidth; B/row = bytes each rank sent per row per step
in flashspec's LM-head exchange (tensor-parallel runs; a verified position is a row);
ms/step = GPU ms of the captured plain step, or of a round of G drafts and the verification
of G drafts; with --assumed-acceptance-length L, "@L" after it: the tok/s those steps give at
L tokens per round (computed, not measured)."""


def _ranks_text(report: dict) -> str:
    """", 2 ranks (gloo)" for a tensor-parallel run; "" for one process."""
    world_size = report["world_size"]
    return "" if world_size == 1 else f", {world_size} ranks ({report['backend']})"


def print_table(report: dict) -> None:
    args = report["args"]
    decodings = "; ".join(
        "greedy" if name == "greedy" else "sample (T={temperature}, top-k {top_k}, top-p {top_p}, "
        "seed {seed})".format(**values) for name, values in report["decodings"].items())
    print(f"\n{report['device']}{_ranks_text(report)}, copy bandwidth "
          f"{report['copy_gbps']:.0f} GB/s, {args['dtype']}, {decodings}; "
          f"{report['prompts']['source']} prompts of {args['prompt_length']} "
          f"tokens{'' if args['prompts'] == RANDOM_PROMPTS else ' at most'} + "
          f"{args['new_tokens']} new tokens; G in {','.join(map(str, args['num_drafts']))}")
    print(TABLE_LEGEND)
    width = max([4] + [len(row["pair"]) for row in report["rows"]])
    print(f"{'pair':{width}} {'B':>3} {'dec':6} {'G':>2} {'variant':25} {'tok/s':>9} {'1st s':>6} "
          f"{'x_stc':>6} {'x_hf':>6} {'x_stk':>6} {'x_mat':>6} {'acc':>5} {'len':>5} "
          f"{'exp@1':>9} {'bw':>5} {'B/row':>6}  ms/step")
    for row in report["rows"]:
        head = (f"{row['pair']:{width}} {row['batch_size']:3d} {row['decoding']:6} "
                f"{_fmt(row['num_drafts'], 2)} {row['variant']:25}")
        if row["status"] != "ok":
            print(f"{head} {row['status']}"[:160])
            continue
        ratio, stats = row["ratio"], row["flash_stats"] or {}
        expected = (row["expected_tok_s"] or {}).get("all_accepted")
        sent = (row["exchange"] or {}).get("bytes_per_row_per_step")
        print(f"{head} {_fmt(row['tok_s'], 9, 1)} {_fmt(row['first_call_seconds'], 6, 1)} "
              f"{_fmt(ratio['vs_hf_static_compile'], 6, 2)} "
              f"{_fmt(ratio['vs_hf'], 6, 2)} {_fmt(ratio['vs_stock_assisted'], 6, 2)} "
              f"{_fmt(ratio['vs_materialized'], 6, 2)} {_fmt(stats.get('acceptance_rate'), 5, 2)} "
              f"{_fmt(stats.get('mean_accepted_length'), 5, 2)} {_fmt(expected, 9, 1)} "
              f"{_fmt(row['weight_bandwidth_fraction'], 5, 2)} {_fmt(sent, 6, 1)}  "
              f"{_steps_text(row['step_ms'])}"
              f"{_assumed_text(row, args.get('assumed_acceptance_length'))}")
