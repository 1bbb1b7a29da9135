"""The warp-specialized stage 1 (`flashspec/kernels/lm_head_ws.py`, Gluon, Hopper only).

Its epilogue is the Triton kernel's own code (`epilogue._screen`, `_exact_best`,
`_tile_summary`, `_store_summary`, `noise.philox_tile_bits`), which the interpreter runs on
the CPU in test_kernels.py, test_verify_kernel.py and test_screen.py: that is this kernel's
CPU twin. What only a Hopper GPU can check is the pipeline around that code (TMA ring,
wgmma, the hand-over of each tile through shared memory, persistent tiles, ragged edges): the
GPU tests below compare every output with the Triton kernel's (whose epilogue runs without
the noise screen: the same results bit for bit) and the tokens with the float64 reference.
"""

import pytest
import torch

from flashspec import SamplingParams, kernels
from flashspec import params as params_module
from flashspec.kernels import lm_head_ws

from test_kernels import assert_same_tokens, fused_tokens
from test_reference import reference_tokens

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel needs a Hopper GPU")
WS = kernels.default_config(256, warp_specialized=True)  # 4 epilogue warps, screen, race
WS64_EXACT = kernels.default_config(128, warp_specialized=True)  # 64-row tiles, exact
WS8 = kernels.default_config(512, warp_specialized=True)  # 8 epilogue warps, noise screen
WS_TRUNCATION = kernels.default_config(256, truncation=True, warp_specialized=True)  # 8, exact
WS64_TRUNCATION = kernels.default_config(64, truncation=True, warp_specialized=True)  # 64 rows
# 64-row tiles, 8 stages: few rows (a tile's rows past R are zero rows, its chunks skipped).
WS64 = kernels.TileConfig(block_v=128, block_r=64, block_d=64, num_warps=4, num_stages=8,
                          warp_specialized=True, screen=True)
# The Triton kernel with the same tiles and 64-deep steps: the same wgmma instructions sum
# each logit in the same order, so the tokens must be equal; the sums behind log-sum-exp and
# logprobs run in another order (the Triton kernel's two epilogue parts), equal to rounding.
TRITON = kernels.TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8, num_stages=3,
                            epilogue_parts=2)


def assert_rounding_close(ours, theirs):
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-5), (ours - theirs).abs().max()


def test_default_table_takes_it_only_where_it_runs():
    assert kernels.default_config(65, warp_specialized=True) == WS64_EXACT
    assert kernels.default_config(128, verification=True, warp_specialized=True) == WS64_EXACT
    assert (WS64_EXACT.block_r, WS64_EXACT.num_warps, WS64_EXACT.screen) == (64, 4, False)
    assert kernels.default_config(129, warp_specialized=True) == WS
    assert kernels.default_config(256, verification=True, warp_specialized=True) == WS
    assert WS.warp_specialized and WS.num_warps == 4 and WS8.num_warps == 8
    assert WS.screen and WS8.screen and not WS_TRUNCATION.screen
    assert WS.race and not (WS8.race or WS64_EXACT.race or WS_TRUNCATION.race)
    assert kernels.default_config(512, verification=True, warp_specialized=True) == WS8
    assert kernels.default_config(129, truncation=True, warp_specialized=True) == WS_TRUNCATION
    assert kernels.default_config(33, truncation=True, warp_specialized=True) == WS64_TRUNCATION
    assert kernels.default_config(128, truncation=True, warp_specialized=True) == WS64_TRUNCATION
    assert not kernels.default_config(32, truncation=True, warp_specialized=True).warp_specialized
    assert WS_TRUNCATION.num_warps == WS64_TRUNCATION.num_warps == 8
    assert (WS64_TRUNCATION.block_r, WS64_TRUNCATION.num_stages) == (64, 8)
    # Truncation keeps the candidate budget per token of the table's 128-wide tiles below.
    small = kernels.default_config(64, truncation=True)
    assert (WS_TRUNCATION.block_v, WS_TRUNCATION.candidates) == (small.block_v, small.candidates) \
        == (WS64_TRUNCATION.block_v, WS64_TRUNCATION.candidates) == (128, 8)
    assert not kernels.default_config(64, warp_specialized=True).warp_specialized
    assert not kernels.default_config(256).warp_specialized


def test_unsupported_tensors_are_refused_an_explicit_config():
    """CPU tensors and fp32 operands are not the Gluon kernel's; an explicit config that asks
    for it is refused by name (fp32 on the device the other kernels run on here: the
    interpreter on CPU, CUDA on a GPU)."""
    assert not lm_head_ws.supported(torch.randn(4, 64, dtype=torch.bfloat16),
                                    torch.randn(100, 64, dtype=torch.bfloat16))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight = torch.randn(4, 64, device=device), torch.randn(100, 64, device=device)
    assert not lm_head_ws.supported(hidden, weight)
    with pytest.raises(ValueError, match="warp_specialized=True\\) needs CUDA tensors on a Hopper"):
        kernels.fused_argmax(hidden, weight, config=WS)


@pytest.mark.parametrize("fields, match", [
    (dict(block_r=32), "block_r a multiple of 64"),
    (dict(block_r=128, block_v=256), "block_r \\* block_v <= 16384"),
    (dict(num_warps=2), "num_warps in \\(4, 8\\)"),
    (dict(epilogue_parts=2), "epilogue_parts=1"),
    (dict(num_stages=1), "num_stages >= 2"),  # one stage would deadlock the pipeline
])
def test_config_limits_are_named(fields, match):
    base = dict(block_v=128, block_r=128, block_d=64, num_warps=4, num_stages=4,
                warp_specialized=True)
    with pytest.raises(ValueError, match=match):
        kernels.TileConfig(**(base | fields))


def _problem(rows, vocab, dim, seed, truncation=False):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, dim, generator=g) / dim**0.5).to("cuda", torch.bfloat16)
    hidden = (torch.randn(rows, dim, generator=g) * 3).to("cuda", torch.bfloat16)
    # Greedy and sampled rows, several temperatures; with `truncation`, every truncation mode.
    pick = torch.randint(0, 4, (rows,), generator=g)
    cut = lambda options: [options[int(i)] for i in torch.randint(len(options), (rows,), generator=g)]  # noqa
    truncated = dict(top_k=cut([0, 20, 50, 5]), top_p=cut([1.0, 0.95, 0.9]),
                     min_p=cut([0.0, 0.0, 0.05])) if truncation else {}
    params = SamplingParams.create(
        rows, do_sample=(pick != 0).tolist(), temperature=[(0.6, 0.7, 1.0, 1.5)[int(i)] for i in pick],
        seed=seed, device="cuda", **truncated)
    positions = torch.randint(0, 10_000, (rows,), generator=g).cuda()
    return hidden, weight, params, positions


# Rows past one tile and ragged ones, fewer rows than a tile (zero rows up to it), vocabularies
# that do not fill the last tile, a hidden size that does not fill the last 64-deep step
# (zero-filled by TMA).
SHAPES = [(65, 151_936, 4096), (256, 151_936, 4096), (200, 32_003, 520), (130, 1_000, 64),
          (1, 151_936, 4096), (17, 32_003, 520)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows, vocab, dim", SHAPES)
@pytest.mark.parametrize("config", [WS, WS8, WS64, WS64_EXACT],
                         ids=["4 epilogue warps", "8 epilogue warps", "64-row tiles",
                              "64-row tiles, exact"])
def test_sample_and_argmax_equal_the_triton_kernel(rows, vocab, dim, config):
    hidden, weight, params, positions = _problem(rows, vocab, dim, rows + vocab)
    ws = kernels.fused_sample(hidden, weight, params, positions, config=config)
    tr = kernels.fused_sample(hidden, weight, params, positions, config=TRITON)
    assert (ws.status == 0).all() and (tr.status == 0).all()
    assert torch.equal(ws.tokens, tr.tokens)
    assert_rounding_close(ws.lse, tr.lse)
    assert_rounding_close(ws.logprobs, tr.logprobs)
    theirs = reference_tokens(hidden, weight, params, positions)
    assert_same_tokens(ws.tokens, theirs, hidden, weight, params, positions, f"R={rows}")
    greedy = kernels.fused_argmax(hidden, weight, config=config)
    assert torch.equal(greedy.tokens, kernels.fused_argmax(hidden, weight, config=TRITON).tokens)


def _verify_like_triton(hidden, weight, draft_tokens, params, positions, config):
    """Verification under `config` equals the Triton kernel's with the same tiles, first with
    `draft_tokens`, then with each row's first draft replaced by the target's own sample
    (accepted, so the next position is judged too); returns the second output."""
    for _ in range(2):
        ws = kernels.fused_verify(hidden, weight, draft_tokens, params, positions, config=config)
        tr = kernels.fused_verify(hidden, weight, draft_tokens, params, positions, config=TRITON)
        for name in ("num_accepted", "tokens", "status"):
            assert torch.equal(getattr(ws, name), getattr(tr, name)), name
        assert_rounding_close(ws.accept_probs, tr.accept_probs)
        assert_rounding_close(ws.logprobs, tr.logprobs)
        # Rows flagged for exact completion hold -1: they keep their draft.
        draft_tokens[:, 0] = torch.where(tr.tokens[:, 0] >= 0, tr.tokens[:, 0], draft_tokens[:, 0])
    return ws


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("batch, drafts, vocab, dim", [(16, 5, 151_936, 4096), (64, 3, 32_003, 520),
                                                      (3, 2, 32_003, 520)])
@pytest.mark.parametrize("config", [WS, WS8, WS64, WS64_EXACT],
                         ids=["4 epilogue warps", "8 epilogue warps", "64-row tiles",
                              "64-row tiles, exact"])
def test_verification_equals_the_triton_kernel(batch, drafts, vocab, dim, config):
    rows = batch * (drafts + 1)
    hidden, weight, _, _ = _problem(rows, vocab, dim, rows)
    params = SamplingParams.create(batch, temperature=0.7, seed=1, device="cuda")
    positions = torch.arange(batch, device="cuda") * 7
    g = torch.Generator().manual_seed(2)
    draft_tokens = torch.randint(0, vocab, (batch, drafts), generator=g).cuda()
    draft_tokens[::3, drafts // 2:] = -1  # padded drafts
    ws = _verify_like_triton(hidden.view(batch, drafts + 1, dim), weight, draft_tokens, params,
                             positions, config)
    assert (ws.num_accepted >= 1).all()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows, vocab, dim, config", [
    (256, 151_936, 4096, WS_TRUNCATION), (200, 32_003, 520, WS_TRUNCATION),
    (200, 32_003, 520, WS8), (64, 151_936, 4096, WS64_TRUNCATION), (40, 32_003, 520, WS64_TRUNCATION)],
    ids=["exact epilogue", "exact, ragged", "screen, ragged", "64-row tiles", "64-row tiles, ragged"])
def test_truncated_sampling_equals_the_triton_kernel(rows, vocab, dim, config):
    """Interleaved tiles loaded as 16-row boxes and their candidates: the same tiles in the
    Triton kernel give the same candidates, hence the same tokens and the same rows flagged
    for exact completion; the checked call (which completes them) agrees with the float64
    reference."""
    hidden, weight, params, positions = _problem(rows, vocab, dim, rows + 1, truncation=True)
    ws = kernels.fused_sample(hidden, weight, params, positions, config=config)
    tr = kernels.fused_sample(hidden, weight, params, positions, config=TRITON)
    assert torch.equal(ws.status, tr.status) and torch.equal(ws.tokens, tr.tokens)
    assert_rounding_close(ws.lse, tr.lse)
    assert_rounding_close(ws.logprobs, tr.logprobs)
    ours = fused_tokens(hidden, weight, params, positions)  # default: Gluon, completed
    theirs = reference_tokens(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions, f"R={rows} truncated")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("batch, config", [(64, WS_TRUNCATION), (16, WS64_TRUNCATION)],
                         ids=["128-row tiles", "64-row tiles"])
def test_truncated_verification_equals_the_triton_kernel(batch, config):
    drafts, vocab, dim = 3, 151_936, 4096
    hidden, weight, _, _ = _problem(batch * (drafts + 1), vocab, dim, 5)
    params = SamplingParams.create(batch, temperature=0.6, top_k=20, top_p=0.95, seed=4,
                                   device="cuda")
    positions = torch.arange(batch, device="cuda") * 3
    draft_tokens = torch.randint(0, vocab, (batch, drafts),
                                 generator=torch.Generator().manual_seed(6)).cuda()
    ws = _verify_like_triton(hidden.view(batch, drafts + 1, dim), weight, draft_tokens, params,
                             positions, config)
    assert (ws.num_accepted[ws.status == 0] >= 1).all() and (ws.status == 0).sum() > batch // 2


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", [WS_TRUNCATION, WS64_TRUNCATION],
                         ids=["128-row tiles", "64-row tiles"])
def test_truncated_rows_without_stage_one_noise_equal_the_triton_kernel(config):
    """Greedy rows beside rows truncated by a top-p alone or a min-p alone: stage 1 draws no
    noise but keeps the log-sum-exp, and leaves out the greedy rows' drafts (the variants
    tests/test_kernels.py and tests/test_verify_kernel.py check through the interpreter).
    Sampling and verification equal the Triton kernel's, sampling the reference's. Top-p 0.5
    at T 0.8 keeps 26 tokens at the median here (0.9 kept ~1,200, past the 64 candidates, and
    sent every top-p row to completion), so most rows are decided by the fused kernels."""
    batch, drafts, vocab, dim = 24, 3, 151_936, 4096
    rows = batch * (drafts + 1)
    hidden, weight, _, _ = _problem(rows, vocab, dim, 8)
    # Alternating by batch row, so that verification's rows (every drafts + 1-th) hold both.
    top_p_rows = torch.arange(rows) // (drafts + 1) % 2 == 1
    sampled = torch.arange(rows) % 3 != 0
    params = SamplingParams.create(
        rows, do_sample=sampled.tolist(), temperature=0.8,
        top_p=torch.where(top_p_rows, 0.5, 1.0).tolist(),
        min_p=torch.where(top_p_rows, 0.0, 0.05).tolist(), seed=2, device="cuda")
    assert params.sampled_rows_truncated(vocab) and params.any_greedy
    positions = torch.arange(rows, device="cuda") * 5
    ws = kernels.fused_sample(hidden, weight, params, positions, config=config)
    tr = kernels.fused_sample(hidden, weight, params, positions, config=TRITON)
    assert torch.equal(ws.status, tr.status) and torch.equal(ws.tokens, tr.tokens)
    assert (ws.status[(top_p_rows & sampled).cuda()] == 0).float().mean() > 0.5
    assert_rounding_close(ws.lse, tr.lse)
    assert_rounding_close(ws.logprobs, tr.logprobs)
    ours = fused_tokens(hidden, weight, params, positions)
    theirs = reference_tokens(hidden, weight, params, positions)
    assert_same_tokens(ours, theirs, hidden, weight, params, positions, "top-p / min-p rows")
    verify_params = params.select(torch.arange(0, rows, drafts + 1, device="cuda"))
    draft_tokens = torch.randint(0, vocab, (batch, drafts),
                                 generator=torch.Generator().manual_seed(3)).cuda()
    ws = _verify_like_triton(hidden.view(batch, drafts + 1, dim), weight, draft_tokens,
                             verify_params, positions[::drafts + 1], config)
    assert (ws.status == 0).sum() > batch // 2


def _edits(rows: int, vocab: int, seed: int):
    """Random codes: a context of 4,096 penalized tokens and 64 banned ones per row, penalty
    1.05 to 1.5, as a Qwen2.5-style call with bad words would have."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.zeros(rows, vocab, dtype=torch.uint8)
    for r in range(rows):
        order = torch.randperm(vocab, generator=g)
        codes[r, order[:min(4096, vocab // 2)]] = params_module.PENALIZE
        codes[r, order[-64:]] = params_module.BAN
    penalty = 1.05 + 0.45 * torch.rand(rows, generator=g, dtype=torch.float64)
    return params_module.LogitEdits(codes.cuda(), penalty.cuda())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows, vocab, dim", [(256, 151_936, 4096), (200, 32_003, 520)])
@pytest.mark.parametrize("config", [WS, WS8, WS64_EXACT, WS_TRUNCATION],
                         ids=["4 epilogue warps", "8 epilogue warps", "64-row tiles, exact",
                              "truncation"])
def test_logit_edits_equal_the_triton_kernel(rows, vocab, dim, config):
    """The codes of `flashspec.params.LogitEdits` in the Gluon epilogue: sampling (T 0.7, and
    top-k 20 + top-p 0.8 under the truncation tiles) and argmax with edits equal the Triton
    kernel's with the same edits, and the edits change tokens (the test has teeth)."""
    hidden, weight, params, positions = _problem(rows, vocab, dim, rows + 7,
                                                 truncation=config is WS_TRUNCATION)
    edits = _edits(rows, vocab, rows)
    ws = kernels.fused_sample(hidden, weight, params, positions, edits=edits, config=config)
    tr = kernels.fused_sample(hidden, weight, params, positions, edits=edits, config=TRITON)
    assert torch.equal(ws.status, tr.status) and torch.equal(ws.tokens, tr.tokens)
    assert_rounding_close(ws.lse, tr.lse)
    plain = kernels.fused_sample(hidden, weight, params, positions, config=config)
    assert not torch.equal(plain.tokens, ws.tokens)
    banned = edits.codes.gather(1, ws.tokens.clamp(min=0)[:, None])[:, 0]
    assert not (banned == params_module.BAN).any()
    greedy = kernels.fused_argmax(hidden, weight, edits=edits, config=config)
    assert torch.equal(greedy.tokens,
                       kernels.fused_argmax(hidden, weight, edits=edits, config=TRITON).tokens)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("config", [WS, WS64_EXACT], ids=["128-row tiles", "64-row tiles"])
def test_verification_with_logit_edits_equals_the_triton_kernel(config):
    batch, drafts, vocab, dim = 32, 4, 151_936, 4096
    hidden, weight, _, _ = _problem(batch * (drafts + 1), vocab, dim, 11)
    params = SamplingParams.create(batch, temperature=0.7, seed=3, device="cuda")
    positions = torch.arange(batch, device="cuda") * 5
    draft_tokens = torch.randint(0, vocab, (batch, drafts),
                                 generator=torch.Generator().manual_seed(8)).cuda()
    flat = _edits(batch * (drafts + 1), vocab, 9)
    edits = params_module.LogitEdits(flat.codes.view(batch, drafts + 1, vocab), flat.penalty[:batch])
    ws = kernels.fused_verify(hidden.view(batch, drafts + 1, dim), weight, draft_tokens, params,
                              positions, edits=edits, config=config)
    tr = kernels.fused_verify(hidden.view(batch, drafts + 1, dim), weight, draft_tokens, params,
                              positions, edits=edits, config=TRITON)
    for name in ("num_accepted", "tokens", "status"):
        assert torch.equal(getattr(ws, name), getattr(tr, name)), name
    assert_rounding_close(ws.logprobs, tr.logprobs)
