"""The acceptance report for people and spreadsheets: the CSV, the plot and the table that
scripts/acceptance_rate.py writes from its JSON report."""

from __future__ import annotations

import csv
from pathlib import Path

from flashspec.bench.cli import pyplot_or_note


# CSV: a row's own fields, then its expected_accepted check's, then alpha_i, alpha_expected_i.
CSV_ROW_COLUMNS = ("drafter", "prompt_set", "num_drafts", "prompts", "seconds",
                   "generated_tokens", "forwards", "verifications", "drafted", "accepted",
                   "acceptance_rate", "accepted_per_verification", "tokens_per_verification",
                   "tokens_per_forward")
CSV_CHECK_COLUMNS = {"expected_accepted": "mean", "expected_accepted_std": "std", "z": "z",
                     "agrees": "agrees"}


def write_csv(report: dict, path: Path) -> None:
    """One line per configuration: CSV_ROW_COLUMNS, CSV_CHECK_COLUMNS, then alpha_i and
    alpha_expected_i for i up to the largest G (empty past a configuration's own G or where
    i was never reached)."""
    widest = max(report["args"]["num_drafts"])
    columns = [*CSV_ROW_COLUMNS, *CSV_CHECK_COLUMNS,
               *(f"alpha_{i}" for i in range(1, widest + 1)),
               *(f"alpha_expected_{i}" for i in range(1, widest + 1))]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in report["rows"]:
            line = {key: row[key] for key in CSV_ROW_COLUMNS}
            line.update({column: row["expected_accepted"][key]
                         for column, key in CSV_CHECK_COLUMNS.items()})
            for i, (alpha, expected) in enumerate(zip(row["positions"]["alpha"],
                                                      row["positions"]["alpha_expected"]), 1):
                line[f"alpha_{i}"], line[f"alpha_expected_{i}"] = alpha, expected
            writer.writerow(line)
    print(f"wrote {path}")


def write_plot(report: dict, path: Path) -> None:
    """Per drafter: alpha_i at the largest G (realised with +-2 standard errors, expected
    dashed), tokens per target forward against G, and the accepted-length distribution at
    the largest G (bars realised, dots expected)."""
    plt = pyplot_or_note(path)
    if plt is None:
        return
    args = report["args"]
    widest = max(args["num_drafts"])
    fig, axes = plt.subplots(len(args["drafter"]), 3, figsize=(16, 4.5 * len(args["drafter"])),
                             squeeze=False)
    bar_width = 0.8 / len(args["prompt_set"])
    for (ax_alpha, ax_tokens, ax_lengths), drafter in zip(axes, args["drafter"]):
        for index, name in enumerate(args["prompt_set"]):
            rows = [row for row in report["rows"]
                    if row["drafter"] == drafter and row["prompt_set"] == name]
            color = f"C{index}"
            ax_tokens.plot([row["num_drafts"] for row in rows],
                           [row["tokens_per_forward"] for row in rows], "o-", color=color,
                           label=name)
            widest_row = next(row for row in rows if row["num_drafts"] == widest)
            positions, lengths = widest_row["positions"], widest_row["accepted_length"]
            reached = [i for i, alpha in enumerate(positions["alpha"]) if alpha is not None]
            ax_alpha.errorbar([i + 1 for i in reached], [positions["alpha"][i] for i in reached],
                              yerr=[2 * positions["alpha_stderr"][i] for i in reached],
                              fmt="o-", color=color, capsize=3, label=f"{name} realised")
            ax_alpha.plot([i + 1 for i in reached],
                          [positions["alpha_expected"][i] for i in reached], "--", color=color,
                          label=f"{name} expected")
            total = max(sum(lengths["counts"]), 1)
            offsets = [k + (index - (len(args["prompt_set"]) - 1) / 2) * bar_width
                       for k in range(widest + 1)]
            ax_lengths.bar(offsets, [c / total for c in lengths["counts"]], width=bar_width,
                           color=color, label=name)
            ax_lengths.plot(offsets, [e / total for e in lengths["expected"]], "k.")
        ax_alpha.set(xlabel="draft position i", ylabel="alpha_i", ylim=(0, 1.05),
                     title=f"{drafter}: acceptance by position, G={widest} (+-2 s.e.)")
        ax_tokens.set(xlabel="drafts per verification G", ylabel="tokens per target forward",
                      xticks=args["num_drafts"], title=f"{drafter}: tokens per forward")
        ax_lengths.set(xlabel="accepted drafts", ylabel="fraction of verifications",
                       title=f"{drafter}: accepted lengths, G={widest} (dots: expected)")
        for ax in (ax_alpha, ax_tokens, ax_lengths):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{_models_text(report)}, {report['device']}, {_decoding_text(report)}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


TABLE_LEGEND = """\
verifs = target forwards with drafts; acc/v = accepted drafts per verification; tok/f = tokens
per target forward; accepted, expected = total accepted drafts, and the total that p(x)
predicts +- its standard deviation; z = (accepted - expected) / sd, ok = |z| <= 3 (greedy: sd
is 0 and ok means exactly equal); max|z_i| = the largest per-position z (alpha_i against its
expectation); alpha_i = P(draft i accepted | the drafts before it accepted)."""


def _models_text(report: dict) -> str:
    models = report["models"]
    parts = [f"target {models['target']}, draft {models['draft'] or '-'}"]
    if models["weights"] != "trained":
        parts.append(models["weights"])
    if models["tokenizer"] != models["target"]:
        parts.append(f"prompts by the tokenizer {models['tokenizer']}")
    return "; ".join(parts)


def _decoding_text(report: dict) -> str:
    if not report["args"]["sample"]:
        return "greedy"
    return "sampled (T={temperature}, top-k {top_k}, top-p {top_p}, min-p {min_p})".format(
        **report["sampling"])


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def print_table(report: dict) -> None:
    print(f"\n{_models_text(report)} on {report['device']} ({report['dtype']}), "
          f"{_decoding_text(report)}, up to {report['args']['new_tokens']} new tokens")
    print(TABLE_LEGEND)
    print(f"{'drafter':9} {'prompt_set':10} {'G':>2} {'verifs':>6} {'acc/v':>5} {'tok/f':>5} "
          f"{'accepted':>8} {'expected':>17} {'z':>6} {'ok':>3} {'max|z_i|':>8}  alpha_1..G")
    for row in report["rows"]:
        check = row["expected_accepted"]
        alphas = " ".join("  -  " if a is None else f"{a:.3f}" for a in row["positions"]["alpha"])
        position_z = [abs(z) for z in row["positions"]["alpha_z"] if z is not None]
        worst = f"{max(position_z):.2f}" if position_z else "-"
        print(f"{row['drafter']:9} {row['prompt_set']:10} {row['num_drafts']:2d} "
              f"{row['verifications']:6d} {row['accepted_per_verification']:5.2f} "
              f"{row['tokens_per_forward']:5.2f} {row['accepted']:8d} "
              f"{check['mean']:9.1f} +-{check['std']:6.1f} {_signed(check['z']):>6} "
              f"{'yes' if check['agrees'] else 'NO':>3} "
              f"{worst:>8}  {alphas}")
