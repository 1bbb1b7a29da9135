"""Command-line helpers shared by the scripts in ``scripts/`` (acceptance_rate.py,
tok_per_s.py): argparse types whose errors say what is allowed (``--random-init`` shapes
among them), run metadata, and progress on stderr."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import torch

from .random_init import random_config


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def positive_ints(text: str, example: str) -> list[int]:
    """Comma-separated positive ints, in the order given (`example` goes in the error)."""
    try:
        return [positive_int(n) for n in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints (e.g. {example}), got {text!r}") from None


def names(text: str, known) -> list[str]:
    """Comma-separated names of `known`, in `known`'s order (the table's), each once."""
    given = [n.strip() for n in text.split(",")]
    unknown = [n for n in given if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return [name for name in known if name in given]


def random_init_shapes(text: str) -> list[str]:
    """``TARGET_SHAPE[,DRAFT_SHAPE]`` -> [target shape] or [target shape, draft shape], each
    a shipped config's name or a config.json path that
    `flashspec.bench.random_init.random_config` accepts."""
    shapes = [shape.strip() for shape in text.split(",")]
    if not 1 <= len(shapes) <= 2 or not all(shapes):
        raise argparse.ArgumentTypeError(f"expected TARGET_SHAPE[,DRAFT_SHAPE], got {text!r}")
    for shape in shapes:
        try:
            random_config(shape)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return shapes


def model_name(name: str) -> str:
    """A model's name in the scripts' reports: a hub id or shipped config name as given; a
    local folder or file by its last two path parts (e.g. tiny_pair/target)."""
    path = Path(name)
    return "/".join(path.resolve().parts[-2:]) if path.exists() else name


def pyplot_or_note(path: Path):
    """matplotlib.pyplot on the file-only Agg backend, or None after a note that `path` is
    not written: matplotlib is optional (the scripts' JSON and table do not need it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        print(f"note: no plot ({error}); pip install matplotlib for {path.name}")
        return None
    return plt


def resolve_device(name: str) -> str:
    """"auto" -> cuda if available, else cpu; other names as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


class Progress:
    """A tqdm bar over `total` runs when tqdm is installed and stderr is a terminal, else a
    stderr line as each run starts (a log file then holds plain lines, without the bar's
    carriage returns); `write` prints a line either way (tqdm's own write keeps the bar
    intact)."""

    def __init__(self, total: int, unit: str = "run"):
        self.total, self.started, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, file=sys.stderr, unit=unit, dynamic_ncols=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def start(self, label: str) -> None:
        self.started += 1
        if self.bar is not None:
            self.bar.set_description(label)
        else:
            self.write(f"[{self.started}/{self.total}] {label} ...")

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
