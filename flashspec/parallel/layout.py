"""Which rows of the LM head each rank holds: `VocabShards`, contiguous shards of the
vocabulary in rank order, of any sizes.

A layout is built once per process group and reused by every call: from the sizes each
rank holds (`VocabShards.gather`, one small all-gather) or from transformers' own split
(`VocabShards.chunked`, no communication). Every rank then knows every shard's offset, so
a token id is global everywhere: the noise is keyed by it and the tokens returned are it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class VocabShards:
    """The vocabulary split into contiguous shards, shard r on rank r of `group`.

    Attributes:
        sizes: rows of the LM head on each rank, in rank order (each at least 1).
        rank: this process's rank in `group`.
        group: the `torch.distributed` process group (None: the default group).

    Rank r holds global token ids ``[offsets[r], offsets[r] + sizes[r])``.

    Example:
        >>> shards = VocabShards(sizes=(334, 334, 332), rank=1)
        >>> shards.vocab_size, shards.offset, shards.size
        (1000, 334, 334)
    """

    sizes: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        sizes = tuple(int(size) for size in self.sizes)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"every rank must hold at least one vocabulary row, got shard sizes "
                             f"{list(sizes)} (a vocabulary smaller than the rank count leaves "
                             "a rank empty)")
        if not 0 <= self.rank < len(sizes):
            raise ValueError(f"`rank`={self.rank} is not a rank of {len(sizes)} shards")
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def gather(cls, size: int, group: dist.ProcessGroup | None = None) -> VocabShards:
        """The layout of shards whose sizes each rank knows only for itself: one all-gather
        of `size` (this rank's LM-head rows) over `group`. A collective: every rank calls it."""
        world_size = dist.get_world_size(group)
        # NCCL moves CUDA tensors only.
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        mine = torch.tensor([size], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(sizes, mine, group=group)
        return cls(tuple(int(s) for s in sizes), dist.get_rank(group), group)

    @classmethod
    def chunked(cls, vocab_size: int, group: dist.ProcessGroup | None = None,
                world_size: int | None = None, rank: int | None = None) -> VocabShards:
        """transformers' split of a colwise `lm_head` (`torch.distributed.tensor.Shard(0)`,
        `torch.chunk`'s rule): ``ceil(V / n)`` rows per rank, the last rank the rest. No
        communication; `world_size` and `rank` default to `group`'s."""
        world_size = dist.get_world_size(group) if world_size is None else world_size
        rank = dist.get_rank(group) if rank is None else rank
        chunk = -(-vocab_size // world_size)
        sizes = tuple(max(0, min(chunk, vocab_size - r * chunk)) for r in range(world_size))
        return cls(sizes, rank, group)

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def vocab_size(self) -> int:
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First global token id of each rank's shard."""
        starts = [0]
        for size in self.sizes[:-1]:
            starts.append(starts[-1] + size)
        return tuple(starts)

    @property
    def offset(self) -> int:
        """First global token id of this rank's shard."""
        return self.offsets[self.rank]

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    def local_edits(self, edits):
        """This rank's columns of a `LogitEdits` over the whole vocabulary (its per-token
        fields: codes, bias, counts), or None: views, no copy per step (the shard's torch
        ops read them as they are)."""
        if edits is None:
            return None
        return edits._replace(**{name: getattr(edits, name).narrow(-1, self.offset, self.size)
                                 for name in ("codes", "bias", "counts")
                                 if getattr(edits, name) is not None})

    def local(self, full: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's slice of `full` along `dim` (a full LM-head weight ``[V, D]``, a bias
        ``[V]``, edit codes ``[..., V]`` with ``dim=-1``), contiguous."""
        if full.shape[dim] != self.vocab_size:
            raise ValueError(f"dimension {dim} of a tensor of shape {tuple(full.shape)} is not "
                             f"the vocabulary of {self.vocab_size}")
        return full.narrow(dim, self.offset, self.size).contiguous()
