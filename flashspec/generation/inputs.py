"""A call's inputs to the target's decoder beyond token ids, positions and the mask: the
prompt's `inputs_embeds` (the prefill's) and `token_type_ids` (every forward's).

The engine's runners call a decoder with ``input_ids``, ``attention_mask``,
``position_ids`` and its KV cache (`compiled.DecoderRunner`). These inputs reach the
decoder's forward through a forward pre-hook held only while the engine runs it
(`decoder_inputs`), in the decoder's own (eager) forward, around the layers a step may run
compiled:

* `embeddings_instead`: the prefill's forward takes the prompt's embeddings (those of the
  columns it feeds) instead of its ids, as stock's first forward takes `inputs_embeds`;
* `TokenTypes`: each forward's ``token_type_ids`` from its ``position_ids``: a prompt
  token's own type, and after the prompt the type of the prompt's last column, which stock
  repeats for every new token. Calls with token types run their steps without CUDA graphs
  (`Slot.eager`): a captured step would not record the hook of a call that has it and
  replay one that has not.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from .kv_cache import WindowCache


def takes(decoder: torch.nn.Module, name: str) -> bool:
    """Whether `decoder`'s forward takes the keyword argument `name`."""
    return name in inspect.signature(type(decoder).forward).parameters


@contextlib.contextmanager
def decoder_inputs(decoder: torch.nn.Module, supply):
    """Inside, every forward of `decoder` takes its keyword arguments as `supply(kwargs)`
    returns them (nothing changes when `supply` is None)."""
    if supply is None:
        yield
        return
    handle = decoder.register_forward_pre_hook(
        lambda module, args, kwargs: (args, supply(dict(kwargs))), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def embeddings_instead(embeds: torch.Tensor):
    """`supply` for a forward of `embeds` ``[rows, n, D]`` instead of its input ids."""
    def supply(kwargs: dict) -> dict:
        kwargs["input_ids"] = None
        kwargs["inputs_embeds"] = embeds
        return kwargs
    return supply


class TokenTypes:
    """`supply` of ``token_type_ids`` for the call's rows, whose prompts' types are
    `token_type_ids` ``[rows, L]`` under `attention_mask` ``[rows, L]`` (live prompt tokens
    lie at positions 0, 1, 2, ... in column order). Rows past the call's (padding a batch
    bucket) take the first row's types."""

    def __init__(self, token_type_ids: torch.Tensor, attention_mask: torch.Tensor):
        live = attention_mask.bool()
        order = torch.sort((~live).to(torch.int8), dim=1, stable=True).indices
        self.by_position = token_type_ids.long().gather(1, order)
        self.last = token_type_ids[:, -1].long()
        self.prompt_length = live.sum(dim=1)
        self._padded: dict = {}

    def _rows(self, rows: int, device: torch.device):
        key = (rows, device)
        if key not in self._padded:
            own = self.by_position.shape[0]
            pick = torch.cat([torch.arange(min(rows, own)),
                              torch.zeros(max(rows - own, 0), dtype=torch.long)])
            self._padded[key] = tuple(t.to(device)[pick.to(device)] for t in
                                      (self.by_position, self.last, self.prompt_length))
        return self._padded[key]

    def __call__(self, kwargs: dict) -> dict:
        # By the tokens' cache positions (the model's position ids differ for a right-padded
        # row's new tokens: `WindowCache.model_positions`).
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        positions = (cache.positions_fed if isinstance(cache, WindowCache)
                     else kwargs["position_ids"])
        by_position, last, length = self._rows(positions.shape[0], positions.device)
        prompt = by_position.gather(1, positions.clamp(0, by_position.shape[1] - 1))
        kwargs["token_type_ids"] = torch.where(positions < length[:, None], prompt, last[:, None])
        return kwargs
