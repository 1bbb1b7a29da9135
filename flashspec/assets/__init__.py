"""Files shipped inside the package: the tiny target/draft pair trained by
scripts/train_tiny_pair.py (tiny_pair/target, tiny_pair/draft, MODEL_CARD.md, summary.json),
the prompt sets (prompts/, see flashspec.bench.prompt_sets) and real models' shapes (configs/,
see flashspec.bench.random_init)."""

from pathlib import Path


def tiny_pair_path() -> Path:
    """Folder of the shipped tiny pair (its `target` and `draft` subfolders are HF folders)."""
    return Path(__file__).resolve().parent / "tiny_pair"
