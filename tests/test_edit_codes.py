"""The one-pass verification codes (`flashspec.kernels.edit_codes`) equal the torch ops of
`generation.edits.EditState` (the CPU path and reference), through the interpreter on CPU and
compiled on a GPU."""

import pytest
import torch

from flashspec.generation.edits import FORCED_ROW, NEVER, EditRules, EditState
from flashspec.kernels.edit_codes import BLOCK_V, verify_codes

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _state(batch, vocab, device, penalty, min_count, begin_count, seed, forced=()):
    g = torch.Generator().manual_seed(seed)
    banned = tuple(sorted(torch.randperm(vocab, generator=g)[:5].tolist()))
    rules = EditRules(penalty=penalty, banned=banned, begin_banned=(3, 4), begin_count=begin_count,
                      eos=(1,), min_count=min_count, forced=forced)
    state = EditState(batch, vocab, torch.device(device))
    state.load(rules, torch.randint(0, vocab, (batch, 6), generator=g).to(device))
    return state, g


def kernel_codes(state, generated, drafts, allowed=None, **tiles):
    """The codes kernel with `state`'s buffers, as `EditState.verify_edits` calls it on CUDA."""
    bans = None
    if state.position_bans:
        bans = (state.ban_rows, generated, state.min_count, state.begin_count,
                state.forced_count if state.forces else None)
    return verify_codes(state.base, drafts, state.context_code, bans=bans, forced_row=FORCED_ROW,
                        allowed=allowed, **tiles)


def torch_codes(state, generated, drafts, allowed=None):
    counts = generated[:, None] + torch.arange(drafts.shape[1] + 1, device=drafts.device)
    return state._context_codes(drafts, counts, allowed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("penalty, min_count, begin_count, forced",
                         [(1.0, 0, NEVER, ()), (1.3, 0, NEVER, ()), (1.3, 2, 1, ()),
                          (1.0, 3, NEVER, ()), (1.3, 2, 1, ((1, 9, False), (3, 4, True)))])
@pytest.mark.parametrize("num_drafts", [0, 1, 4])
def test_verify_codes_equal_torch_ops(device, penalty, min_count, begin_count, forced, num_drafts):
    batch, vocab = 3, 2 * BLOCK_V + 37    # a partial last tile
    state, g = _state(batch, vocab, device, penalty, min_count, begin_count, num_drafts, forced)
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=g).to(device)
    if num_drafts > 1:
        drafts[1, 1] = -1                  # row 1's drafts end there; the next one is ignored
        drafts[2, 0] = drafts[2, 1] = 5    # a draft repeated
        drafts[0, 0] = 2 * BLOCK_V + 36    # in the last tile
    generated = torch.tensor([0, 1, 2], device=device)
    expected = torch_codes(state, generated, drafts)
    codes = kernel_codes(state, generated, drafts)
    assert codes.dtype == torch.uint8 and codes.shape == (batch, num_drafts + 1, vocab)
    assert torch.equal(codes, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_drafts", [0, 3])
def test_allowed_bitmask_bans_the_rest(device, num_drafts):
    """With an allowed-token bitmask, every other token is BAN on top of the other codes;
    the mask's bit 31 (the int32 sign) and a partial last word included."""
    from flashspec.generation.allowed import pack, unpack
    from flashspec.params import BAN

    batch, vocab = 2, BLOCK_V + 45
    state, g = _state(batch, vocab, device, 1.2, 2, NEVER, seed=7)
    drafts = torch.randint(0, vocab, (batch, num_drafts), generator=g).to(device)
    generated = torch.tensor([0, 5], device=device)
    allowed = torch.rand(batch, num_drafts + 1, vocab, generator=g) < 0.3
    allowed[..., 31::32] = True
    allowed[0, 0] = False                                     # nothing allowed
    bitmask = pack(allowed).to(device)
    assert torch.equal(unpack(bitmask, vocab).cpu(), allowed)
    codes = kernel_codes(state, generated, drafts, bitmask)
    expected = torch_codes(state, generated, drafts)
    expected[~allowed.to(device)] = BAN
    assert torch.equal(codes, expected)
    assert torch.equal(torch_codes(state, generated, drafts, bitmask), expected)
