"""Acceptance of the built-in tiny pair, measured by the engine on held-out code.

Takes prompts from the standard-library files that `scripts/train_tiny_pair.py` held out
(listed in the pair's summary.json; read from the running interpreter's stdlib), runs
`generate(sampler="flash")` greedily in one batch with the draft as assistant (G drafts per
verification) and with prompt lookup, and prints per-position acceptance and tokens per
verification; JSON with --out.

    PYTHONPATH=. python scripts/pair_acceptance.py [--prompts 64] [--prompt-tokens 64]
        [--new-tokens 128] [--num-drafts 4] [--device auto] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashspec
from flashspec.assets import tiny_pair_path


def heldout_prompts(tokenizer, count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` tokens, spread evenly over the held-out files' tokens."""
    summary = json.loads((tiny_pair_path() / "summary.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8", errors="replace")
             for name in summary["data"]["heldout_files"] if (stdlib / name).is_file()]
    ids = torch.tensor(tokenizer("\n".join(texts))["input_ids"])
    starts = torch.linspace(0, len(ids) - length - 1, count).long()
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts (one batch)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--num-drafts", type=int, default=4, help="drafts per verification")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("prompts", "prompt_tokens", "new_tokens", "num_drafts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    pair = tiny_pair_path()
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    target = flashspec.from_pretrained(pair / "target", dtype=torch.float32).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair / "draft", dtype=torch.float32).to(device).eval()
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_tokens).to(device)
    common = dict(sampler="flash", max_new_tokens=args.new_tokens, do_sample=False,
                  return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=None)   # measure full-length continuations
    results = {}
    # No confidence threshold: every verification checks G drafts, on the CPU as on CUDA.
    for mode, drafting in {"assistant": dict(assistant_model=draft, num_assistant_tokens=args.num_drafts,
                                             assistant_confidence_threshold=0.0),
                           "prompt_lookup": dict(prompt_lookup_num_tokens=args.num_drafts)}.items():
        stats = target.generate(prompts, **common, **drafting).flash_stats
        verifications = int((stats.drafted > 0).sum())
        results[mode] = {
            "per_position_acceptance": [round(a, 4) for a in stats.per_position_acceptance.tolist()],
            "accepted_drafts_per_verification": float(stats.accepted.sum()) / max(verifications, 1),
            "tokens_per_verification": float(stats.emitted[stats.drafted > 0].sum()) / max(verifications, 1),
            "verifications": verifications,
        }
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "num_drafts": args.num_drafts, "results": results}
    for mode, result in results.items():
        alphas = " ".join(f"{a:.3f}" for a in result["per_position_acceptance"])
        print(f"{mode:14s} acceptance by position [{alphas}]  accepted drafts per verification "
              f"{result['accepted_drafts_per_verification']:.3f}  tokens per verification "
              f"{result['tokens_per_verification']:.3f}  ({result['verifications']} verifications)")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
