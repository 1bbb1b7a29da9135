"""What the vocab-parallel head step spends past its collective, on one GPU: the torch merge of
the ranks' summaries (`flashspec.parallel.merge`, `acceptance`) against the one-kernel merge
(`kernels.merge_shard_summaries`), each captured in a CUDA graph and replayed; and the
shard's summaries (stage 1 over the shard, stage 2 per row) for scale.

Two ranks' words are made on one GPU: the fused summaries of each half of Llama-3.1-8B's
head (D 4096, V 128,256) stacked as the all-gather would leave them (the collective itself
is not timed: 7.5 us for 8 KB on 2 H200s, docs/notes/tp_capture.md §8).

    python probes/merge_time.py [--out merge_time.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from flashspec import SamplingParams, kernels
from flashspec.bench import parallel_head
from flashspec.outputs import NON_FINITE, OK, SampleOutput
from flashspec.parallel import VocabShards, acceptance, merge, summary

DIM, VOCAB, DRAFTS = 4096, 128256, 3
MODES = {"greedy": dict(do_sample=False), "sample": dict(temperature=1.0, top_k=0),
         "top-k 50": dict(temperature=0.7, top_k=50)}


def graphed_us(step) -> float:
    """Microseconds per replay of `step` captured alone (the head benchmark's timing)."""
    return parallel_head.time_step(step)["us"]


def torch_merge(words, layout, shards, params, positions, drafts):
    """What `parallel.sampling` runs after the exchange on its torch route."""
    if drafts is None:
        rows = merge.merge_rows(summary.unpack(words, layout), shards, params, positions)
        return SampleOutput(torch.where(rows.finite, rows.tokens, -1),
                            torch.where(rows.finite, rows.logprobs, float("nan")),
                            torch.where(rows.finite, rows.lse, float("nan")),
                            torch.where(rows.finite, OK, NON_FINITE).to(torch.int32))
    positions_per_row = drafts.shape[1] + 1
    flat = acceptance.flat_drafts(drafts)
    flat_params = params.repeat_interleave(positions_per_row, validate=False)
    offsets = torch.arange(positions_per_row, device=positions.device)
    flat_positions = (positions[:, None] + offsets[None, :]).flatten()
    rows = merge.merge_rows(summary.unpack(words, layout), shards, flat_params, flat_positions,
                            flat)
    return acceptance.accept(rows, drafts, params, positions, "probabilistic")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    sizes = (VOCAB // 2, VOCAB - VOCAB // 2)
    shards = [VocabShards(sizes, rank) for rank in range(2)]
    g = torch.Generator(device).manual_seed(0)
    weight = (torch.randn(VOCAB, DIM, generator=g, device=device) / DIM**0.5).bfloat16()
    halves = [weight[s.offset:s.offset + s.size] for s in shards]
    rows = []
    for batch in map(int, args.batch_sizes.split(",")):
        for op in ("sample", "verify"):
            positions_per_row = DRAFTS + 1 if op == "verify" else 1
            hidden = (torch.randn(batch, positions_per_row, DIM, generator=g, device=device)
                      * 2).bfloat16()
            if op == "sample":
                hidden = hidden[:, 0]
            drafts = (torch.randint(0, VOCAB, (batch, DRAFTS), generator=g, device=device)
                      if op == "verify" else None)
            for mode, settings in MODES.items():
                params = SamplingParams.create(batch, seed=0, device=device, **settings)
                positions = torch.arange(batch, device=device) + 100
                layout = summary.summary_layout(op, shards[0], params)

                shard_drafts = (None if drafts is None else
                                acceptance.flat_drafts(drafts).view(batch, -1)[:, :-1])

                def summary_of(part, weight_part):
                    return kernels.fused_shard_summaries(
                        hidden, weight_part, layout, params, positions, part.offset, VOCAB,
                        drafts=shard_drafts)

                words = torch.stack([summary_of(*pair) for pair in zip(shards, halves)])
                row = {"op": op, "mode": mode, "batch_size": batch,
                       "summary_us": graphed_us(lambda: summary_of(shards[0], halves[0])),
                       "torch_merge_us": graphed_us(lambda: torch_merge(
                           words, layout, shards[0], params, positions, drafts))}
                row["kernel_merge_us"] = graphed_us(lambda: kernels.merge_shard_summaries(
                    words, layout, VOCAB, params, positions, drafts, "probabilistic"))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"{torch.cuda.get_device_name()}: us per call, CUDA graph replays")
    print(f"{'op':7} {'mode':9} {'B':>3} {'summary':>8} {'torch merge':>11} {'kernel':>7}")
    for r in rows:
        print(f"{r['op']:7} {r['mode']:9} {r['batch_size']:3d} {r['summary_us']:8.1f} "
              f"{r['torch_merge_us']:11.1f} {r['kernel_merge_us']:7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
