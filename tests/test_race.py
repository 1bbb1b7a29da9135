"""The race bound (`TileConfig.race`, `lm_head._race_beaten`): each sampled row's best score
found so far, shared by every program through global memory, lets a tile whose every column
provably falls below it skip the search for its best.

The kernels' outputs with the race must equal those without it bit for bit: the tokens
(the beaten tiles can never hold the winner), and the log-sum-exp and logprobs too, since a
beaten tile's log-sum-exp terms are computed as every other tile's. In Triton's interpreter
the programs run one after another, so every tile after a row's first sees a bound: the
tests check that tiles were beaten, so that they test the skip and not only the fallback.
On a GPU the same tests run the Triton kernel and the warp-specialized one (Hopper).
"""

import dataclasses

import pytest
import torch
import triton

from flashspec import SamplingParams, kernels
from flashspec.kernels import lm_head, lm_head_ws, ops

from test_kernels import DEVICE, ON_GPU, mixed_params, random_problem
from test_screen import EXACT, HOPPER, _assert_outputs_equal

RACED = {"triton": dataclasses.replace(EXACT, race=True),
         "triton_screen": dataclasses.replace(EXACT, race=True, screen=True)}
if HOPPER:
    RACED["warp_specialized"] = kernels.default_config(256, warp_specialized=True)
    # 8 epilogue warps: not the default table's choice (slower there), but supported.
    RACED["warp_specialized_8"] = dataclasses.replace(
        kernels.default_config(512, warp_specialized=True), race=True)
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def sampled_params(g, batch, seed):
    """Every row sampled, untruncated (the rows the race serves), temperatures 0.05 to 1.5."""
    temperature = [[1.0, 0.6, 0.05, 1.5, 0.7][int(i)] for i in torch.randint(5, (batch,), generator=g)]
    return SamplingParams.create(batch, do_sample=True, temperature=temperature, top_k=0,
                                 seed=seed, device=DEVICE)


def stage1_bests(hidden, weight, params, positions, config):
    """Stage 1's per-(row, tile) best scores under `config` (race or not), and the bounds
    it left."""
    num_rows = hidden.shape[0]
    num_vt = triton.cdiv(weight.shape[0], config.block_v)
    empty = lambda dtype: torch.empty(num_rows, num_vt, dtype=dtype, device=DEVICE)  # noqa
    best, best_id, bad = empty(torch.float32), empty(torch.int32), empty(torch.int32)
    summaries = (best, best_id, best, best, best, bad)
    bounds = torch.full((num_rows,), lm_head.NO_BOUND, dtype=torch.int32, device=DEVICE)
    row = dict(do_sample=params.do_sample, temperature=params.temperature, seed=params.seed,
               position=positions)
    launch = lm_head_ws.launch if config.warp_specialized else ops._launch_tiles
    launch(hidden, weight, row, summaries, best_id, best_id, best, bounds, num_vt, 1, config,
           True, False, 0, False, config.race)
    return best, bounds


@pytest.mark.parametrize("name", sorted(RACED))
def test_race_skips_tiles_and_keeps_every_winner(name):
    config = RACED[name]
    g = torch.Generator().manual_seed(11)
    # A GPU runs many programs at once: the first ones see no bound yet.
    batch, vocab_size, dim = ((256 if config.warp_specialized else 64, 151_936, 64) if ON_GPU
                              else (5, 640, 32))
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim, dtype=DTYPE)
    params = sampled_params(g, batch, seed=5)
    raced, bounds = stage1_bests(hidden, weight, params, positions, config)
    exact, _ = stage1_bests(hidden, weight, params, positions,
                            dataclasses.replace(config, race=False, screen=False))
    # Tiles are beaten (the skip runs)...
    assert (raced == float("-inf")).float().mean() > 0.3, (raced == float("-inf")).float().mean()
    # ... only where the row's best lies elsewhere. A tile summarised in parts (the GPU's
    # Triton table) may have one part beaten: its best is then the other part's, lower.
    row_best = exact.max(dim=1, keepdim=True).values
    lowered = raced != exact
    assert (raced <= exact).all()
    assert (exact[lowered] < row_best.expand_as(exact)[lowered]).all()
    torch.testing.assert_close(raced.max(dim=1, keepdim=True).values, row_best, rtol=0, atol=0)
    # The bound left is the row's best (every tile's best went through it).
    key = bounds.to(torch.int64)
    as_float = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(torch.int32).view(torch.float32)
    torch.testing.assert_close(as_float, row_best[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(RACED))
@pytest.mark.parametrize("rows", ["sampled", "mixed"])
def test_raced_sampling_equals_exact_bit_for_bit(name, rows):
    """Tokens, logprobs, log-sum-exp, status; sampled rows (the race skips most tiles) and
    greedy + truncated + sampled rows (chunks with a greedy row never skip)."""
    config = RACED[name]
    g = torch.Generator().manual_seed(3)
    batch, vocab_size, dim = (200, 20_000, 64) if config.warp_specialized else (9, 700, 48)
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim, dtype=DTYPE)
    params = (sampled_params(g, batch, seed=2) if rows == "sampled"
              else mixed_params(g, batch, seed=2))
    for want_lse in (False, True):
        ours = kernels.sample_unchecked(hidden, weight, params, positions, want_lse=want_lse,
                                        config=config)
        theirs = kernels.sample_unchecked(hidden, weight, params, positions, want_lse=want_lse,
                                          config=dataclasses.replace(config, race=False))
        _assert_outputs_equal(ours, theirs)


@pytest.mark.parametrize("name", sorted(RACED))
def test_raced_verification_equals_exact_bit_for_bit(name):
    """Random drafts, then the target's own tokens: the tile that holds a row's draft is
    never skipped (its logit is needed)."""
    config = RACED[name]
    g = torch.Generator().manual_seed(4)
    batch, num_drafts = (64, 3) if config.warp_specialized else (5, 3)
    vocab_size, dim = (20_000, 64) if config.warp_specialized else (600, 32)
    flat, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim, dtype=DTYPE)
    hidden = flat.view(batch, num_drafts + 1, dim)
    positions = torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)
    params = sampled_params(g, batch, seed=8)
    drafts = torch.randint(0, vocab_size, (batch, num_drafts), generator=g).to(DEVICE)
    for position in range(num_drafts + 1):
        ours = kernels.verify_unchecked(hidden, weight, drafts, params, positions, config=config)
        theirs = kernels.verify_unchecked(hidden, weight, drafts, params, positions,
                                          config=dataclasses.replace(config, race=False))
        _assert_outputs_equal(ours, theirs)
        if position < num_drafts:
            drafts[:, position] = theirs.tokens[:, position]
    assert (ours.num_accepted == num_drafts).all()


@pytest.mark.parametrize("name", sorted(RACED))
def test_non_finite_rows_are_reported_under_the_race(name):
    """A row with a NaN logit in a tile that its bound would beat is still reported."""
    config = RACED[name]
    g = torch.Generator().manual_seed(6)
    batch, vocab_size, dim = (130, 20_000, 64) if config.warp_specialized else (3, 640, 32)
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim, dtype=DTYPE)
    weight[vocab_size - 5, 0] = float("nan")  # the last tile: every row has a bound by then
    weight[vocab_size - 9, 1] = float("inf")
    params = sampled_params(g, batch, seed=1)
    out = kernels.sample_unchecked(hidden, weight, params, positions, config=config)
    assert (out.status == ops.lm_head.STATUS_NON_FINITE).all() and (out.tokens == -1).all()
