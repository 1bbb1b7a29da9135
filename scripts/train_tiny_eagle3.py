"""Train the EAGLE-3 head that flashspec ships for its tiny target (flashspec/assets/tiny_pair).

Why: the tiny pair's draft model gives demos, tests and acceptance runs a real draft; an
EAGLE-3 head needs the same, trained for that target, offline. This script trains one on the
text the pair was trained on (the standard library's source, scripts/train_tiny_pair.py's
split and tokenizer), and saves it in the published format (`flashspec.Eagle3`, loaded by
the same `Eagle3.from_pretrained` users call).

What it does:

1. Data: the pair's train / validation files, encoded with the target's tokenizer.
2. Draft vocabulary: the `--draft-vocab` most frequent tokens of the train stream, sorted
   (EAGLE-3's ``d2t``: target id = draft id + d2t[draft id]).
3. Training, with the target frozen: its hidden states entering layers 2, N // 2 and N - 3
   (the default taps) and its next-token distributions, on random windows. The head learns
   EAGLE-3's objective with training-time test: `--unroll` steps, step 0 reading ``fc`` of the
   target's states at each position p and the token at p + 1, step j the head's own output of
   step j - 1 at p - 1 (what chain drafting feeds it), each step's attention seeing the
   target-based entries up to p - j and its own chain's entries (EAGLE-3's mask); the loss
   is the cross-entropy against the target's distribution at p + 1 over the draft vocabulary
   (renormalised), summed over steps with weights 0.8^j. AdamW, cosine schedule, the best
   validation loss kept.
4. Save in the published format, reload with `Eagle3.from_pretrained`, and write
   ``MODEL_CARD.md`` and ``summary.json`` beside it (with the command line and the
   validation numbers). Acceptance is measured by scripts/acceptance_rate.py --drafter eagle3.

Run (from the repository root):

    python scripts/train_tiny_eagle3.py                          # into flashspec/assets/tiny_pair/eagle3
    python scripts/train_tiny_eagle3.py --steps 20 --eval-every 10 --out /tmp/e3   # smoke

The shipped head took 178 s on an H200 (2026-11-28; its MODEL_CARD.md); on a 2-core CPU a
step takes about 1.5 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import flashspec  # noqa: E402
from flashspec.generation.eagle3_model import Eagle3Model, default_taps  # noqa: E402
import train_tiny_pair as pair  # noqa: E402  (the pair's data pipeline)

TARGET = REPO / "flashspec" / "assets" / "tiny_pair" / "target"
DEFAULT_OUT = REPO / "flashspec" / "assets" / "tiny_pair" / "eagle3"
STEP_DECAY = 0.8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=TARGET, help="target folder; default the tiny pair's")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder; default %(default)s")
    parser.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary; default 2048")
    parser.add_argument("--ffn", type=int, default=768, help="head MLP width; default 768")
    parser.add_argument("--unroll", type=int, default=3, help="training-time test steps; default 3")
    parser.add_argument("--seq-len", type=int, default=256, help="window tokens; default 256")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step; default 16")
    parser.add_argument("--steps", type=int, default=5000, help="optimizer steps; default 5000")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate; default 2e-3")
    parser.add_argument("--eval-every", type=int, default=500, help="steps between validations; default 500")
    parser.add_argument("--seed", type=int, default=0, help="seed; default 0")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device; default cuda if available")
    return parser.parse_args(argv)


def target_features(target, windows: torch.Tensor, taps: tuple[int, ...]):
    """The target's tapped states ``[B, T, 3 H]`` and next-token log-probabilities ``[B, T, V]``."""
    with torch.no_grad():
        out = target(windows, output_hidden_states=True)
        states = torch.cat([out.hidden_states[k] for k in taps], dim=-1)
        return states.float(), out.logits.float().log_softmax(-1)


def ttt_outputs(head: Eagle3Model, states: torch.Tensor, following: torch.Tensor,
                unroll: int) -> list[torch.Tensor]:
    """The head's layer outputs of each training-time test step ``[B, T, H]`` (module
    docstring): step j's query at p sees step 0's keys at positions <= p - j and step s's
    (1 <= s <= j) at p - (j - s)."""
    layer, attention = head.midlayer, head.midlayer.self_attn
    batch, length, _ = states.shape
    positions = torch.arange(length, device=states.device)
    embeds = head.get_input_embeddings()(following).float()
    cos, sin = head.rotary_emb(embeds, positions[None])
    head_dim = attention.head_dim
    hidden = head.combine(states)
    keys, values, outputs = [], [], []
    for step in range(unroll):
        if step:
            hidden = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))          # p takes p - 1's output
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        shape = (batch, length, -1, head_dim)
        q = attention.q_proj(x).view(shape).transpose(1, 2)
        k = attention.k_proj(x).view(shape).transpose(1, 2)
        v = attention.v_proj(x).view(shape).transpose(1, 2)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        keys.append(k.repeat_interleave(groups, 1))
        values.append(v.repeat_interleave(groups, 1))
        query, key = positions[:, None], positions[None, :]
        masks = [key <= query - step] + [key == query - (step - s) for s in range(1, step + 1)]
        scores = torch.cat([q @ kk.transpose(-1, -2) for kk in keys], dim=-1) * head_dim ** -0.5
        scores = scores.masked_fill(~torch.cat(masks, dim=-1), float("-inf"))
        weights = torch.nan_to_num(scores.softmax(-1))          # rows that see nothing: zeros
        attended = weights @ torch.cat(values, dim=-2)
        attended = attention.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        h1 = residual + attended
        outputs.append(h1 + layer.mlp(layer.post_attention_layernorm(h1)))
    return outputs


def _rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def ttt_loss(head: Eagle3Model, target, windows: torch.Tensor, taps, used: torch.Tensor,
             unroll: int) -> tuple[torch.Tensor, list[float]]:
    """Mean over steps (weights 0.8^j) of the cross-entropy to the target's distribution of
    the token at p + 2 over the draft vocabulary; each step's top-1 agreement with the
    target's argmax (where the target's argmax is a draft token)."""
    states, logprobs = target_features(target, windows, taps)
    # position p: the target's states at p, the token at p + 1; the label is the target's
    # distribution at p + 1 (of the token at p + 2)
    states, following, teacher = states[:, :-2], windows[:, 1:-1], logprobs[:, 1:-1]
    teacher_draft = teacher[..., used].softmax(-1)
    in_draft = torch.isin(teacher.argmax(-1), used)
    losses, agreement = [], []
    for step, hidden in enumerate(ttt_outputs(head, states, following, unroll)):
        logits = head.draft_logits(hidden)
        valid = torch.arange(hidden.shape[1], device=hidden.device) >= step
        loss = -(teacher_draft * logits.log_softmax(-1)).sum(-1)
        losses.append(STEP_DECAY ** step * loss[:, valid].mean())
        hit = (used[logits.argmax(-1)] == teacher.argmax(-1)) & in_draft
        agreement.append(float(hit[:, valid].float().sum() / in_draft[:, valid].float().sum()))
    return sum(losses) / sum(STEP_DECAY ** j for j in range(unroll)), agreement


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    corpus = pair.load_corpus(pair.stdlib_root(), None)
    train = pair.encode_stream(tokenizer, [text for _, text in corpus.train])
    valid = pair.encode_stream(tokenizer, [text for _, text in corpus.valid])
    config = target.config
    vocab = config.vocab_size
    counts = torch.bincount(train, minlength=vocab)
    used = counts.topk(args.draft_vocab).indices.sort().values.to(device)
    taps = default_taps(config.num_hidden_layers)
    head_config = LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=args.ffn,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        vocab_size=vocab, draft_vocab_size=args.draft_vocab, num_hidden_layers=1,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_parameters["rope_theta"], pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    head = Eagle3Model(head_config, own_embeddings=False).to(device)
    head.share_embeddings(target.get_input_embeddings())
    with torch.no_grad():
        head.d2t.copy_(used - torch.arange(args.draft_vocab, device=device))
        head.t2d.copy_(torch.isin(torch.arange(vocab, device=device), used))
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    valid_windows = pair.make_windows(valid, args.seq_len, 64 * args.seq_len).to(device)

    def validate() -> tuple[float, list[float]]:
        head.eval()
        with torch.no_grad():
            losses, agreements = [], []
            for start in range(0, len(valid_windows), args.batch_size):
                loss, agreement = ttt_loss(head, target, valid_windows[start:start + args.batch_size],
                                           taps, used, args.unroll)
                losses.append(float(loss))
                agreements.append(agreement)
        head.train()
        return sum(losses) / len(losses), [sum(a) / len(a) for a in zip(*agreements)]

    best, best_state, history = math.inf, None, []
    head.train()
    for step in range(1, args.steps + 1):
        windows = pair.sample_batch(train, args.batch_size, args.seq_len, generator).to(device)
        factor = pair.lr_factor(step / args.steps)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * factor
        loss, _ = ttt_loss(head, target, windows, taps, used, args.unroll)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            valid_loss, agreement = validate()
            history.append({"step": step, "train_loss": float(loss), "valid_loss": valid_loss,
                            "valid_top1_agreement": agreement})
            print(json.dumps(history[-1]), flush=True)
            if valid_loss < best:
                best = valid_loss
                best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    head.load_state_dict(best_state)
    drafter = flashspec.Eagle3(head.to(torch.bfloat16).eval(), target.to(torch.bfloat16), taps)
    drafter.save_pretrained(args.out)
    loaded = flashspec.Eagle3.from_pretrained(args.out, target)        # the users' loader
    assert loaded.taps == taps
    best_entry = min(history, key=lambda entry: entry["valid_loss"])
    summary = {
        "target": str(args.target.relative_to(REPO) if args.target.is_relative_to(REPO) else args.target),
        "taps": list(taps), "draft_vocab_size": args.draft_vocab,
        "draft_vocab_coverage_of_train_tokens": float(counts[used.cpu()].sum() / counts.sum()),
        "parameters": sum(p.numel() for p in head.parameters()),
        "bytes_bf16": (args.out / "model.safetensors").stat().st_size,
        "unroll": args.unroll, "steps": args.steps, "best": best_entry, "history": history,
        "command": "python scripts/train_tiny_eagle3.py " + shlex.join(argv or sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(time.time() - started, 1),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_card(args.out, summary)
    print(f"wrote {args.out} ({summary['seconds']} s)")
    return 0


def write_card(out: Path, summary: dict) -> None:
    best = summary["best"]
    agreement = ", ".join(f"{100 * a:.1f}%" for a in best["valid_top1_agreement"])
    (out / "MODEL_CARD.md").write_text(f"""# flashspec tiny pair: EAGLE-3 head for the target

An EAGLE-3 draft head for `../target`, trained by `scripts/train_tiny_eagle3.py` on the
pair's training text (the Python standard library's source, the pair's split and tokenizer),
with the target frozen. Published format: `config.json` (`LlamaForCausalLMEagle3`,
`eagle_config.eagle_aux_hidden_state_layer_ids` = {[k - 1 for k in summary['taps']]}, i.e. the
inputs of target layers {summary['taps']}) and `model.safetensors` (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`; no `embed_tokens`: the target's is shared).

Load: `flashspec.Eagle3.from_pretrained("<this folder>", target_model)`, then
`target_model.generate(..., sampler="flash", drafter=head, num_assistant_tokens=4)`.

* {summary['parameters']:,} parameters, {summary['bytes_bf16']:,} bytes in bfloat16.
* Draft vocabulary: the {summary['draft_vocab_size']:,} most frequent training tokens
  ({100 * summary['draft_vocab_coverage_of_train_tokens']:.1f}% of the training tokens).
* Training-time test over {summary['unroll']} steps, {summary['steps']} optimizer steps; best
  validation loss {best['valid_loss']:.3f} at step {best['step']}; its top-1 agreement with
  the target's greedy token (where that token is in the draft vocabulary), by chain step:
  {agreement}.
* Command: `{summary['command']}` ({summary['device']}, {summary['date']}, {summary['seconds']} s).

Acceptance on the shipped prompt sets: `scripts/acceptance_rate.py --drafter eagle3`
(BENCHMARKS.md). It is a tiny model of Python-like text only.
""")


if __name__ == "__main__":
    raise SystemExit(main())
