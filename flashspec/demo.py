"""flashspec demo (the main job until the trained default model pair lands).

Samples from a small LM head with transformers' sampling semantics through the torch
reference, shows that empirical frequencies match the exact float64 distribution, that
speculative verification emits exactly the tokens plain sampling gives, and runs
`generate(sampler="flash")` on a tiny random Llama: plain, with an assistant, with the
target as its own assistant and with prompt lookup, all emitting the same seeded tokens.

    python -m flashspec.demo [--vocab 32] [--samples 20000] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

from . import SamplingParams, reference
from .testing import goodness_of_fit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary size of the toy head")
    parser.add_argument("--dim", type=int, default=64, help="hidden size of the toy head")
    parser.add_argument("--samples", type=int, default=20_000, help="draws per configuration")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy weights and noise")
    args = parser.parse_args(argv)

    g = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(args.vocab, args.dim, generator=g) / args.dim**0.5
    hidden = torch.randn(1, args.dim, generator=g) * 2.0
    configs = {
        "greedy": GenerationConfig(do_sample=False),
        "HF default sampling (top_k=50)": GenerationConfig(do_sample=True),
        "Qwen3 (T=0.6, top_k=20, top_p=0.95)": GenerationConfig(
            do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
        "min_p=0.1, T=1.5": GenerationConfig(do_sample=True, temperature=1.5, min_p=0.1),
    }
    print(f"toy LM head: V={args.vocab}, D={args.dim}; {args.samples} draws per config\n")
    print(f"{'configuration':38s} {'support':>7s} {'top token p':>11s} {'chi2 p-value':>12s}"
          f" {'ms':>7s}")
    for name, config in configs.items():
        params = SamplingParams.from_generation_config(config, args.samples, seed=args.seed)
        rows = hidden.expand(args.samples, -1).contiguous()
        start = time.perf_counter()
        tokens = reference.lm_head_sample(rows, weight, params, torch.arange(args.samples))
        elapsed = (time.perf_counter() - start) * 1e3
        logits64 = reference.compute_logits(hidden.double(), weight.double())
        one_row = SamplingParams.from_generation_config(config, 1, seed=args.seed)
        exact = reference.transform_logits(logits64, one_row).softmax(-1)[0]
        if bool(one_row.is_greedy[0]):
            exact = torch.nn.functional.one_hot(logits64.argmax(-1)[0], args.vocab).double()
        fit = goodness_of_fit(tokens, exact)
        print(f"{name:38s} {int((exact > 0).sum()):7d} {float(exact.max()):11.4f}"
              f" {fit.pvalue:12.3f} {elapsed:7.1f}")

    params = SamplingParams.from_generation_config(configs["Qwen3 (T=0.6, top_k=20, top_p=0.95)"],
                                                   4, seed=args.seed)
    hidden_steps = torch.randn(4, 6, args.dim, generator=g) * 2.0
    positions = torch.tensor([10, 20, 30, 40])
    plain = torch.stack([reference.lm_head_sample(hidden_steps[:, j], weight, params, positions + j)
                         for j in range(6)], dim=1)
    drafts = plain[:, :5].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % args.vocab       # row 1: third draft wrong
    drafts[2] = torch.randint(0, args.vocab, (5,), generator=g)  # row 2: random drafts
    out = reference.lm_head_verify(hidden_steps, weight, drafts, params, positions)
    print("\nspeculative verification (strict rule), 5 drafts per row:")
    for b in range(4):
        n = int(out.num_accepted[b])
        same = out.tokens[b, : n + 1].tolist() == plain[b, : n + 1].tolist()
        print(f"  row {b}: accepted {n}, emitted {out.tokens[b, :n + 1].tolist()}, "
              f"identical to plain sampling: {same}")
    _generate_demo(args.seed)
    return 0


def _generate_demo(seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from . import wrap

    def tiny_llama(layers: int, init_seed: int):
        torch.manual_seed(init_seed)
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             pad_token_id=0, bos_token_id=None, eos_token_id=None)
        return LlamaForCausalLM(config).eval()

    target, assistant = wrap(tiny_llama(2, seed)), tiny_llama(1, seed + 1)
    prompts = torch.tensor([[0, 0, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 9, 10, 11, 12]])
    mask = (prompts != 0).long()
    modes = {"plain": {}, "random assistant (G=4)": dict(assistant_model=assistant, num_assistant_tokens=4),
             "target as assistant (G=8)": dict(assistant_model=target, num_assistant_tokens=8),
             "prompt lookup (N=4)": dict(prompt_lookup_num_tokens=4)}
    samplings = {"greedy": dict(do_sample=False),
                 "T=0.7, top_k=20, seeded": dict(do_sample=True, temperature=0.7, top_k=20, seed=seed)}
    for label, sampling in samplings.items():
        print(f"\ngenerate(sampler='flash') on a tiny random Llama (V=256), batch 2 with left "
              f"padding, {label}:")
        plain = None
        for name, drafting in modes.items():
            start = time.perf_counter()
            out = target.generate(prompts, attention_mask=mask, sampler="flash", max_new_tokens=24,
                                  return_dict_in_generate=True, **sampling, **drafting)
            elapsed = (time.perf_counter() - start) * 1e3
            plain = out.sequences if plain is None else plain
            stats = out.flash_stats
            print(f"  {name:27s} target forwards {stats.num_steps:3d}, tokens per forward "
                  f"{stats.mean_accepted_length:4.2f}, same tokens as plain: "
                  f"{torch.equal(out.sequences, plain)}, {elapsed:6.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
