"""The race bound (`TileConfig.race`, `race._race_beaten`): each sampled row's best score
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
import triton.language as tl

from flashspec import SamplingParams, kernels, rng
from flashspec.kernels import noise, ops, race
from flashspec.outputs import NON_FINITE

from test_kernels import DEVICE, ON_GPU, mixed_params, random_problem
from test_screen import EXACT, HOPPER, _assert_outputs_equal

RACED = {"triton": dataclasses.replace(EXACT, race=True),
         "triton_screen": dataclasses.replace(EXACT, race=True, screen=True)}
if not ON_GPU:  # tiles summarised in two parts, as the GPU's Triton table already does
    RACED["triton_parts"] = dataclasses.replace(EXACT, race=True, epilogue_parts=2)
if HOPPER:
    RACED["warp_specialized"] = kernels.default_config(256, warp_specialized=True)
    # 8 epilogue warps: not the default table's choice (slower there), but supported.
    RACED["warp_specialized_8"] = dataclasses.replace(
        kernels.default_config(512, warp_specialized=True), race=True)
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def sampled_params(g, batch, seed):
    """Every row sampled, untruncated (the rows the race serves), temperatures 0.05 to 1.5."""
    choices = torch.randint(5, (batch,), generator=g)
    temperature = [[1.0, 0.6, 0.05, 1.5, 0.7][int(i)] for i in choices]
    return SamplingParams.create(batch, do_sample=True, temperature=temperature, top_k=0,
                                 seed=seed, device=DEVICE)


def assert_the_race_runs(params, vocab_size, verify):
    """The race serves sampled rows without truncation: where every sampled row is
    truncated, stage 1 draws no noise and the raced config runs the exact kernel."""
    assert ops.kernel_variant(params, vocab_size, verify).tile_noise


@pytest.mark.parametrize("name", sorted(RACED))
@pytest.mark.parametrize("lse", [False, True])
def test_race_skips_tiles_and_keeps_every_winner(name, lse):
    config = RACED[name]
    g = torch.Generator().manual_seed(11)
    # A GPU runs many programs at once: the first ones see no bound yet.
    batch, vocab_size, dim = ((256 if config.warp_specialized else 64, 151_936, 64) if ON_GPU
                              else (5, 640, 32))
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim, dtype=DTYPE)
    params = sampled_params(g, batch, seed=5)
    raced, bounds = ops.stage1_best_scores(hidden, weight, params, positions, config, lse)
    exact, _ = ops.stage1_best_scores(hidden, weight, params, positions,
                                      dataclasses.replace(config, race=False, screen=False), lse)
    # (Row, tile) summaries are left out (the skip runs)...
    beaten = raced == float("-inf")
    assert beaten.float().mean() > 0.3, beaten.float().mean()
    # ... and chunks of rows (one decision each) take the leaders' path (`_race_leaders`):
    # rows with no candidate column (-inf) beside rows with one, which a chunk beaten whole
    # or summarised exactly cannot have.
    chunk = min(8 * config.num_warps if config.warp_specialized else config.block_r, batch)
    by_chunk = beaten.view(batch // chunk, chunk, -1)
    assert (by_chunk.any(dim=1) & ~by_chunk.all(dim=1)).any()
    # ... only where the row's best lies elsewhere. A tile summarised in parts (the GPU's
    # Triton table) may have one part beaten: its best is then the other part's, lower; on
    # the leaders' path a lone candidate may score below the tile's best (both below the
    # bound).
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
    greedy + truncated + sampled rows (chunks with a greedy row never skip). Sampling always
    computes the log-sum-exp, so the race takes its form of the test (the other form:
    `test_race_skips_tiles_and_keeps_every_winner`)."""
    config = RACED[name]
    g = torch.Generator().manual_seed(4)
    batch, vocab_size, dim = (200, 20_000, 64) if config.warp_specialized else (9, 700, 48)
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim, dtype=DTYPE)
    params = (sampled_params(g, batch, seed=2) if rows == "sampled"
              else mixed_params(g, batch, seed=2))
    assert_the_race_runs(params, vocab_size, verify=False)
    ours = kernels.fused_sample(hidden, weight, params, positions, config=config)
    theirs = kernels.fused_sample(hidden, weight, params, positions,
                                  config=dataclasses.replace(config, race=False))
    _assert_outputs_equal(ours, theirs)


@pytest.mark.parametrize("name", sorted(RACED))
@pytest.mark.parametrize("rows", ["sampled", "mixed"])
def test_raced_verification_equals_exact_bit_for_bit(name, rows):
    """Random drafts, then the target's own tokens: the tile that holds a row's draft is
    never skipped (its logit is needed); sampled rows, and greedy + truncated + sampled."""
    config = RACED[name]
    g = torch.Generator().manual_seed(28)
    batch, num_drafts = (64, 3) if config.warp_specialized else (5, 3)
    vocab_size, dim = (20_000, 64) if config.warp_specialized else (300, 32)
    flat, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim, dtype=DTYPE)
    hidden = flat.view(batch, num_drafts + 1, dim)
    positions = torch.randint(0, 1000, (batch,), generator=g).to(DEVICE)
    params = (sampled_params(g, batch, seed=8) if rows == "sampled"
              else mixed_params(g, batch, seed=8))
    assert_the_race_runs(params, vocab_size, verify=True)
    drafts = torch.randint(0, vocab_size, (batch, num_drafts), generator=g).to(DEVICE)
    for position in range(num_drafts + 1):
        ours = kernels.fused_verify(hidden, weight, drafts, params, positions, config=config)
        theirs = kernels.fused_verify(hidden, weight, drafts, params, positions,
                                      config=dataclasses.replace(config, race=False))
        _assert_outputs_equal(ours, theirs)
        if position < num_drafts:
            emitted = theirs.tokens[:, position]
            drafts[:, position] = torch.where(emitted >= 0, emitted, drafts[:, position])
    assert ((ours.num_accepted == num_drafts) | (ours.status != 0)).all()


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
    out = kernels.fused_sample(hidden, weight, params, positions, config=config)
    assert (out.status == NON_FINITE).all() and (out.tokens == -1).all()


@triton.jit
def _race_probe_kernel(s_ptr, bits_ptr, bound_ptr, beaten_ptr, score_ptr, N: tl.constexpr,
                       LSE: tl.constexpr):
    """One row per program: whether `_race_beaten` beats it, and its columns' exact scores
    as `_exact_best` computes them."""
    row = tl.program_id(0)
    columns = row * N + tl.arange(0, N)
    s = tl.load(s_ptr + columns)[None, :]
    bits = tl.load(bits_ptr + columns).to(tl.uint32)[None, :]
    bound = tl.load(bound_ptr + row + tl.arange(0, 1))
    sampled = bound == bound
    beaten, _, _ = race._race_beaten(s, tl.sum(s, axis=1), bits, bound, sampled, sampled, LSE)
    tl.store(beaten_ptr + row + tl.arange(0, 1), beaten.to(tl.int32) + tl.zeros([1], tl.int32))
    tl.store(score_ptr + columns[None, :], s + noise.gumbel_from_bits(bits))


def threshold_rows(bounds):
    """Rows of 16 columns: one probe column whose exact score sits at the bound, a hair above
    or below it (float32 s = bound - g + a few ulps either way), or, for words near 1 (where
    -log(u) >= 1 - u is tight), 2**-9 (1 + |bound|) below it; the other columns far below.
    Returns s, bits and bound per row, and which rows were built 2**-9 below."""
    words = torch.tensor([2**32 - 1, 2**32 - 6, 2**32 - 1001, 2**32 - 60001, 2**31 + 12345, 1000])
    # Words within 2**-16 of 1, but not the last thousand, where dropping the 1/2 of
    # ~bits + 1/2 (`_race_beaten`) costs more than 2**-9 and leaves them unbeaten (rightly:
    # that only makes the test more cautious).
    near_one = (words > 2**32 - 2**16) & (words < 2**32 - 1000)
    g = -torch.log(rng.exponential_from_bits(words, torch.float64))
    filler_bits = torch.randint(0, 2**32, (15,), generator=torch.Generator().manual_seed(0))
    rows_s, rows_bits, rows_bound, below = [], [], [], []
    for bound in bounds:
        for word, g_w, tight in zip(words, g, near_one):
            edge = torch.tensor(bound - float(g_w), dtype=torch.float32)
            probes = [edge]
            up = down = edge
            for _ in range(3):  # a few ulps either way
                up = torch.nextafter(up, torch.tensor(float("inf")))
                down = torch.nextafter(down, torch.tensor(float("-inf")))
                probes += [up, down]
            flags = [False] * len(probes)
            if tight and abs(bound) < 1e30:
                probes.append(torch.tensor(bound - float(g_w) - 2.0**-9 * (1 + abs(bound)),
                                           dtype=torch.float32))
                flags.append(True)
            for probe, flag in zip(probes, flags):
                rows_s.append(torch.cat([probe.view(1), torch.full((15,), -1e30)]))
                rows_bits.append(torch.cat([word.view(1), filler_bits]))
                rows_bound.append(bound)
                below.append(flag)
    return (torch.stack(rows_s), torch.stack(rows_bits), torch.tensor(rows_bound),
            torch.tensor(below))


@pytest.mark.parametrize("lse", [False, True])
def test_race_beats_just_below_and_never_at_or_above_the_bound(lse):
    """The proof at its edge: a column whose exact score (as `_exact_best` computes it)
    reaches the bound is never beaten, at every magnitude up to 2.4e38 (where lower * log2(e)
    would overflow without the cap), and one 2**-9 (1 + |bound|) below it is (the margin,
    2**-12 (1 + |bound|), and rounding leave room for that)."""
    bounds = [0.5, -3.0, 17.25, 3.0e4, 1.0e30, 2.4e38]
    s, words, bound, below = threshold_rows(bounds)
    bits = words.to(torch.int64).to(torch.int32)  # two's complement
    beaten = torch.empty(len(s), dtype=torch.int32, device=DEVICE)
    score = torch.empty_like(s, device=DEVICE)
    _race_probe_kernel[(len(s),)](s.to(DEVICE), bits.to(DEVICE), bound.float().to(DEVICE),
                                  beaten, score, 16, lse)
    beaten, score = beaten.cpu().bool(), score.cpu()
    reaches = score[:, 0] >= bound.float()
    for b in bounds:  # every magnitude has probes that reach it
        assert reaches[bound == b].sum() >= 3, b
    assert not beaten[reaches].any(), bound[reaches & beaten]
    assert below.sum() >= 8 and beaten[below].all(), bound[below & ~beaten]
