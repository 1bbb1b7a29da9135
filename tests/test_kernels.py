"""Fused Triton kernels (`flashspec.sampling`'s fused backend) against the torch reference.

On a CPU machine the kernels run through Triton's interpreter on small shapes; on a CUDA
machine the same tests run compiled, and the `gpu` tests add D=4096, V=151,936.
"""

import functools

import pytest
import torch
import triton

from flashspec import NonFiniteLogitsError, SamplingParams, kernels, reference, rng, sampling
from flashspec.outputs import NON_FINITE
from flashspec.bench.statistics import is_near_tie

import test_reference as semantics
from test_reference import reference_argmax, reference_sample, reference_tokens

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# Small tiles on the interpreter so that small shapes still span several vocab tiles.
SMALL = None if ON_GPU else kernels.TileConfig(block_v=32, block_r=16, block_d=16,
                                               candidates=4, max_support=32)
OTHER = kernels.TileConfig(block_v=64, block_r=32, block_d=32, candidates=8, max_support=64,
                           epilogue_parts=2)
# The checked fused calls (completion, stats, errors); `kernels.fused_*` are unchecked.
fused_argmax = functools.partial(sampling.argmax, backend="fused")
fused_sample = functools.partial(sampling.sample, backend="fused")
fused_verify = functools.partial(sampling.verify, backend="fused")


def fused_tokens(hidden, weight, params, positions, **kwargs):
    return fused_sample(hidden, weight, params, positions, **kwargs).tokens


def mixed_params(g: torch.Generator, batch: int, seed: int = 0) -> SamplingParams:
    """Greedy and sampled rows with every truncation mode, varied temperatures."""
    pick = lambda options: [options[int(i)] for i in torch.randint(len(options), (batch,), generator=g)]  # noqa
    return SamplingParams.create(
        batch, do_sample=pick([True, True, True, False]),
        temperature=pick([1.0, 0.6, 0.7, 1.5, 0.0, 0.05]),
        top_k=pick([0, 0, 1, 5, 20, 50]), top_p=pick([1.0, 1.0, 0.9, 0.95, 0.5]),
        min_p=pick([0.0, 0.0, 0.05, 0.2]), seed=seed, device=DEVICE)


def random_problem(g, batch, vocab_size, dim, dtype=torch.float32, scale=3.0):
    weight = (torch.randn(vocab_size, dim, generator=g) / dim**0.5).to(DEVICE, dtype)
    hidden = (torch.randn(batch, dim, generator=g) * scale).to(DEVICE, dtype)
    positions = torch.randint(0, 10_000, (batch,), generator=g).to(DEVICE)
    return hidden, weight, positions


def assert_same_tokens(ours, theirs, hidden, weight, params, positions, what=""):
    """Token for token equal, except rows that are float64 near-ties (asserted, counted)."""
    mismatches = (ours != theirs).nonzero().flatten().tolist()
    if not mismatches:
        return 0
    logits64 = reference.compute_logits(hidden.double(), weight.double())
    vocab = torch.arange(weight.shape[0], device=hidden.device)
    for row in mismatches:
        noise = rng.gumbel(params.seed[row], positions[row], vocab)
        assert is_near_tie(logits64[row], bool(params.do_sample[row]),
                           float(params.temperature[row]), int(params.top_k[row]),
                           float(params.top_p[row]), float(params.min_p[row]), noise,
                           int(ours[row]), int(theirs[row])), (
            f"{what} row {row}: kernel {int(ours[row])} vs reference {int(theirs[row])} "
            "is not a near-tie")
    assert len(mismatches) <= max(1, len(ours) // 20), f"{what}: {len(mismatches)} near-ties"
    return len(mismatches)


@pytest.mark.parametrize("batch,vocab_size,dim", [
    (1, 97, 16), (2, 300, 40), (5, 513, 64), (16, 130, 24), (17, 257, 48),
    (3, 2000, 16),  # more vocab tiles than the merge keeps (max_support): two-level merge
    (4, 150, 13),   # 52-byte rows: not TMA-aligned, the pointer-load path
])
def test_sample_pathwise_equals_reference(batch, vocab_size, dim):
    g = torch.Generator().manual_seed(batch * 1000 + vocab_size)
    hidden, weight, positions = random_problem(g, batch, vocab_size, dim)
    params = mixed_params(g, batch, seed=batch)
    ours, ours_lp, ours_lse, _ = fused_sample(hidden, weight, params, positions, config=SMALL)
    theirs, lp, lse, _ = reference_sample(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions)
    same = ours == theirs
    assert torch.allclose(ours_lp[same], lp[same], atol=2e-4, rtol=1e-4)
    assert torch.allclose(ours_lse, lse, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("case", list(semantics.TRUNCATION_CASES))
def test_each_truncation_mode_pathwise(case):
    g = torch.Generator().manual_seed(7)
    hidden, weight, positions = random_problem(g, 6, 200, 32)
    params = SamplingParams.create(6, seed=11, device=DEVICE, **semantics.TRUNCATION_CASES[case])
    ours = fused_tokens(hidden, weight, params, positions, config=SMALL)
    theirs = reference_tokens(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions, case)


def test_argmax_pathwise_and_ties():
    g = torch.Generator().manual_seed(3)
    for batch, vocab_size, dim in [(1, 100, 16), (9, 333, 32)]:
        hidden, weight, _ = random_problem(g, batch, vocab_size, dim)
        ours = fused_argmax(hidden, weight, config=SMALL).tokens
        theirs = reference_argmax(hidden, weight).tokens
        greedy = SamplingParams.create(batch, do_sample=False, seed=0, device=DEVICE)
        assert_same_tokens(ours, theirs, hidden, weight, greedy, torch.zeros_like(ours))
    weight = torch.zeros(100, 16, device=DEVICE)
    weight[[37, 70, 90], 0] = 1.0  # an exact three-way tie across vocab tiles
    hidden = torch.zeros(2, 16, device=DEVICE)
    hidden[:, 0] = 1.0
    assert fused_argmax(hidden, weight, config=SMALL).tokens.tolist() == [37, 37]


def crowded_problem(support: torch.Tensor):
    """3 rows (V = 300, D = 32) whose 20 best tokens are `support` (20 ids), well above the
    rest; sampled with top-k 20, 10 and no top-k, top-p 1, 0.95 and 0.9."""
    g = torch.Generator().manual_seed(5)
    hidden, weight, positions = random_problem(g, 3, 300, 32, scale=0.1)
    direction = torch.randn(32, generator=g).to(DEVICE)
    weight[support] += direction * 4.0 / direction.norm()
    hidden[:] += direction * 2.0 / direction.norm()
    params = SamplingParams.create(3, temperature=0.7, top_k=[20, 10, 0], top_p=[1.0, 0.95, 0.9],
                                   seed=1, device=DEVICE)
    return hidden, weight, positions, params


def test_ties_across_interleaved_tiles_go_to_the_lower_id():
    """With truncation the tiles interleave 16-token groups, so tile order is not id
    order: an exact tie between tokens 37 and 70 (other tiles, 70 in the lower tile)
    still goes to 37 for a greedy row of a truncating batch, as torch's argmax does."""
    weight = torch.zeros(100, 16, device=DEVICE)
    weight[[37, 70, 90], 0] = 1.0
    hidden = torch.zeros(2, 16, device=DEVICE)
    hidden[:, 0] = 1.0
    params = SamplingParams.create(2, do_sample=[False, True], temperature=[1.0, 0.01],
                                   top_k=[0, 2], seed=0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    ours = fused_tokens(hidden, weight, params, positions, config=SMALL)
    assert ours[0] == 37
    assert torch.equal(ours, reference_tokens(hidden, weight, params, positions))


def test_supports_of_neighbouring_ids_stay_within_the_candidate_budget():
    """A support of 20 nearby token ids (how tokenizers number related tokens), every
    other id from 64 to 102: a contiguous 32-token tile would hold 16 of them, its whole
    candidate budget here, and need completion; interleaved tiles hold their three
    16-token groups in three tiles (8, 8 and 4 tokens). No row needs completion, and
    every row equals the reference."""
    support = torch.arange(64, 104, 2, device=DEVICE)
    hidden, weight, positions, params = crowded_problem(support)
    config = kernels.TileConfig(block_v=32, block_r=16, block_d=16, candidates=16, max_support=32)
    kernels.reset_stats()
    ours = fused_tokens(hidden, weight, params, positions, config=config)
    assert kernels.stats().rows_completed == 0
    assert torch.equal(ours, reference_tokens(hidden, weight, params, positions))
    assert torch.isin(ours, support).all()


def test_interleaved_tiles_load_through_tma_when_vocab_fills_the_tiles():
    """V a multiple of the tile: interleaved tiles are one box of the weight viewed as
    [BLOCK_V / 16, NUM_VT, 16, D] and load through TMA; a ragged V loads through pointers.
    Both give the reference's tokens, for a crowded support and for mixed rows."""
    config = kernels.TileConfig(block_v=32, block_r=16, block_d=16, candidates=16, max_support=32)
    support = torch.arange(64, 104, 2, device=DEVICE)
    hidden, weight, positions, params = crowded_problem(support)
    assert kernels.ops.tma_descriptors(hidden, weight[:288], config, interleave=True) is not None
    assert kernels.ops.tma_descriptors(hidden, weight, config, interleave=True) is None  # 300
    g = torch.Generator().manual_seed(13)
    extra_hidden, _, extra_positions = random_problem(g, 5, 288, 32)
    hidden = torch.cat([hidden, extra_hidden])
    positions = torch.cat([positions, extra_positions])
    params = SamplingParams.create(
        8, temperature=[0.7] * 3 + [1.0, 0.6, 1.2, 1.0, 0.8], top_k=[20, 10, 0, 5, 20, 0, 8, 1],
        top_p=[1.0, 0.95, 0.9, 1.0, 0.95, 0.8, 1.0, 1.0], min_p=[0.0] * 6 + [0.05, 0.0],
        seed=1, device=DEVICE)
    for vocab_size in (288, 300):
        kernels.reset_stats()
        ours = fused_tokens(hidden, weight[:vocab_size], params, positions, config=config)
        assert kernels.stats().rows_completed == 0
        theirs = reference_tokens(hidden, weight[:vocab_size], params, positions)
        assert_same_tokens(ours, theirs, hidden, weight[:vocab_size], params, positions,
                           f"V={vocab_size}")


def test_whole_top_k_inside_one_tile_is_completed_exactly():
    """The 20 best tokens are neighbours: 16 of them form one 16-token group, which one
    vocab tile holds whole, more than its candidate budget, so the row must go through the
    exact completion path."""
    hidden, weight, positions, params = crowded_problem(torch.arange(64, 84, device=DEVICE))
    kernels.reset_stats()
    ours = fused_tokens(hidden, weight, params, positions, config=SMALL)
    assert kernels.stats().rows_completed == 3
    theirs = reference_tokens(hidden, weight, params, positions)
    assert torch.equal(ours, theirs)
    assert ((ours >= 64) & (ours < 84)).all()


def test_top_k_beyond_one_tiles_budget_is_not_certified():
    """Regression: top_k larger than a tile's candidate budget, with top-p cutting inside
    the candidates. The merged list is incomplete below the tile's last candidate, so top-p
    cannot be normalised from it: every row must be completed, and exactly."""
    g = torch.Generator().manual_seed(12)
    hidden, weight, positions = random_problem(g, 4, 30, 16)  # one vocab tile of SMALL
    params = SamplingParams.create(4, temperature=1.5, top_k=12, top_p=0.5, min_p=0.05,
                                   seed=3, device=DEVICE)
    config = kernels.TileConfig(block_v=32, block_r=16, block_d=16, candidates=4, max_support=32)
    kernels.reset_stats()
    ours = fused_tokens(hidden, weight, params, positions, config=config)
    assert kernels.stats().rows_completed == 4
    assert torch.equal(ours, reference_tokens(hidden, weight, params, positions))


@pytest.mark.parametrize("truncation,fast_rows", [
    (dict(top_k=40), 0), (dict(top_k=100, top_p=0.9), 0), (dict(top_k=500, min_p=0.8), 6)])
def test_top_k_longer_than_the_merged_list(truncation, fast_rows):
    """Regression: a top-k longer than the merged list (SMALL keeps 32 candidates) was cut
    at a threshold of 0, so rows whose logits were all negative kept nothing and sampled a
    wrong token with status ok. Such a top-k removes no candidate: alone, or under top-p
    (normalised over the whole top-k), the row is completed exactly; a min-p that ends the
    support inside the list needs no completion."""
    g = torch.Generator().manual_seed(21)
    weight = -(torch.randn(1000, 16, generator=g).abs() / 4).to(DEVICE)
    hidden = torch.randn(6, 16, generator=g).abs().to(DEVICE)
    positions = torch.arange(6, device=DEVICE)
    params = SamplingParams.create(6, seed=5, device=DEVICE, **truncation)
    assert (reference.compute_logits(hidden, weight) < 0).all()
    kernels.reset_stats()
    ours = fused_tokens(hidden, weight, params, positions, config=SMALL)
    if SMALL is not None:  # the GPU's default tiles keep another budget
        assert kernels.stats().rows_completed == 6 - fast_rows
    theirs = reference_tokens(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions, str(truncation))


class StageOneSpy:
    """Stands in for the stage-1 kernel and records each launch's LSE, SAMPLE and DRAFT flags
    and row tile."""

    def __init__(self, kernel):
        self.kernel, self.lse, self.sample, self.draft, self.block_r = kernel, [], [], [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.lse.append(kwargs["LSE"])
            self.sample.append(kwargs["SAMPLE"])
            self.draft.append(kwargs["DRAFT"])
            self.block_r.append(kwargs["BLOCK_R"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("top_k, full_normaliser, completed", [
    # Every row has a top-k below V = 200; row 2's (150, under top-p) is longer than the
    # 32 candidates SMALL merges, so that row is completed.
    ([10, 5, 150, 6, 1, 3], False, 1),
    # A top-k of V or more disables itself: row 2 (under top-p) needs the full sum, row 5
    # (alone) the noise of stage 1.
    ([10, 5, 200, 6, 1, 300], True, 0),
])
def test_rows_with_a_top_k_leave_out_the_normaliser_and_the_noise(monkeypatch, top_k,
                                                                  full_normaliser, completed):
    """Where every row has a top-k below V, stage 1 skips the log-sum-exp and the noise:
    stage 2 draws each token among its candidates and normalises its support over them
    (logprobs and lse included); otherwise stage 1 computes both (the next test covers the
    noise where every sampled row is truncated some other way). Either way the results are
    the reference's."""
    spy = StageOneSpy(kernels.ops.lm_head.lm_head_tiles_kernel)
    monkeypatch.setattr(kernels.ops.lm_head, "lm_head_tiles_kernel", spy)
    g = torch.Generator().manual_seed(31)
    hidden, weight, positions = random_problem(g, 6, 200, 32)
    params = SamplingParams.create(6, temperature=[0.6, 1.0, 0.7, 0.6, 1.0, 0.8], top_k=top_k,
                                   top_p=[0.95, 1.0, 0.9, 1.0, 1.0, 1.0],
                                   min_p=[0.0, 0.0, 0.0, 0.05, 0.0, 0.0], seed=3, device=DEVICE)
    kernels.reset_stats()
    ours, ours_lp, ours_lse, _ = fused_sample(hidden, weight, params, positions, config=SMALL)
    assert spy.lse == spy.sample == [full_normaliser]
    if SMALL is not None:
        assert kernels.stats().rows_completed == completed
    theirs, lp, lse, _ = reference_sample(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions)
    same = ours == theirs
    assert torch.allclose(ours_lp[same], lp[same].float(), atol=2e-4, rtol=1e-4)
    assert torch.allclose(ours_lse, lse.float(), atol=2e-4, rtol=1e-5)


def test_a_subset_keeps_its_results_under_the_whole_batchs_flags(monkeypatch):
    """`select(validate=False)` keeps the whole batch's host flags, as a decode loop's captured
    graphs do. Here they switch stage 1's noise on for a subset whose own flags leave it out
    (the greedy row and the untruncated one are not in it): the subset's tokens, logprobs and
    log-sum-exps are the same either way."""
    spy = StageOneSpy(kernels.ops.lm_head.lm_head_tiles_kernel)
    monkeypatch.setattr(kernels.ops.lm_head, "lm_head_tiles_kernel", spy)
    g = torch.Generator().manual_seed(34)
    hidden, weight, positions = random_problem(g, 4, 200, 32)
    params = SamplingParams.create(4, do_sample=[False, True, True, True],
                                   temperature=[0.0, 0.9, 0.7, 1.1], top_p=[1.0, 1.0, 0.5, 1.0],
                                   min_p=[0.0, 0.0, 0.0, 0.3], seed=6, device=DEVICE)
    rows = torch.tensor([2, 3], device=DEVICE)
    kept, own = params.select(rows, validate=False), params.select(rows)
    assert kept.kernel_flags(200) != own.kernel_flags(200)
    a, b = (kernels.fused_sample(hidden[rows], weight, p, positions[rows], config=SMALL)
            for p in (kept, own))
    assert spy.sample == [True, False]
    assert (a.status == 0).all() and torch.equal(a.status, b.status)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.lse, b.lse)


def test_top_p_under_a_top_k_of_v_or_more_normalises_over_the_vocabulary():
    """A top-k of V or more keeps everything, so a top-p under it needs stage 1's log-sum-exp
    (it was left out there once, where no logprob was asked for, and the top-p cut fell in
    the wrong place: 7 of these 16 tokens differed)."""
    g = torch.Generator().manual_seed(33)
    hidden, weight, positions = random_problem(g, 16, 200, 32)
    params = SamplingParams.create(16, temperature=0.8, top_k=300, top_p=0.5, seed=5,
                                   device=DEVICE)
    ours = fused_tokens(hidden, weight, params, positions, config=SMALL)
    theirs = reference_tokens(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions)


@pytest.mark.parametrize("top_p, noise", [
    # Greedy rows beside rows truncated by a top-p alone, a min-p alone, a top-k: stage 1
    # draws no noise (and keeps the log-sum-exp for the top-p rows).
    ([1.0, 0.9, 1.0, 1.0, 0.8], False),
    # Row 1 keeps everything in the kernels: its top-p rounds to 1 in float32, as they read
    # it (the reference's float64 cut drops a tail of mass < 1e-9 at most).
    ([1.0, 1 - 1e-9, 1.0, 1.0, 0.8], True),
])
def test_stage_one_draws_noise_only_for_untruncated_sampled_rows(monkeypatch, top_p, noise):
    """Truncated rows draw their token among their candidates in stage 2, with the
    candidates' own noise: stage 1's Gumbel-max serves only sampled rows without truncation.
    Either way the tokens and logprobs are the reference's."""
    spy = StageOneSpy(kernels.ops.lm_head.lm_head_tiles_kernel)
    monkeypatch.setattr(kernels.ops.lm_head, "lm_head_tiles_kernel", spy)
    g = torch.Generator().manual_seed(32)
    hidden, weight, positions = random_problem(g, 5, 200, 32)
    params = SamplingParams.create(5, do_sample=[False, True, True, True, True],
                                   temperature=[0.0, 0.6, 1.0, 0.7, 1.3], top_k=[0, 0, 0, 7, 0],
                                   top_p=top_p, min_p=[0.0, 0.0, 0.1, 0.0, 0.05], seed=3,
                                   device=DEVICE)
    ours, ours_lp, _, _ = fused_sample(hidden, weight, params, positions, config=SMALL)
    assert spy.sample == [noise] and spy.lse == [True]
    theirs, lp, _, _ = reference_sample(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions)
    same = ours == theirs
    assert torch.allclose(ours_lp[same], lp[same].float(), atol=2e-4, rtol=1e-4)


def test_tiles_chosen_by_32_bit_keys_leave_nothing_uncertified():
    """Stage 2 picks the tiles to merge by a 32-bit key whose low bits hold the tile index,
    so tiles with maxima a few ulps apart are ordered by index, not value. Here 40 tiles
    hold maxima 1, 1 + ulp, ..., 1 + 39 ulp in increasing tile order; the merge keeps 32
    tiles (SMALL), the 32 with the smallest maxima, and the top 3 lie in tiles left out.
    The certificate's floor must cover them: every row is completed, and exactly."""
    vocab_size, dim = 2048, 16  # 64 tiles of 32 interleaved tokens: token 16 i is in tile i
    weight = torch.zeros(vocab_size, dim)
    weight[:, 0] = -5.0
    weight[:, 1:] = torch.randn(vocab_size, dim - 1, generator=torch.Generator().manual_seed(0))
    top = torch.arange(40)
    weight[16 * top, 0] = (1.0 + top.double() * 2.0**-23).float()  # exact in fp32
    hidden = torch.zeros(4, dim)
    hidden[:, 0] = 1.0
    weight, hidden = weight.to(DEVICE), hidden.to(DEVICE)
    positions = torch.arange(4, device=DEVICE)
    params = SamplingParams.create(4, top_k=3, seed=2, device=DEVICE)
    kernels.reset_stats()
    ours = fused_tokens(hidden, weight, params, positions, config=SMALL)
    if SMALL is not None:
        assert kernels.stats().rows_completed == 4
    assert torch.equal(ours, reference_tokens(hidden, weight, params, positions))
    assert (ours >= 16 * 37).all()


def test_tile_configurations_give_identical_tokens():
    g = torch.Generator().manual_seed(9)
    hidden, weight, positions = random_problem(g, 7, 400, 48)
    params = mixed_params(g, 7, seed=4)
    a, _, a_lse, _ = fused_sample(hidden, weight, params, positions, config=SMALL)
    b, _, b_lse, _ = fused_sample(hidden, weight, params, positions, config=OTHER)
    assert_same_tokens(a, b, hidden, weight, params, positions, "two tilings")
    assert torch.allclose(a_lse, b_lse, atol=1e-4, rtol=1e-5)
    quarters = kernels.TileConfig(block_v=64, block_r=16, block_d=16, epilogue_parts=4)
    c, _, c_lse, _ = fused_sample(hidden, weight, params, positions, config=quarters)
    assert_same_tokens(c, a, hidden, weight, params, positions, "epilogue in four parts")
    assert torch.allclose(c_lse, a_lse, atol=1e-4, rtol=1e-5)
    assert torch.equal(fused_argmax(hidden, weight, config=SMALL).tokens,
                       fused_argmax(hidden, weight, config=OTHER).tokens)


def test_row_token_does_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(10)
    hidden, weight, positions = random_problem(g, 9, 250, 32)
    params = mixed_params(g, 9, seed=2)
    full = fused_tokens(hidden, weight, params, positions, config=SMALL)
    others = hidden.clone()
    others[1:] = torch.randn(8, 32, generator=g).to(DEVICE) * 3
    changed = fused_tokens(others, weight, params, positions, config=SMALL)
    rows = torch.tensor([4, 0, 7])
    subset = fused_tokens(hidden[rows.to(DEVICE)], weight, params.select(rows),
                          positions[rows.to(DEVICE)], config=SMALL)
    assert full[0] == changed[0]
    assert torch.equal(subset, full[rows.to(DEVICE)])


def kernel_sampler(hidden, weight, params, positions):
    """The fused `sample`'s tokens on DEVICE for checks written with CPU tensors."""
    return fused_tokens(hidden.to(DEVICE), weight.to(DEVICE), params.to(DEVICE),
                        positions.to(DEVICE), config=SMALL).cpu()


def test_sampling_goodness_of_fit_untruncated():
    num_samples = 20_000 if ON_GPU else 4_000
    semantics.check_truncation_gof("temperature", num_samples=num_samples, sample=kernel_sampler)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(semantics.TRUNCATION_CASES))
def test_sampling_goodness_of_fit_every_mode_gpu(case):
    # CPU twin: test_each_truncation_mode_pathwise (the reference passes the same test).
    semantics.check_truncation_gof(case, sample=kernel_sampler)


def test_non_finite_rows_are_reported():
    g = torch.Generator().manual_seed(0)
    hidden, weight, positions = random_problem(g, 3, 120, 16)
    hidden[2, 3] = float("nan")
    params = SamplingParams.create(3, seed=0, device=DEVICE)
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[2\]"):
        fused_sample(hidden, weight, params, positions, config=SMALL)
    out = fused_sample(hidden, weight, params, positions, check=False, config=SMALL)
    assert out.tokens[2] == -1 and (out.tokens[:2] >= 0).all()
    assert out.status.tolist() == [0, 0, NON_FINITE]
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[2\]"):
        fused_argmax(hidden, weight, config=SMALL)
    greedy = fused_argmax(hidden, weight, check=False, config=SMALL)
    assert greedy.tokens[2] == -1 and greedy.status.tolist() == [0, 0, NON_FINITE]


@pytest.mark.parametrize("make,match", [
    (lambda h, w: (h[:, :5], w), "hidden size mismatch"),
    (lambda h, w: (h.half(), w), "float16.*float32"),
    (lambda h, w: (h[:0], w), "empty batch"),
    (lambda h, w: (h, w.T.contiguous().T), "`weight` must be contiguous"),
])
def test_bad_inputs_are_refused_before_launch(make, match):
    g = torch.Generator().manual_seed(0)
    hidden, weight, _ = random_problem(g, 3, 50, 16)
    with pytest.raises(ValueError, match=match):
        fused_argmax(*make(hidden, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64, 256])  # 256: the Gluon stage 1 on Hopper
def test_full_size_head_bf16_gpu(batch):
    """D=4096, V=151,936 in bf16: pathwise equal to the reference (near-ties allowed)."""
    g = torch.Generator().manual_seed(batch)
    hidden, weight, positions = random_problem(g, batch, 151_936, 4096, torch.bfloat16, scale=4.0)
    params = mixed_params(g, batch, seed=batch)
    kernels.reset_stats()
    ours, ours_lp, _, _ = fused_sample(hidden, weight, params, positions)
    theirs, lp, _, _ = reference_sample(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions, f"B={batch}")
    same = ours == theirs
    assert torch.allclose(ours_lp[same], lp[same], atol=1e-3, rtol=1e-3)
    greedy = SamplingParams.create(batch, do_sample=False, seed=0, device=DEVICE)
    assert_same_tokens(fused_argmax(hidden, weight).tokens, reference_argmax(hidden, weight).tokens,
                       hidden, weight, greedy, positions, "argmax")


def test_programmatic_launch_only_for_cuda_from_hopper_on():
    """Stage 2 and the finaliser launch as programmatic dependents on Hopper and later (their
    `griddepcontrol` has no interpreter or CPU meaning); elsewhere plainly, with the same
    results (the GPU twin below)."""
    assert not kernels.ops.programmatic_launch_ready(torch.device("cpu"))
    if ON_GPU:
        hopper_on = torch.cuda.get_device_capability()[0] >= 9 and not torch.version.hip
        interpreted = triton.knobs.runtime.interpret
        assert kernels.ops.programmatic_launch_ready(torch.device("cuda")) == (
            hopper_on and not interpreted)


def test_launchers_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    """The unchecked launchers still name the device a CPU tensor is on, as
    `flashspec.sampling` does, instead of Triton's "0 active drivers"."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, positions = (t.cpu() for t in random_problem(g, 2, 64, 32))
    params, verify_params = mixed_params(g, 2).to("cpu"), mixed_params(g, 1).to("cpu")
    drafts = torch.zeros(1, 1, dtype=torch.int64)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    for launch in (lambda: kernels.fused_argmax(hidden, weight),
                   lambda: kernels.fused_sample(hidden, weight, params, positions),
                   lambda: kernels.fused_verify(hidden.view(1, 2, -1), weight, drafts,
                                                verify_params, positions[:1])):
        with pytest.raises(ValueError, match="need CUDA tensors .* got tensors on cpu"):
            launch()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 256])  # Triton's stage 1, and the Gluon one on Hopper
def test_programmatic_launch_changes_no_output_gpu(monkeypatch, rows):
    """Sampling and verification with stage 2 and the finaliser launched plainly and as
    programmatic dependents (where the GPU has them) give the same outputs bit for bit."""
    g = torch.Generator().manual_seed(rows)
    hidden, weight, positions = random_problem(g, rows, 151_936, 4096, torch.bfloat16, scale=4.0)
    params = mixed_params(g, rows, seed=rows)
    batch = rows // 4
    verify_params = mixed_params(g, batch, seed=rows + 1)
    drafts = torch.randint(0, 151_936, (batch, 3), generator=g).to(DEVICE)

    def run():
        sampled = kernels.fused_sample(hidden, weight, params, positions)
        verified = kernels.fused_verify(hidden.view(batch, 4, -1), weight, drafts,
                                        verify_params, positions[:batch])
        return (*sampled, *verified)

    dependent = run()
    monkeypatch.setattr(kernels.ops, "programmatic_launch_ready", lambda device: False)
    plain = run()
    for a, b in zip(dependent, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
