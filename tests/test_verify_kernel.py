"""Fused verification (`flashspec.sampling.verify`'s fused backend) against the torch
reference.

On a CPU machine the kernels run through Triton's interpreter on small shapes; on a CUDA
machine the same tests run compiled, and the `gpu` tests add D=4096, V=151,936.
"""

import pytest
import torch

from flashspec import NonFiniteLogitsError, SamplingParams, VerifyOutput, kernels, reference, rng
from flashspec import sampling
from flashspec.outputs import NEEDS_COMPLETION, NON_FINITE
from flashspec.bench.statistics import is_near_tie

import test_reference as semantics
from test_kernels import (DEVICE, OTHER, SMALL, StageOneSpy, fused_tokens, fused_verify,
                          mixed_params, random_problem)
from test_reference import reference_tokens, reference_verify


def kernel_verify(hidden, weight, drafts, params, positions, config=SMALL, **kwargs):
    """The fused verify on DEVICE, results back on the inputs' device (the reference tests'
    checks run on CPU tensors)."""
    out = fused_verify(hidden.to(DEVICE), weight.to(DEVICE), drafts.to(DEVICE),
                       params.to(DEVICE), positions.to(DEVICE), config=config, **kwargs)
    return VerifyOutput(*(t.to(hidden.device) for t in out))


def verify_problem(g, batch, num_drafts, vocab_size, dim):
    """CPU hidden ``[B, G+1, D]``, weight and positions of a random verification."""
    flat_hidden, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim)
    hidden = flat_hidden.view(batch, num_drafts + 1, dim).cpu()
    return hidden, weight.cpu(), torch.randint(0, 1000, (batch,), generator=g)


def plain_samples(hidden, weight, params, positions):
    """The reference's plain sample at each of the G+1 positions, ``[B, G+1]``."""
    return torch.stack([reference_tokens(hidden[:, j], weight, params, positions + j)
                        for j in range(hidden.shape[1])], dim=1)


def random_drafts(g, plain, vocab_size):
    """Right, wrong, random and padded drafts mixed per row, from the plain samples."""
    batch, num_drafts = plain.shape[0], plain.shape[1] - 1
    drafts = plain[:, :-1].clone()
    wrong = torch.rand(drafts.shape, generator=g) < 0.3
    drafts[wrong] = torch.randint(0, vocab_size, (int(wrong.sum()),), generator=g)
    lengths = torch.randint(0, num_drafts + 1, (batch,), generator=g)
    return torch.where(torch.arange(num_drafts)[None, :] < lengths[:, None], drafts, -1)


def check_right_and_random_drafts(g, hidden, weight, params, positions, **kwargs):
    """The fused verification (`kwargs`: its config) equals the reference's with the plain
    samples as drafts (all right) and with `random_drafts`; kernel stats are reset first.
    Returns the last fused output."""
    plain = plain_samples(hidden, weight, params, positions)
    kernels.reset_stats()
    for drafts in (plain[:, :-1], random_drafts(g, plain, weight.shape[0])):
        ours = kernel_verify(hidden, weight, drafts, params, positions, **kwargs)
        theirs = reference_verify(hidden, weight, drafts, params, positions)
        assert_same_verify(ours, theirs, hidden, weight, params, positions)
    return ours


def assert_same_verify(ours, theirs, hidden, weight, params, positions):
    """Equal outputs, except rows whose first differing token is a float64 near-tie there."""
    flat = hidden.reshape(-1, hidden.shape[-1]).double()
    logits64 = reference.compute_logits(flat, weight.double()).view(*hidden.shape[:2], -1)
    vocab = torch.arange(weight.shape[0])
    differing = (ours.tokens != theirs.tokens).any(dim=1) | (ours.num_accepted != theirs.num_accepted)
    for b in differing.nonzero().flatten().tolist():
        j = int((ours.tokens[b] != theirs.tokens[b]).nonzero()[0])
        mine, other = int(ours.tokens[b, j]), int(theirs.tokens[b, j])
        noise = rng.gumbel(params.seed[b].cpu(), positions[b].cpu() + j, vocab)
        assert mine >= 0 and other >= 0 and is_near_tie(
            logits64[b, j].cpu(), bool(params.do_sample[b]), float(params.temperature[b]),
            int(params.top_k[b]), float(params.top_p[b]), float(params.min_p[b]), noise,
            mine, other), f"row {b} position {j}: kernel {mine} vs reference {other}"
    assert int(differing.sum()) <= max(1, hidden.shape[0] // 10)
    same = ~differing
    assert torch.allclose(ours.accept_probs[same], theirs.accept_probs[same].float(), atol=2e-5)
    assert torch.allclose(ours.logprobs[same], theirs.logprobs[same].float(), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("batch,num_drafts,vocab_size,dim", [
    (1, 1, 97, 16), (3, 4, 300, 40), (5, 2, 513, 64), (2, 0, 130, 24), (4, 3, 150, 13),
])
@pytest.mark.parametrize("acceptance", ["strict", "probabilistic"])
def test_verify_pathwise_equals_reference(batch, num_drafts, vocab_size, dim, acceptance):
    g = torch.Generator().manual_seed(batch * 100 + num_drafts * 10 + vocab_size)
    flat_hidden, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim)
    hidden = flat_hidden.view(batch, num_drafts + 1, dim).cpu()
    weight = weight.cpu()
    positions = torch.randint(0, 10_000, (batch,), generator=g)
    params = mixed_params(g, batch, seed=batch).to("cpu")
    plain = torch.stack([reference_tokens(hidden[:, j], weight, params, positions + j)
                         for j in range(num_drafts + 1)], dim=1)
    drafts = random_drafts(g, plain, vocab_size)
    theirs = reference_verify(hidden, weight, drafts, params, positions, acceptance=acceptance)
    ours = kernel_verify(hidden, weight, drafts, params, positions, acceptance=acceptance)
    assert_same_verify(ours, theirs, hidden, weight, params, positions)


@pytest.mark.parametrize("seed", [0, 1])
def test_speculation_invariance(seed):
    """Whatever the drafts, every emitted token is what plain sampling gives there."""
    semantics.check_speculation_invariance(seed, verify=kernel_verify)


@pytest.mark.parametrize("case", ["none", "qwen3", "llama", "all"])
def test_speculation_invariance_per_truncation_mode(case):
    g = torch.Generator().manual_seed(3)
    batch, num_drafts, vocab_size, dim = 4, 3, 200, 32
    flat_hidden, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim)
    hidden, weight = flat_hidden.view(batch, num_drafts + 1, dim).cpu(), weight.cpu()
    positions = torch.randint(0, 1000, (batch,), generator=g)
    params = SamplingParams.create(batch, seed=9, **semantics.TRUNCATION_CASES[case])
    ours = check_right_and_random_drafts(g, hidden, weight, params, positions, config=OTHER)
    assert (ours.num_accepted >= 0).all()


def test_untruncated_verification_of_65_to_128_rows_takes_64_row_tiles(monkeypatch):
    """Verification's own default tiles (64 rows where 65-128 are verified: its epilogue
    would leave one 128-row program per SM); results are the reference's."""
    spy = StageOneSpy(kernels.ops.lm_head.lm_head_tiles_kernel)
    monkeypatch.setattr(kernels.ops.lm_head, "lm_head_tiles_kernel", spy)
    g = torch.Generator().manual_seed(11)
    batch, num_drafts, vocab_size = 17, 3, 150
    hidden, weight, positions = verify_problem(g, batch, num_drafts, vocab_size, 24)
    params = SamplingParams.create(batch, do_sample=[True] * 16 + [False], temperature=0.8,
                                   seed=5)
    drafts = random_drafts(g, plain_samples(hidden, weight, params, positions), vocab_size)
    ours = kernel_verify(hidden, weight, drafts, params, positions, config=None)
    theirs = reference_verify(hidden, weight, drafts, params, positions)
    assert_same_verify(ours, theirs, hidden, weight, params, positions)
    assert spy.block_r == [64]
    assert kernels.default_config(batch * (num_drafts + 1), 2).block_r == 128  # sampling's


@pytest.mark.parametrize("rows, verification_rows", [(64, 64), (65, 64), (128, 64), (129, 128)])
def test_verification_table_takes_64_row_tiles_for_65_to_128_rows(rows, verification_rows):
    """Untruncated verification of 65-128 rows: 64-row tiles; elsewhere sampling's tiles;
    truncation's own table whatever the kernel."""
    verification = kernels.default_config(rows, 2, verification=True)
    sampling = kernels.default_config(rows, 2)
    assert verification.block_r == verification_rows
    assert (verification == sampling) == (not 64 < rows <= 128)
    assert (kernels.default_config(rows, 2, truncation=True, verification=True)
            == kernels.default_config(rows, 2, truncation=True))


@pytest.mark.parametrize("top_k, full_normaliser", [([10, 7, 150, 4], False),
                                                    ([10, 7, 300, 300], True)])
def test_rows_with_a_top_k_verify_without_the_normaliser_and_the_noise(monkeypatch, top_k,
                                                                       full_normaliser):
    """Where every row has a top-k below V, stage 1 skips the log-sum-exp, the noise and the
    drafts: p(draft), the logprobs and the acceptance come from the candidates. A top-k of V
    or more disables itself and stage 1 computes all three (batch row 3 keeps everything).
    Batch row 2 is completed exactly either way: its top-k of 150 under top-p is longer than
    SMALL's 32 merged candidates, and so is its top-p support."""
    spy = StageOneSpy(kernels.ops.lm_head.lm_head_tiles_kernel)
    monkeypatch.setattr(kernels.ops.lm_head, "lm_head_tiles_kernel", spy)
    g = torch.Generator().manual_seed(8)
    batch, num_drafts, vocab_size = 4, 3, 200
    hidden, weight, positions = verify_problem(g, batch, num_drafts, vocab_size, 32)
    params = SamplingParams.create(batch, temperature=[0.6, 1.2, 0.8, 0.9], top_k=top_k,
                                   top_p=[0.95, 1.0, 0.9, 1.0], seed=4)
    check_right_and_random_drafts(g, hidden, weight, params, positions)
    assert spy.lse == spy.sample == spy.draft == [full_normaliser] * 2
    if SMALL is not None:
        assert kernels.stats().rows_completed == 2  # batch row 2, in both calls


@pytest.mark.parametrize("do_sample, drafts_in_tiles", [
    ([True, True, True], False),  # every row truncated: the candidates decide everything
    ([False, True, True], True),  # a greedy row needs stage 1's draft summaries, not its noise
])
def test_truncated_rows_verify_without_stage_one_noise(monkeypatch, do_sample, drafts_in_tiles):
    """Rows truncated by a top-p alone, a min-p alone or a top-k draw and judge their drafts
    among their candidates in stage 2: stage 1 draws no noise, and leaves the drafts out
    only for greedy rows. Results are the reference's for right, wrong and padded drafts, and
    every row is decided by the fused kernels (supports within SMALL's candidates)."""
    spy = StageOneSpy(kernels.ops.lm_head.lm_head_tiles_kernel)
    monkeypatch.setattr(kernels.ops.lm_head, "lm_head_tiles_kernel", spy)
    g = torch.Generator().manual_seed(9)
    batch, num_drafts, vocab_size = 3, 3, 200
    hidden, weight, positions = verify_problem(g, batch, num_drafts, vocab_size, 32)
    params = SamplingParams.create(batch, do_sample=do_sample, temperature=[0.6, 1.2, 0.8],
                                   top_k=[0, 0, 3], top_p=[0.7, 1.0, 1.0], min_p=[0.0, 0.3, 0.0],
                                   seed=4)
    check_right_and_random_drafts(g, hidden, weight, params, positions)
    assert spy.sample == [False] * 2 and spy.draft == [drafts_in_tiles] * 2
    if SMALL is not None:
        assert kernels.stats().rows_completed == 0


def test_verify_probabilities_match_float64():
    g, weight, hidden, params, positions = semantics._verify_setup(seed=4)
    drafts = torch.randint(0, weight.shape[0], (hidden.shape[0], hidden.shape[1] - 1), generator=g)
    drafts[0, 3:] = -1
    drafts[1, 1] = -1
    drafts[1, 2] = 7  # a draft after padding is not a draft
    ours = kernel_verify(hidden, weight, drafts, params, positions)
    theirs = reference_verify(hidden, weight, drafts, params, positions)
    assert_same_verify(ours, theirs, hidden, weight, params, positions)
    quarters = kernels.TileConfig(block_v=64, block_r=16, block_d=16, epilogue_parts=4)
    assert_same_verify(kernel_verify(hidden, weight, drafts, params, positions, config=quarters),
                       theirs, hidden, weight, params, positions)
    flat_params = params.repeat_interleave(hidden.shape[1])
    logits64 = reference.compute_logits(hidden.reshape(-1, hidden.shape[-1]).double(),
                                        weight.double())
    log_probs64 = reference.transform_logits(logits64, flat_params).log_softmax(-1)
    log_probs64 = log_probs64.view(*hidden.shape[:2], -1)
    is_draft = (drafts >= 0).cumprod(dim=1).bool()
    draft_p = log_probs64[:, :-1].gather(-1, drafts.clamp_min(0)[..., None]).squeeze(-1).exp()
    argmax = logits64.view(*hidden.shape[:2], -1)[:, :-1].argmax(-1)
    expected = torch.where(params.is_greedy[:, None], (drafts == argmax).double(), draft_p)
    expected = torch.where(is_draft, expected, 0.0)
    assert torch.allclose(ours.accept_probs.double(), expected, rtol=0, atol=1e-5)
    emitted = ours.tokens >= 0
    expected_lp = log_probs64.gather(-1, ours.tokens.clamp_min(0)[..., None]).squeeze(-1)
    assert torch.allclose(ours.logprobs.double()[emitted], expected_lp[emitted], atol=1e-5)
    assert (ours.logprobs[~emitted] == 0).all()


@pytest.mark.gpu
def test_probabilistic_acceptance_is_exact():
    """Accept frequency p(x), recovered token ~ p without x, emitted token ~ p (GoF, 20k
    fused draws). The CPU twin is the pathwise test below plus the reference's own GoF."""
    semantics.check_probabilistic_acceptance(num_samples=20_000, seed=1, verify=kernel_verify)


def test_probabilistic_acceptance_pathwise_equals_reference():
    """The setup of the GoF test, on fewer rows: every row (accepted or recovered) is the
    reference's, whose distribution `test_reference` checks with 20k draws."""
    g = torch.Generator().manual_seed(1)
    vocab_size, dim, num_samples = 30, 16, 96
    weight = torch.randn(vocab_size, dim, generator=g)
    hidden = (torch.randn(1, 2, dim, generator=g) * 0.6).expand(num_samples, -1, -1).contiguous()
    params = SamplingParams.create(num_samples, temperature=0.8, top_k=15, seed=77)
    probs = semantics.exact_probs(hidden[:1, 0], weight, params.select(torch.tensor([0])))[0]
    drafts = torch.full((num_samples, 1), int(probs.argsort(descending=True)[1]))
    positions = torch.arange(num_samples) * 2
    config = kernels.TileConfig(block_v=32, block_r=128, block_d=16, candidates=16)
    ours = kernel_verify(hidden, weight, drafts, params, positions, config=config,
                         acceptance="probabilistic")
    theirs = reference_verify(hidden, weight, drafts, params, positions,
                              acceptance="probabilistic")
    assert_same_verify(ours, theirs, hidden, weight, params, positions)
    accepted = int((ours.num_accepted == 1).sum())
    assert 0 < accepted < num_samples  # both branches are exercised


def test_greedy_rows_accept_while_draft_is_argmax():
    g, weight, hidden, params, positions = semantics._verify_setup(seed=5)
    greedy = SamplingParams.create(hidden.shape[0], do_sample=False, seed=0)
    argmax = reference.compute_logits(hidden, weight).argmax(-1)
    drafts = argmax[:, :-1].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % weight.shape[0]
    for acceptance in ("strict", "probabilistic"):
        out = kernel_verify(hidden, weight, drafts, greedy, positions, acceptance=acceptance)
        assert out.num_accepted.tolist() == [4, 2, 4, 4, 4, 4]
        assert out.tokens[1].tolist() == argmax[1, :3].tolist() + [-1, -1]
        assert torch.equal(out.tokens[0], argmax[0])
        assert out.accept_probs[1].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_saturated_truncation_is_completed_exactly():
    """The 20 best tokens share one vocab tile: more than its candidate budget, so each
    batch row goes through the exact path, and the result is the reference's."""
    g = torch.Generator().manual_seed(5)
    vocab_size, dim, batch, num_drafts = 300, 32, 2, 2
    flat_hidden, weight, _ = random_problem(g, batch * (num_drafts + 1), vocab_size, dim, scale=0.1)
    direction = torch.randn(dim, generator=g).to(weight.device)
    weight[64:84] += direction * 4.0 / direction.norm()
    flat_hidden[:] += direction * 2.0 / direction.norm()
    hidden, weight = flat_hidden.view(batch, num_drafts + 1, dim).cpu(), weight.cpu()
    params = SamplingParams.create(batch, temperature=0.7, top_k=[20, 0], top_p=[1.0, 0.9], seed=1)
    positions = torch.tensor([5, 50])
    drafts = torch.tensor([[70, 71], [1, 72]])
    kernels.reset_stats()
    ours = kernel_verify(hidden, weight, drafts, params, positions)
    assert kernels.stats().rows_completed == batch
    theirs = reference_verify(hidden, weight, drafts, params, positions)
    for ours_t, theirs_t in zip(ours, theirs):
        assert torch.allclose(ours_t.double(), theirs_t.double(), atol=1e-5)
    unchecked = kernel_verify(hidden, weight, drafts, params, positions, check=False)
    assert unchecked.status.tolist() == [NEEDS_COMPLETION] * 2 and (unchecked.tokens == -1).all()


def test_non_finite_rows_are_reported():
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(40, 8, generator=g), torch.randn(3, 3, 8, generator=g)
    hidden[1, 2, 0] = float("inf")  # the bonus position only
    params, positions = SamplingParams.create(3, seed=0), torch.zeros(3, dtype=torch.long)
    drafts = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1\]"):
        kernel_verify(hidden, weight, drafts, params, positions)
    out = kernel_verify(hidden, weight, drafts, params, positions, check=False)
    assert out.num_accepted[1] == -1 and (out.tokens[1] == -1).all()
    assert out.status.tolist() == [0, NON_FINITE, 0]
    assert (out.num_accepted[[0, 2]] >= 0).all() and (out.tokens[[0, 2], 0] >= 0).all()
    # Row 1 with no drafts emits position 0 only: the inf after it is never used.
    padded = drafts.clone()
    padded[1] = -1
    out = kernel_verify(hidden, weight, padded, params, positions)
    clean = hidden.clone()
    clean[1, 2, 0] = 0.0
    assert torch.equal(out.tokens, kernel_verify(clean, weight, padded, params, positions).tokens)


def test_bad_verify_inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 4, 8, generator=g).to(DEVICE)
    weight = torch.randn(10, 8, generator=g).to(DEVICE)
    params = SamplingParams.create(2, seed=0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    drafts = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    verify = fused_verify
    with pytest.raises(ValueError, match=r"`draft_tokens` must have shape \[B, G\] = \[2, 3\]"):
        verify(hidden, weight, drafts[:, :2], params, positions)
    with pytest.raises(ValueError, match=r"token ids in \[0, 10\) or -1.*\[10, 10\]"):
        verify(hidden, weight, drafts + 10, params, positions)
    with pytest.raises(ValueError, match="`acceptance`='lenient'"):
        verify(hidden, weight, drafts, params, positions, acceptance="lenient")
    with pytest.raises(ValueError, match=r"`hidden` must have shape \[B, G\+1, D\]"):
        verify(hidden[:, 0], weight, drafts, params, positions)
    with pytest.raises(ValueError, match="`draft_tokens` must be an int64"):
        verify(hidden, weight, drafts.int(), params, positions, check=False)
    with pytest.raises(ValueError, match=r"`positions` must lie in \[0"):
        verify(hidden, weight, drafts, params, positions + rng.MAX_POSITION)


# ---------------------------------------------------------------------------------------
# GPU: full-size head.


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(temperature=0.6, top_k=20, top_p=0.95),
                                      dict(do_sample=False)])
@pytest.mark.parametrize("batch, warp_specialized", [
    (8, False), (16, False),  # 48 rows; 96 (verification's 64-row tiles)
    (16, True), (48, True)])  # 96 and 288 rows through the Gluon stage 1 (Hopper)
def test_full_size_verify_invariance_on_gpu(sampling, batch, warp_specialized):
    """D=4096, V=151,936, bf16: emitted tokens equal plain fused sampling at each position
    (speculation invariance within the fused path) for right, wrong and padded drafts."""
    g = torch.Generator().manual_seed(0)
    num_drafts, dim, vocab_size = 5, 4096, 151_936
    weight = (torch.randn(vocab_size, dim, generator=g) / dim**0.5).to("cuda", torch.bfloat16)
    hidden = (torch.randn(batch, num_drafts + 1, dim, generator=g) * 2).to("cuda", torch.bfloat16)
    params = SamplingParams.create(batch, seed=3, device="cuda", **sampling)
    positions = torch.arange(batch, device="cuda") * 100
    # One tile configuration for both: the same instructions sum each logit, so the
    # comparison is exact (across configurations bf16 sums may differ in the last bit).
    if warp_specialized and not kernels.lm_head_ws.supported(hidden, weight):
        pytest.skip("the warp-specialized stage 1 needs a Hopper GPU")
    config = kernels.default_config(batch * (num_drafts + 1), 2, params.any_truncation,
                                    verification=True, warp_specialized=warp_specialized)
    plain = torch.stack([fused_tokens(hidden[:, j].contiguous(), weight, params, positions + j,
                                      config=config)
                         for j in range(num_drafts + 1)], dim=1)
    right = plain[:, :-1]
    for drafts in (right, (right + 1) % vocab_size, torch.where(right % 2 == 0, right, -1)):
        out = fused_verify(hidden, weight, drafts, params, positions, config=config)
        matches = ((drafts == plain[:, :-1]) & (drafts >= 0)).long().cumprod(dim=1).sum(dim=1)
        assert torch.equal(out.num_accepted, matches)
        for b in range(batch):
            n = int(matches[b])
            assert out.tokens[b, : n + 1].tolist() == plain[b, : n + 1].tolist()
            assert (out.tokens[b, n + 1:] == -1).all()


def test_automatic_backend():
    """`flashspec.sampling.verify`'s default backend: the reference for CPU tensors, the
    kernels for CUDA ones; the same results either way."""
    g, weight, hidden, params, positions = semantics._verify_setup(seed=6)
    drafts = torch.randint(0, weight.shape[0], (hidden.shape[0], hidden.shape[1] - 1), generator=g)
    on_cpu = sampling.verify(hidden, weight, drafts, params, positions)
    theirs = reference_verify(hidden, weight, drafts, params, positions)
    assert all(torch.equal(a, b) for a, b in zip(on_cpu, theirs))
    if DEVICE == "cuda":
        fused = sampling.verify(hidden.cuda(), weight.cuda(), drafts.cuda(), params.to("cuda"),
                                positions.cuda())
        assert_same_verify(VerifyOutput(*(t.cpu() for t in fused)), theirs, hidden, weight,
                           params, positions)
