"""Train the tiny target/draft pair that flashspec ships for demos, tests and acceptance runs.

Why: speculative decoding needs a target and a draft that share a tokenizer and agree often,
and flashspec must not download anything. So this script trains both from scratch on text
that every machine with Python has, the standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``), in a few minutes on one GPU (slowly, small, on CPU).

What it does, in order:

1. Data: every ``*.py`` under the stdlib folder, in sorted relative-path order, skipping test
   suites (often not installed, e.g. on Debian/Ubuntu), third-party packages, and two
   generated folders (``encodings``: codec tables; ``pydoc_data``: one big English string).
   Each file goes to train (85%), valid (5%, picks the best checkpoint) or held-out (10%,
   only for the final numbers) by a SHA-256 of its relative path, so the split is the same
   on every machine and run (Python's ``hash()`` is salted per process).
2. Tokenizer: byte-level BPE trained with ``tokenizers`` on the train files only (lossless on
   any text), one special token ``<|endoftext|>`` used as EOS, BOS and pad, saved as a
   ``PreTrainedTokenizerFast`` with left padding. Files are joined with EOS between them.
3. Target: a Llama (or Qwen3) causal LM trained on random windows of the train stream with
   bf16 autocast (CUDA), fused AdamW and a cosine schedule; the checkpoint with the lowest
   validation loss is kept.
4. Draft: a smaller model of the same architecture and vocabulary, trained by distillation
   from the saved target (KL to the target's next-token distribution, mixed with plain
   cross-entropy by ``--distill-weight``), because speculative decoding pays off only
   when the draft's greedy tokens are the target's.
5. Both are saved in bfloat16 (HF folders: config, generation config, safetensors,
   tokenizer), reloaded from disk and measured on the held-out files: perplexity of target,
   draft and the uniform distribution, greedy agreement (share of held-out positions where
   draft argmax == target argmax) and a simulated greedy speculative decode (target greedy
   continuations of held-out prompts, the draft proposing 4 tokens per verification).
6. ``MODEL_CARD.md`` and ``summary.json`` are written next to the two folders, from those
   measurements.

Run (from the repository root):

    python scripts/train_tiny_pair.py                             # GPU, into flashspec/assets/tiny_pair
    python scripts/train_tiny_pair.py --out "$OUT/tiny_pair"      # on the device machine
    python scripts/train_tiny_pair.py --device cpu --max-train-chars 200000 --vocab-size 1024 \\
        --seq-len 64 --batch-size 8 --steps 20 --target-layers 2 --target-hidden 64 \\
        --target-ffn 128 --draft-layers 1 --draft-hidden 64 --draft-ffn 128 --out /tmp/tp  # smoke

The run length per model is the smallest of ``--steps`` (if given), ``--epochs`` worth of
steps and the ``--minutes`` budget; the cosine schedule follows whichever limit is closest,
so the learning rate reaches its floor when training stops. While the step limit binds (the
usual case on a GPU) a run is repeatable given the seed, up to CUDA's nondeterministic
kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "flashspec" / "assets" / "tiny_pair"
EOS = "<|endoftext|>"

# Folder names skipped anywhere in the stdlib tree: test suites (absent on many installs, so
# including them would make the data depend on the distribution), third-party packages, and
# generated data that is not code people write (codec tables, pydoc's topics string).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__", "encodings", "pydoc_data"})
HELDOUT_PERCENT = 10
VALID_PERCENT = 5

ARCHS = ("llama", "qwen3")
DEVICES = ("auto", "cpu", "cuda")
MAX_POSITIONS = 2048          # config.max_position_embeddings: room for prompt + generation
SPEC_DRAFT_TOKENS = 4         # drafts per verification in the simulated speculative decode
SPEC_PROMPT_TOKENS = 64
WARMUP_FRACTION = 0.05
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
LOG_LINES = 20                # progress lines per model (more when slow: LOG_SECONDS)
LOG_SECONDS = 30.0
VALID_EVALS = 8               # validation passes per model (best checkpoint kept)


@dataclass(frozen=True)
class Shape:
    """Size of one model; heads share hidden evenly (head_dim = hidden / heads)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int


DEFAULT_TARGET = Shape(layers=6, hidden=256, heads=4, kv_heads=2, ffn=768)
# The committed pair (flashspec/assets/tiny_pair) was chosen on an H200 among drafts of 1-2
# layers and hidden 128-256: a 2 x 256 draft distils to the target's own perplexity (31 vs
# 31, no clear gap); 2 x 128 or 1 x 192 fall to 55% agreement (1.7 drafts accepted of 4);
# 2 x 224 keeps a clear gap (28.3 vs 35.4) and accepts 1.93 of 4 (2.93 tokens per target
# forward). The target overfits after about 5 epochs; the best validation checkpoint is kept.
DEFAULT_DRAFT = Shape(layers=2, hidden=224, heads=4, kv_heads=2, ffn=672)


# ---------------------------------------------------------------- data


@dataclass
class Corpus:
    """The stdlib files of each split as (relative path, text), in sorted path order."""
    root: str
    train: list[tuple[str, str]]
    valid: list[tuple[str, str]]
    heldout: list[tuple[str, str]]
    train_chars_total: int       # before --max-train-chars


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the *.py files under `root`, sorted, minus EXCLUDED_DIRS."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            found.append(rel.as_posix())
    return sorted(found)


def split_of(rel_path: str) -> str:
    """'train', 'valid' or 'heldout', from a SHA-256 of the path (stable across processes)."""
    bucket = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    if bucket < HELDOUT_PERCENT + VALID_PERCENT:
        return "valid"
    return "train"


def read_text(path: Path) -> str:
    """File text as written (no newline translation); undecodable bytes become U+FFFD."""
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        return handle.read()


def load_corpus(root: Path, max_train_chars: int | None) -> Corpus:
    """Reads and splits the stdlib files; `max_train_chars` keeps only the first train files
    (the last one cut), for quick CPU runs. Valid and held-out are never cut here."""
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "valid": [], "heldout": []}
    for rel in list_source_files(root):
        text = read_text(root / rel)
        if text.strip():
            splits[split_of(rel)].append((rel, text))
    total = sum(len(text) for _, text in splits["train"])
    if max_train_chars is not None:
        kept, budget = [], max_train_chars
        for rel, text in splits["train"]:
            if budget <= 0:
                break
            kept.append((rel, text[:budget]))
            budget -= len(text)
        splits["train"] = kept
    if not all(splits.values()):
        raise RuntimeError(f"too few Python files under {root}: {[len(v) for v in splits.values()]}"
                           " (train, valid, held-out)")
    return Corpus(str(root), splits["train"], splits["valid"], splits["heldout"], total)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """Byte-level BPE (GPT-2 pre-tokenization, so runs of indentation stay together) with one
    special token, EOS, which also serves as BOS and pad. Returns a PreTrainedTokenizerFast
    (left padding, no spaces cleaned up on decode, so decode(encode(s)) == s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, padding_side="left", model_max_length=max_length,
                                   clean_up_tokenization_spaces=False)


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, EOS after each (the document boundary the models see)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- models


def model_config(arch: str, shape: Shape, vocab_size: int, eos_id: int):
    """HF config of `arch`: tied embeddings (half the bytes), EOS as BOS/EOS/pad, bf16."""
    from transformers import LlamaConfig, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    return config_class(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, dtype="bfloat16")


def build_model(arch: str, shape: Shape, vocab_size: int, eos_id: int, seed: int, device):
    """A freshly initialised float32 model (the seed fixes the weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = model_config(arch, shape, vocab_size, eos_id)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)


def count_params(model) -> int:
    """Distinct parameters (the tied LM head counted once)."""
    return sum(p.numel() for p in model.parameters())


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain float32 on CPU (CPU bf16 is slow and gains nothing)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------- training


def lr_factor(progress: float) -> float:
    """Linear warmup, then cosine from 1 down to MIN_LR_RATIO at progress 1."""
    if progress < WARMUP_FRACTION:
        return max(progress / WARMUP_FRACTION, 1e-3)
    t = min((progress - WARMUP_FRACTION) / (1 - WARMUP_FRACTION), 1.0)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * t))


def make_optimizer(model, lr: float, device: torch.device):
    """AdamW (fused on CUDA); weight decay on matrices only, not on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int,
                 generator: torch.Generator) -> torch.Tensor:
    """`batch` random windows of seq_len + 1 tokens (inputs and shifted labels)."""
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator)
    index = starts[:, None] + torch.arange(seq_len + 1)
    return stream[index.to(stream.device)]


def batch_losses(model, windows: torch.Tensor, teacher=None) -> dict[str, torch.Tensor]:
    """Mean next-token NLL of `model` on `windows`; with a teacher also the mean KL(teacher ||
    model) per position and the teacher's logits (for agreement counts)."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs).logits.float().flatten(0, 1)
    out = {"logits": logits, "nll": F.cross_entropy(logits, labels.flatten())}
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits.float().flatten(0, 1)
        out["teacher_logits"] = teacher_logits
        out["kl"] = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1),
                             log_target=True, reduction="batchmean")
    return out


def objective(losses: dict[str, torch.Tensor], distill_weight: float) -> torch.Tensor:
    """The training loss: NLL alone without a teacher, else the distillation mix."""
    if "kl" not in losses:
        return losses["nll"]
    return distill_weight * losses["kl"] + (1 - distill_weight) * losses["nll"]


def plan_steps(args, train_tokens: int) -> int:
    """Step limit: --steps if given, else --epochs passes over the train stream."""
    if args.steps is not None:
        return args.steps
    return max(1, math.ceil(args.epochs * train_tokens / (args.batch_size * args.seq_len)))


def train_model(name: str, model, stream: torch.Tensor, valid: torch.Tensor, args,
                device: torch.device, teacher=None) -> dict:
    """Trains `model` in place and loads the weights of its best validation pass back into it.

    Progress (step / planned steps or elapsed / --minutes, whichever is further) drives the
    cosine schedule and ends training at 1, so the schedule completes under either limit.
    """
    total_steps = plan_steps(args, len(stream) - 1)
    budget_s = args.minutes * 60
    optimizer = make_optimizer(model, args.lr, device)
    generator = torch.Generator().manual_seed(args.seed + (1 if teacher is None else 2))
    log_every = max(1, total_steps // LOG_LINES)
    eval_every = max(1, total_steps // VALID_EVALS)
    best = {"loss": float("inf"), "step": 0, "state": None}
    tokens_per_step = args.batch_size * args.seq_len
    print(f"[{name}] {count_params(model):,} parameters; up to {total_steps} steps of "
          f"{tokens_per_step:,} tokens ({total_steps * tokens_per_step / len(stream):.1f} "
          f"epochs) or {args.minutes:g} min", flush=True)
    model.train()
    start = time.perf_counter()
    step, progress, stopped_by, last_log = 0, 0.0, "steps", 0.0
    while progress < 1.0:
        lr = args.lr * lr_factor(progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        windows = sample_batch(stream, args.batch_size, args.seq_len, generator)
        with autocast(device):
            losses = batch_losses(model, windows, teacher)
            loss = objective(losses, args.distill_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - start
        time_progress = elapsed / budget_s
        progress = max(step / total_steps, time_progress)
        if progress >= 1.0 and time_progress > step / total_steps:
            stopped_by = "minutes"
        if step % eval_every == 0 or progress >= 1.0:
            valid_loss = evaluate_objective(model, valid, args, device, teacher)
            improved = valid_loss < best["loss"]
            if improved:
                best = {"loss": valid_loss, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            print(f"[{name}] step {step}: validation loss {valid_loss:.4f}"
                  + (" (best so far)" if improved else ""), flush=True)
            model.train()
        if step % log_every == 0 or progress >= 1.0 or elapsed - last_log > LOG_SECONDS:
            last_log = elapsed
            extra = f" | kl {losses['kl'].item():.3f}" if "kl" in losses else ""
            print(f"[{name}] step {step}/{total_steps} | {elapsed:7.1f} s | "
                  f"{step * tokens_per_step / elapsed:,.0f} tok/s | loss {loss.item():.4f} | "
                  f"nll {losses['nll'].item():.4f}{extra} | lr {lr:.2e}", flush=True)
    seconds = time.perf_counter() - start
    model.load_state_dict(best["state"])
    print(f"[{name}] done: {step} steps in {seconds:.1f} s (stopped by --{stopped_by}); "
          f"best validation loss {best['loss']:.4f} at step {best['step']}", flush=True)
    return {"steps": step, "planned_steps": total_steps, "stopped_by": stopped_by,
            "seconds": round(seconds, 1), "tokens": step * tokens_per_step,
            "epochs": round(step * tokens_per_step / len(stream), 2),
            "best_step": best["step"], "best_valid_loss": round(best["loss"], 4),
            "tokens_per_s": round(step * tokens_per_step / seconds)}


# ---------------------------------------------------------------- evaluation


def make_windows(stream: torch.Tensor, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    """Consecutive windows of seq_len + 1 tokens overlapping by one, so every token after the
    first is predicted exactly once (the tail shorter than a window is dropped)."""
    count = (len(stream) - 1) // seq_len
    if max_tokens is not None:
        count = min(count, max(1, max_tokens // seq_len))
    if count < 1:
        raise RuntimeError(f"an evaluation split has only {len(stream)} tokens, fewer than "
                           f"--seq-len + 1 = {seq_len + 1}; lower --seq-len")
    index = torch.arange(count)[:, None] * seq_len + torch.arange(seq_len + 1)
    return stream[index.to(stream.device)]


@torch.no_grad()
def evaluate_objective(model, windows: torch.Tensor, args, device, teacher=None) -> float:
    """The training objective averaged over `windows` (model selection on valid)."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(args.batch_size):
        with autocast(device):
            losses = batch_losses(model, chunk, teacher)
        total += objective(losses, args.distill_weight).item() * len(chunk)
        count += len(chunk)
    return total / count


@torch.no_grad()
def evaluate_pair(target, draft, windows: torch.Tensor, batch_size: int, device) -> dict:
    """Held-out token NLL and top-1 accuracy of both models and their greedy agreement."""
    sums = {"target_nll": 0.0, "draft_nll": 0.0, "target_correct": 0, "draft_correct": 0,
            "agree": 0}
    positions = 0
    for chunk in windows.split(batch_size):
        with autocast(device):
            losses = batch_losses(draft, chunk, teacher=target)
        labels = chunk[:, 1:].flatten()
        draft_top = losses["logits"].argmax(-1)
        target_top = losses["teacher_logits"].argmax(-1)
        n = labels.numel()
        sums["draft_nll"] += losses["nll"].item() * n
        sums["target_nll"] += F.cross_entropy(losses["teacher_logits"], labels).item() * n
        sums["target_correct"] += (target_top == labels).sum().item()
        sums["draft_correct"] += (draft_top == labels).sum().item()
        sums["agree"] += (draft_top == target_top).sum().item()
        positions += n
    return {"positions": positions,
            "target_nll": sums["target_nll"] / positions,
            "draft_nll": sums["draft_nll"] / positions,
            "target_accuracy": sums["target_correct"] / positions,
            "draft_accuracy": sums["draft_correct"] / positions,
            "greedy_agreement": sums["agree"] / positions}


def spec_prompts(stream: torch.Tensor, count: int, length: int, eos_id: int) -> torch.Tensor:
    """`count` prompts of `length` tokens spread evenly over the held-out stream, none crossing
    a file boundary (no EOS inside), so they need no padding."""
    candidates = torch.linspace(0, len(stream) - length - 1, steps=8 * count).long().tolist()
    clean = [s for s in candidates if not (stream[s:s + length] == eos_id).any()]
    if not clean:
        raise RuntimeError("no held-out prompt without a file boundary; lower --seq-len")
    picks = [clean[i * len(clean) // count] for i in range(min(count, len(clean)))]
    return torch.stack([stream[s:s + length] for s in picks])


def accepted_runs(match: list[bool], length: int, drafts: int) -> list[int]:
    """Accepted drafts per verification when a greedy draft proposes up to `drafts` tokens and
    the greedy target keeps the leading run that matches its own token, then adds one.

    match[i]: the draft's argmax given the target's first i tokens equals the target's token
    i. Since accepted drafts are the target's tokens, this teacher-forced flag decides
    acceptance exactly. Drafts never run past `length` (one slot stays for the target)."""
    runs, i = [], 0
    while i < length:
        limit = min(drafts, length - i - 1)
        accepted = 0
        while accepted < limit and match[i + accepted]:
            accepted += 1
        runs.append(accepted)
        i += accepted + 1
    return runs


@torch.no_grad()
def simulate_speculation(target, draft, prompts: torch.Tensor, new_tokens: int, eos_id: int,
                         device) -> dict:
    """Greedy speculative decoding with SPEC_DRAFT_TOKENS drafts, simulated exactly from the
    target's greedy continuations of `prompts` (stopping at EOS) and one draft pass over them."""
    from transformers import GenerationConfig

    prompts = prompts.to(device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False,
                              eos_token_id=eos_id, pad_token_id=eos_id)
    with autocast(device):
        sequences = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                    generation_config=config)
        draft_top = draft(input_ids=sequences).logits.argmax(-1)
    start = prompts.shape[1]
    continuation = sequences[:, start:]
    match = (draft_top[:, start - 1:-1] == continuation).tolist()
    runs: list[int] = []
    generated = 0
    for row, tokens in enumerate(continuation.tolist()):
        length = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
        runs.extend(accepted_runs(match[row], length, SPEC_DRAFT_TOKENS))
        generated += length
    return {"prompts": len(prompts), "prompt_tokens": start, "max_new_tokens": new_tokens,
            "draft_tokens": SPEC_DRAFT_TOKENS, "generated_tokens": generated,
            "verifications": len(runs),
            "mean_accepted": sum(runs) / len(runs),
            "tokens_per_verification": generated / len(runs)}


# ---------------------------------------------------------------- saving and reporting


def save_model(model, tokenizer, folder: Path, draft_tokens: int | None) -> None:
    """bf16 safetensors + config + generation config + tokenizer, loadable offline. The
    draft's generation config also names its number of assistant tokens."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    generation = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if draft_tokens is not None:
        generation.num_assistant_tokens = draft_tokens
        generation.num_assistant_tokens_schedule = "constant"
    model.generation_config = generation
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # The same tokenizer without pretty-printing: 40% of the bytes, twice in the package.
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"), pretty=False)


def load_saved(folder: Path, device):
    """The saved model as float32 (its values are the bf16 ones) in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def command_line(argv: list[str]) -> str:
    """The command as run from the repository root, $OUT written as such when used."""
    out_env = os.environ.get("OUT")
    shown = []
    for arg in argv:
        if out_env and arg.startswith(out_env.rstrip("/") + "/"):
            arg = "$OUT" + arg[len(out_env.rstrip("/")):]
            shown.append(f'"{arg}"')
        else:
            shown.append(shlex.quote(arg))
    return " ".join(["python", "scripts/train_tiny_pair.py", *shown])


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def perplexity(nll: float) -> float:
    return math.exp(nll)


def model_entry(shape: Shape, params: int, folder: Path, training: dict) -> dict:
    return {**asdict(shape), "head_dim": shape.hidden // shape.heads, "parameters": params,
            "folder_bytes": folder_bytes(folder), "training": training}


def write_card(out: Path, summary: dict) -> None:
    """MODEL_CARD.md from the measured summary (every number comes from this run)."""
    d, h, s = summary["data"], summary["heldout"], summary["speculation"]
    tok, models = summary["tokenizer"], summary["models"]
    rows = [f"| {name} | {m['layers']} | {m['hidden']} | {m['heads']} / {m['kv_heads']} | "
            f"{m['ffn']} | {m['parameters']:,} | {m['folder_bytes'] / 1e6:.2f} MB | "
            f"{m['training']['steps']} ({m['training']['epochs']} epochs, "
            f"{m['training']['seconds']} s) |" for name, m in models.items()]
    cut = ("" if d["chars"]["train"] == d["train_chars_before_cut"] else
           f", cut by --max-train-chars from {d['train_chars_before_cut']:,}")
    excluded = ", ".join(f"`{x}`" for x in d["excluded_dirs"])
    w = summary["distill_weight"]
    lines = [
        f"# flashspec tiny pair: {summary['arch']} target + draft for Python code",
        "",
        "A target and a draft causal LM trained from scratch by `scripts/train_tiny_pair.py` on "
        "the Python standard library's source, so that flashspec's demos, tests and "
        "speculative-decoding measurements have a real, matched pair without any download. "
        "They are tiny and only know Python-like text; they are not useful language models.",
        "",
        "Load (offline is fine): `AutoModelForCausalLM.from_pretrained(\"<this folder>/target\")` "
        "and `AutoTokenizer.from_pretrained(\"<this folder>/target\")`, the same for `draft` "
        "(both folders hold the same tokenizer). Weights are bfloat16 safetensors with tied "
        "embeddings. The draft's generation config sets `num_assistant_tokens` = "
        f"{SPEC_DRAFT_TOKENS}.",
        "",
        "## Data",
        "",
        f"* CPython {d['python_version']} standard library (`{d['stdlib_root']}`): every `*.py` "
        f"file, sorted by relative path, skipping folders named {excluded}.",
        f"* Split by the SHA-256 of each relative path ({d['split_rule']}): "
        f"{d['files']['train']} train files ({d['chars']['train']:,} characters{cut}), "
        f"{d['files']['valid']} validation files ({d['chars']['valid']:,} characters; picks "
        f"the best checkpoint), {d['files']['heldout']} held-out files "
        f"({d['chars']['heldout']:,} characters; listed in `summary.json`).",
        f"* Files are joined with `{EOS}` between them: {d['tokens']['train']:,} train, "
        f"{d['tokens']['valid']:,} validation and {d['tokens']['heldout']:,} held-out tokens.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE trained with `tokenizers` on the train files: {tok['vocab_size']:,} "
        f"tokens (asked for {tok['requested_vocab_size']:,}), lossless on any text. "
        f"`{EOS}` (id {tok['eos_token_id']}) is EOS, BOS and pad in the tokenizer, both "
        "configs and both generation configs; encoding adds nothing; padding side left.",
        "",
        "## Models",
        "",
        "| model | layers | hidden | heads / kv heads | ffn | parameters | bf16 folder | steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Total on disk: {summary['total_bytes'] / 1e6:.2f} MB. Trained on windows of "
        f"{summary['seq_len']} tokens; max_position_embeddings {MAX_POSITIONS}.",
        "",
        "## Training",
        "",
        "```bash",
        summary["command"],
        "```",
        "",
        f"Seed {summary['seed']}; batches of {summary['batch_size']} x {summary['seq_len']} "
        f"tokens at random offsets of the train stream; AdamW (betas 0.9 / 0.95, weight decay "
        f"{WEIGHT_DECAY:g} on matrices, fused on CUDA), peak learning rate {summary['lr']:g}, "
        f"{WARMUP_FRACTION:.0%} linear warmup then cosine down to {MIN_LR_RATIO:g}x, gradient "
        f"clipping at {GRAD_CLIP:g}, bf16 autocast on CUDA. The target learns the next token "
        f"(cross-entropy). The draft learns from the saved target: {w:g} x KL(target || draft) "
        f"+ {1 - w:g} x cross-entropy, on the same text. Each keeps the checkpoint with the "
        "best validation loss.",
        "",
        f"Device: {summary['device']}. Date: {summary['date']}. Total wall time "
        f"{summary['wall_seconds']:.0f} s. Python {summary['versions']['python']}, torch "
        f"{summary['versions']['torch']}, transformers {summary['versions']['transformers']}, "
        f"tokenizers {summary['versions']['tokenizers']}.",
        "",
        "## Held-out results",
        "",
        f"Measured on the saved bf16 weights over {h['positions']:,} held-out token positions "
        f"(windows of {summary['seq_len']} tokens):",
        "",
        "| | perplexity | top-1 accuracy |",
        "| --- | --- | --- |",
        f"| target | {h['target_ppl']:.2f} | {h['target_accuracy']:.1%} |",
        f"| draft | {h['draft_ppl']:.2f} | {h['draft_accuracy']:.1%} |",
        f"| uniform over the vocabulary | {h['uniform_ppl']:,} | |",
        "",
        f"* Greedy agreement (draft argmax == target argmax): {h['greedy_agreement']:.1%} of "
        "held-out positions.",
        f"* Simulated greedy speculative decoding with {s['draft_tokens']} draft tokens per "
        f"verification, on {s['prompts']} held-out prompts of {s['prompt_tokens']} tokens and "
        f"up to {s['max_new_tokens']} greedy target tokens each ({s['generated_tokens']:,} in "
        f"all): {s['mean_accepted']:.2f} drafts accepted per verification, "
        f"{s['tokens_per_verification']:.2f} tokens per verification.",
        "",
        "## License",
        "",
        "Trained on CPython's standard library source (Python Software Foundation License).",
    ]
    (out / "MODEL_CARD.md").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- command line


def _int_in(name: str, low: int, high: int | None = None):
    """An argparse type: an int in [low, high], else an error naming range and value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    parse.__name__ = name
    return parse


def _float_in(name: str, low: float, high: float | None, low_open: bool):
    """An argparse type: a finite float above (or at) low and at most high."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if low_open else value >= low)
        ok = ok and (high is None or value <= high)
        if not ok:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            allowed = f"a number {bound}" + ("" if high is None else f" and <= {high:g}")
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value
    parse.__name__ = name
    return parse


def _add_shape_options(parser: argparse.ArgumentParser, role: str, default: Shape) -> None:
    group = parser.add_argument_group(f"{role} model size")
    group.add_argument(f"--{role}-layers", type=_int_in(f"--{role}-layers", 1, 64),
                       default=default.layers, help=f"decoder layers (default {default.layers})")
    group.add_argument(f"--{role}-hidden", type=_int_in(f"--{role}-hidden", 8, 8192),
                       default=default.hidden, help=f"hidden size (default {default.hidden})")
    group.add_argument(f"--{role}-heads", type=_int_in(f"--{role}-heads", 1, 256),
                       default=default.heads,
                       help=f"attention heads; must divide the hidden size into an even head "
                            f"dim (default {default.heads})")
    group.add_argument(f"--{role}-kv-heads", type=_int_in(f"--{role}-kv-heads", 1, 256),
                       default=default.kv_heads,
                       help=f"key/value heads (grouped-query attention); must divide the heads "
                            f"(default {default.kv_heads})")
    group.add_argument(f"--{role}-ffn", type=_int_in(f"--{role}-ffn", 1, 65536),
                       default=default.ffn, help=f"MLP intermediate size (default {default.ffn})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/train_tiny_pair.py",
        description="Train flashspec's tiny target + draft causal LMs (same byte-level BPE "
                    "tokenizer) on the Python standard library's source; save HF folders "
                    "(bf16), MODEL_CARD.md and summary.json.",
        epilog="Run from the repository root. Each model trains until the first of --steps, "
               "--epochs and --minutes.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help="output folder; gets target/, draft/, MODEL_CARD.md, summary.json "
                             "(default flashspec/assets/tiny_pair in this repository)")
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="HF architecture of both models (default llama)")
    _add_shape_options(parser, "target", DEFAULT_TARGET)
    _add_shape_options(parser, "draft", DEFAULT_DRAFT)
    parser.add_argument("--vocab-size", type=_int_in("--vocab-size", 300, 65536), default=8192,
                        help="BPE vocabulary size asked of the tokenizer trainer, incl. 256 "
                             "bytes and EOS; less data can give fewer (default 8192)")
    parser.add_argument("--seq-len", type=_int_in("--seq-len", 8, MAX_POSITIONS), default=512,
                        help="training and evaluation window in tokens (default 512)")
    parser.add_argument("--batch-size", type=_int_in("--batch-size", 1), default=32,
                        help="windows per training step (default 32)")
    parser.add_argument("--steps", type=_int_in("--steps", 1), default=None,
                        help="optimizer steps per model (default: from --epochs)")
    parser.add_argument("--epochs", type=_float_in("--epochs", 0, None, True), default=20.0,
                        help="passes over the train tokens per model when --steps is not "
                             "given (default 20)")
    parser.add_argument("--minutes", type=_float_in("--minutes", 0, None, True), default=2.0,
                        help="wall-clock budget per model; training ends early (with the "
                             "schedule completed) when it runs out (default 2)")
    parser.add_argument("--lr", type=_float_in("--lr", 0, 1, True), default=2e-3,
                        help="peak learning rate (default 2e-3)")
    parser.add_argument("--distill-weight", type=_float_in("--distill-weight", 0, 1, False),
                        default=1.0,
                        help="draft loss = w * KL(target || draft) + (1 - w) * cross-entropy, "
                             "w in [0, 1] (default 1: pure distillation)")
    parser.add_argument("--seed", type=_int_in("--seed", 0, 2**31 - 1), default=0,
                        help="seed for weights and batch order (default 0)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: CUDA when available, else CPU (default auto)")
    parser.add_argument("--max-train-chars", type=_int_in("--max-train-chars", 1000), default=None,
                        help="keep only this many characters of the train files (quick CPU "
                             "runs; default all)")
    parser.add_argument("--max-eval-tokens", type=_int_in("--max-eval-tokens", 1), default=None,
                        help="cap on validation and held-out tokens evaluated (default all)")
    parser.add_argument("--spec-prompts", type=_int_in("--spec-prompts", 1), default=64,
                        help="held-out prompts in the simulated speculative decode (default 64)")
    parser.add_argument("--spec-new-tokens", type=_int_in("--spec-new-tokens", 2), default=128,
                        help="greedy target tokens generated per prompt there (default 128)")
    return parser


def check_shape(parser: argparse.ArgumentParser, role: str, shape: Shape) -> None:
    """Cross-option checks argparse cannot do per option; errors name both options."""
    if shape.hidden % shape.heads or (shape.hidden // shape.heads) % 2:
        parser.error(f"argument --{role}-heads: {shape.heads} heads must split --{role}-hidden "
                     f"{shape.hidden} into an even head dimension (e.g. 64 per head)")
    if shape.heads % shape.kv_heads:
        parser.error(f"argument --{role}-kv-heads: {shape.kv_heads} must divide --{role}-heads "
                     f"{shape.heads}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed, cross-checked options with `target` / `draft` Shapes and the torch device."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for role in ("target", "draft"):
        shape = Shape(*(getattr(args, f"{role}_{k}") for k in ("layers", "hidden", "heads",
                                                                "kv_heads", "ffn")))
        check_shape(parser, role, shape)
        setattr(args, role, shape)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: 'cuda' was asked for but no CUDA device is available "
                     "(allowed: auto, cpu, cuda)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    """Runs everything; returns the summary written to summary.json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import tokenizers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    wall = time.perf_counter()
    device = torch.device(args.device)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(stdlib_root(), args.max_train_chars)
    print(f"data: {len(corpus.train)} train, {len(corpus.valid)} valid, {len(corpus.heldout)} "
          f"held-out files from {corpus.root} ({time.perf_counter() - wall:.1f} s)", flush=True)
    train_texts = [text for _, text in corpus.train]
    tokenizer = train_tokenizer(train_texts, args.vocab_size, MAX_POSITIONS)
    eos_id, vocab = tokenizer.eos_token_id, len(tokenizer)
    streams = {split: encode_stream(tokenizer, [text for _, text in files])
               for split, files in (("train", corpus.train), ("valid", corpus.valid),
                                    ("heldout", corpus.heldout))}
    print(f"tokenizer: {vocab} tokens; " + ", ".join(f"{k} {len(v):,} tokens"
                                                     for k, v in streams.items())
          + f" ({time.perf_counter() - wall:.1f} s)", flush=True)
    if len(streams["train"]) < args.seq_len + 2:
        raise RuntimeError(f"only {len(streams['train'])} train tokens for --seq-len "
                           f"{args.seq_len}; raise --max-train-chars or lower --seq-len")
    train = streams["train"].to(device)
    valid = make_windows(streams["valid"].to(device), args.seq_len, args.max_eval_tokens)
    heldout = make_windows(streams["heldout"].to(device), args.seq_len, args.max_eval_tokens)

    target = build_model(args.arch, args.target, vocab, eos_id, args.seed, device)
    target_params = count_params(target)
    target_training = train_model("target", target, train, valid, args, device)
    save_model(target, tokenizer, out / "target", draft_tokens=None)
    del target
    teacher = load_saved(out / "target", device)

    draft = build_model(args.arch, args.draft, vocab, eos_id, args.seed + 1, device)
    draft_params = count_params(draft)
    draft_training = train_model("draft", draft, train, valid, args, device, teacher=teacher)
    save_model(draft, tokenizer, out / "draft", draft_tokens=SPEC_DRAFT_TOKENS)
    del draft, teacher

    target, draft = load_saved(out / "target", device), load_saved(out / "draft", device)
    held = evaluate_pair(target, draft, heldout, args.batch_size, device)
    prompt_len = min(SPEC_PROMPT_TOKENS, args.seq_len // 2)
    prompts = spec_prompts(streams["heldout"], args.spec_prompts, prompt_len, eos_id)
    spec = simulate_speculation(target, draft, prompts, args.spec_new_tokens, eos_id, device)

    summary = {
        "arch": args.arch,
        "command": command_line(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "seed": args.seed, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "lr": args.lr, "distill_weight": args.distill_weight,
        "data": {
            "python_version": platform.python_version(), "stdlib_root": corpus.root,
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "split_rule": f"sha256(relative path)[:8] as int % 100: < {HELDOUT_PERCENT} held-out, "
                          f"< {HELDOUT_PERCENT + VALID_PERCENT} valid, else train",
            "files": {k: len(getattr(corpus, k)) for k in ("train", "valid", "heldout")},
            "chars": {k: sum(len(t) for _, t in getattr(corpus, k))
                      for k in ("train", "valid", "heldout")},
            "train_chars_before_cut": corpus.train_chars_total,
            "tokens": {k: len(v) for k, v in streams.items()},
            "heldout_files": [rel for rel, _ in corpus.heldout],
        },
        "tokenizer": {"vocab_size": vocab, "requested_vocab_size": args.vocab_size,
                      "eos_token": EOS, "eos_token_id": eos_id},
        "models": {
            "target": model_entry(args.target, target_params, out / "target", target_training),
            "draft": model_entry(args.draft, draft_params, out / "draft", draft_training),
        },
        "heldout": {**held, "target_ppl": perplexity(held["target_nll"]),
                    "draft_ppl": perplexity(held["draft_nll"]), "uniform_ppl": vocab},
        "speculation": spec,
    }
    summary["total_bytes"] = (summary["models"]["target"]["folder_bytes"]
                              + summary["models"]["draft"]["folder_bytes"])
    summary["wall_seconds"] = round(time.perf_counter() - wall, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_card(out, summary)
    print(f"wrote {out / 'target'}, {out / 'draft'}, {out / 'MODEL_CARD.md'}, "
          f"{out / 'summary.json'} ({summary['total_bytes'] / 1e6:.2f} MB)")
    print(f"summary: held-out perplexity target {summary['heldout']['target_ppl']:.2f}, "
          f"draft {summary['heldout']['draft_ppl']:.2f}, uniform {vocab}; greedy agreement "
          f"{held['greedy_agreement']:.1%}; simulated speculation ({SPEC_DRAFT_TOKENS} drafts) "
          f"{spec['mean_accepted']:.2f} accepted, {spec['tokens_per_verification']:.2f} tokens "
          f"per verification; {summary['wall_seconds']:.0f} s in all", flush=True)
    return summary


if __name__ == "__main__":
    main()
