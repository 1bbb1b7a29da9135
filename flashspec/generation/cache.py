"""One model's decoder with its own KV cache, kept column-aligned with the running batch.

The running batch (`flashspec.generation.loop.Batch`) is right-aligned: every row's tokens
end in the last column, padding is on the left only. A `CachedDecoder`'s cache holds the
keys and values of the batch's first `cached` columns, so the next forward feeds
``tokens[:, cached:]`` (plus any drafts) with the full 2D attention mask.

After a speculative step rows advance by different numbers of tokens; `realign` moves each
row's cache entries right by the same amount as its tokens (and drops rows and all-padding
columns), so the layout never has holes. That keeps sliding-window attention, which
transformers masks by cache column, equal to the window over the row's real tokens.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class CachedDecoder:
    """A decoder (the model without its LM head), its cache, and how many batch columns
    the cache holds."""

    def __init__(self, decoder: torch.nn.Module, role: str):
        self.decoder = decoder
        self.role = role
        # Plain full-attention layers for every model: transformers' sliding-window layers
        # drop old entries, which a column shift could not restore. The window is still
        # applied, by the attention mask.
        self.cache = DynamicCache()
        self.cached = 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, n, D]`` of `input_ids` ``[B, n]``, which follow the
        cached columns; `attention_mask` covers cached and new columns."""
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, past_key_values=self.cache, use_cache=True)
        self.cached += input_ids.shape[1]
        self._check_cache()
        return out.last_hidden_state

    def realign(self, rows: torch.Tensor, source_columns: torch.Tensor, keep: int) -> None:
        """Keep batch rows `rows` and make column j of kept row i hold what column
        ``source_columns[i, j]`` held, for j < `keep` (`source_columns` is ``[rows, >= keep]``,
        entries for padding columns may point anywhere)."""
        index = source_columns[:, :keep]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                states = getattr(layer, name).index_select(0, rows)
                heads, dim = states.shape[1], states.shape[3]
                gather = index[:, None, :, None].expand(-1, heads, -1, dim)
                setattr(layer, name, states.gather(2, gather))
        self.cached = keep

    def reset(self) -> None:
        """Forget everything: the next forward feeds the batch from its first column."""
        self.cache = DynamicCache()
        self.cached = 0

    def crop(self, keep: int) -> None:
        """Keep the first `keep` cached columns of every row."""
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, :keep]
            layer.values = layer.values[:, :, :keep]
        self.cached = keep

    def _check_cache(self) -> None:
        """The decoder stored exactly its keys and values in our cache (a model with
        recurrent state, e.g. Mamba, keeps it elsewhere and would silently lose it)."""
        layers = self.cache.layers
        unsupported = next((layer for layer in layers if type(layer) is not DynamicLayer), None)
        if not layers or unsupported is not None or self.cache.get_seq_length() != self.cached:
            kind = type(unsupported).__name__ if unsupported is not None else "no attention KV cache"
            raise ValueError(
                f"`{self.role}` ({type(self.decoder).__name__}) keeps {kind}; sampler='flash' "
                "supports decoders whose state is an attention KV cache (DynamicLayer); run "
                "generate() without sampler='flash'"
            )
