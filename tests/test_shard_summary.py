"""The fused summaries of a vocabulary shard (`kernels.fused_shard_summaries`) against the
torch summary of the shard's materialized logits (`flashspec.parallel.shard.summarize`).

Hidden states, weights, the head's bias and the edits hold small integers (penalties and
temperatures powers of two), so every logit and transformed logit is exact in float32
whatever the tiles: the fields must be equal, but for the Gumbel noise (float32 `log`,
within 2e-6 of torch's: tests/test_rng.py), the log-sum-exp (float32 sums) and the softcap
(`tanh`). Shards start at global id 0, 32 (a multiple of 16: the noise by groups of 16) and
37 (each column's noise on its own). The keys are checked against the definition of the
floor and, where every tile is merged, against the tiles' candidates merged.
"""

import pytest
import torch
import triton

from flashspec import SamplingParams, kernels, rng
from flashspec.parallel import VocabShards, merge, shard, summary
from flashspec.parallel.acceptance import flat_drafts
from flashspec.params import BAN, KEEP, PENALIZE, LogitEdits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, DIM, BATCH = 96, 16, 3
# 16-token tiles: a shard spans several, with 4 candidates each.
CONFIG = kernels.TileConfig(block_v=16, block_r=16, block_d=16, candidates=4, max_support=16)
SHARDS = {"whole": VocabShards((VOCAB,), 0), "aligned": VocabShards((32, 64), 1),
          "unaligned": VocabShards((37, 59), 1)}
MODES = {
    "greedy": dict(do_sample=False),
    "temperature": dict(temperature=[0.5, 1.0, 2.0]),
    "top_k": dict(temperature=0.5, top_k=[1, 5, 3]),
    "top_p": dict(temperature=[1.0, 0.5, 2.0], top_p=[0.5, 0.9, 0.8]),
    "min_p": dict(temperature=[1.0, 2.0, 0.25], min_p=[0.05, 0.2, 0.1]),
    "mixed": dict(do_sample=[False, True, True], temperature=[1.0, 0.5, 2.0], top_k=[0, 0, 6],
                  top_p=[1.0, 1.0, 0.9]),
}


def problem(seed: int, *batch_shape):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-2, 3, (VOCAB, DIM), generator=g).float()
    hidden = torch.randint(-1, 2, (*batch_shape, DIM), generator=g).float()
    positions = torch.randint(0, 1000, batch_shape[:1], generator=g)
    return hidden.to(DEVICE), weight.to(DEVICE), positions.to(DEVICE), g


def whole_edits(g, batch_shape) -> LogitEdits:
    """Bans, repetition penalties, a bias and counts over the whole vocabulary."""
    draw = torch.randint(0, 8, (*batch_shape, VOCAB), generator=g)
    codes = torch.where(draw == 0, BAN, torch.where(draw == 1, PENALIZE, KEEP))
    batch = batch_shape[0]
    return LogitEdits(codes.to(torch.uint8), torch.full((batch,), 2.0, dtype=torch.float64),
                      torch.randint(-2, 3, (batch, VOCAB), generator=g).float(),
                      torch.randint(0, 3, (batch, VOCAB), generator=g).int(),
                      torch.full((batch,), 0.5, dtype=torch.float64),
                      torch.full((batch,), 0.25, dtype=torch.float64)).to(DEVICE)


def fused(shards, hidden, weight, layout, params, positions, config=CONFIG, **kwargs):
    return kernels.fused_shard_summaries(hidden, shards.local(weight), layout, params, positions,
                                         shards.offset, shards.vocab_size, config=config,
                                         **kwargs)


def check_fields(ours, theirs, layout, params, exact=True):
    """The fields the merge reads equal: all of them in the rows the race decides (finite
    rows that the candidates do not decide), their sampled rows' BEST to the noise's
    rounding, and every LSE (NaN where not finite) to float32 rounding; argmax's BEST also
    where not finite (NaN). Not `exact` (the softcap), the floats to float32 rounding."""
    ours, theirs = summary.unpack(ours[None], layout), summary.unpack(theirs[None], layout)
    finite = ~(theirs.best if theirs.lse is None else theirs.lse)[0].isnan()
    raced, noisy, plain = finite, torch.zeros_like(finite), torch.ones_like(finite)
    if params is not None:
        raced = finite & ~summary.truncated_rows(params, VOCAB)
        noisy = raced & ~params.is_greedy
        plain = raced & ~noisy
    assert torch.equal(ours.token[0][raced], theirs.token[0][raced])
    close = dict(rtol=1e-6, atol=2e-6)
    same = dict(rtol=0, atol=0) if exact else close
    torch.testing.assert_close(ours.best[0][noisy], theirs.best[0][noisy], **close)
    torch.testing.assert_close(ours.best[0][plain], theirs.best[0][plain], equal_nan=True,
                               **same)
    for name in ("score", "draft"):
        a, b = getattr(ours, name), getattr(theirs, name)
        if a is not None:
            torch.testing.assert_close(a[0][raced], b[0][raced], **same)
    if ours.lse is not None:
        torch.testing.assert_close(ours.lse, theirs.lse, rtol=1e-6, atol=1e-5, equal_nan=True)
    return ours


def expected_keys(keys: torch.Tensor, shard_size: int, num_candidates: int, config):
    """The keys and floor of a row whose shard keys are `keys` ``[V_r]``, where every tile
    is merged: each interleaved tile's top `config.candidates` (`rows._column_tokens`), the
    top ones of them all as many as the launcher merges; the floor the largest of the last
    candidates of tiles with more tokens, and the last key written. None where some tile is
    left out."""
    cand, num_vt = config.candidates, triton.cdiv(shard_size, config.block_v)
    wanted = min(config.max_support, triton.next_power_of_2(num_candidates))
    top_tiles = min(wanted, triton.next_power_of_2(num_vt))
    if top_tiles < num_vt:
        return None
    written = min(num_candidates, wanted, top_tiles * cand)
    tile = (torch.arange(shard_size, device=keys.device) // 16) % num_vt
    pad = torch.tensor([summary.PAD_KEY], device=keys.device)
    merged, lasts = [], [pad]
    for t in range(num_vt):
        held = keys[tile == t].sort(descending=True).values
        merged.append(held[:cand])
        if len(held) > cand:
            lasts.append(held[cand - 1:cand])
    merged = torch.cat(merged).sort(descending=True).values[:written]
    merged = torch.cat([merged, pad.expand(num_candidates - len(merged))])
    return merged, torch.cat(lasts + [merged[written - 1:written]]).max()


def check_keys(ours: summary.Unpacked, logits: torch.Tensor, offset: int, config=CONFIG):
    """Per row: the keys listed are the shard's own, largest first, then `PAD_KEY`; every
    token not listed has a key below the floor, which is `PAD_KEY` only where all are
    listed; where every tile is merged, list and floor are exactly the expected ones. Rows
    with a non-finite logit (whose keys the merge never reads) are left out."""
    num_rows, shard_size = logits.shape
    ids = offset + torch.arange(shard_size, device=logits.device)
    shard_keys = summary.pack_candidates(logits + 0.0, ids.expand(num_rows, -1))
    for row in logits.isfinite().all(dim=1).nonzero().flatten().tolist():
        keys, floor = ours.keys[0, row], ours.floor[0, row]
        listed = keys[keys != summary.PAD_KEY]
        assert (keys[len(listed):] == summary.PAD_KEY).all()
        columns = summary.unpack_candidates(listed)[1] - offset
        assert ((columns >= 0) & (columns < shard_size)).all()
        assert torch.equal(listed, shard_keys[row, columns])
        assert (listed[1:] < listed[:-1]).all()
        missing = torch.ones(shard_size, dtype=torch.bool, device=logits.device)
        missing[columns] = False
        assert (shard_keys[row, missing] < floor).all()
        assert floor != summary.PAD_KEY or len(listed) == shard_size
        expected = expected_keys(shard_keys[row], shard_size, keys.numel(), config)
        if expected is not None:
            assert torch.equal(keys, expected[0]) and floor == expected[1], (row, keys, floor)


@pytest.mark.parametrize("where", list(SHARDS))
def test_argmax(where):
    """Without and with edits and the head's bias; a non-finite row (BEST NaN)."""
    shards = SHARDS[where]
    hidden, weight, _, g = problem(1, BATCH)
    hidden[2, 3] = float("inf")  # a non-finite row
    layout = summary.summary_layout("argmax", shards)
    local = shards.local(weight)
    for edits, head in [(None, {}), (whole_edits(g, (BATCH,)),
                                     dict(bias=torch.randint(-2, 3, (VOCAB,), generator=g)
                                          .float().to(DEVICE)))]:
        edits = shards.local_edits(edits)
        head = {name: shards.local(value) for name, value in head.items()}
        ours = fused(shards, hidden, weight, layout, None, None, edits=edits, **head)
        theirs = shard.summarize(shard.shard_logits(hidden, local, edits=edits, **head), layout,
                                 None, None, shards.offset, VOCAB)
        assert check_fields(ours, theirs, layout, None).best[0, 2].isnan()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("where", list(SHARDS))
def test_sample(mode, where):
    """Every sampling mode: the race's fields where rows are not truncated, the keys where
    some are."""
    shards = SHARDS[where]
    hidden, weight, positions, _ = problem(2, BATCH)
    params = SamplingParams.create(BATCH, seed=5, device=DEVICE, **MODES[mode])
    layout = summary.summary_layout("sample", shards, params, candidates=6)
    logits = shard.shard_logits(hidden, shards.local(weight))
    ours = fused(shards, hidden, weight, layout, params, positions)
    theirs = shard.summarize(logits, layout, params, positions, shards.offset, VOCAB)
    unpacked = check_fields(ours, theirs, layout, params)
    if layout.num_candidates:
        check_keys(unpacked, logits, shards.offset)


@pytest.mark.parametrize("where", list(SHARDS))
def test_sample_with_edits_and_head(where):
    """Edits (bans, penalties, a bias, counts) and the head's bias on mixed rows; then the
    head's softcap."""
    shards = SHARDS[where]
    hidden, weight, positions, g = problem(3, BATCH + 1)
    params = SamplingParams.create(BATCH + 1, seed=6, device=DEVICE,
                                   **{name: [*value, value[-1]]
                                      for name, value in MODES["mixed"].items()})
    layout = summary.summary_layout("sample", shards, params, candidates=6)
    edits = whole_edits(g, (BATCH + 1,))
    # A non-finite row whose log-sum-exp is finite: one logit -inf.
    edits.bias[-1, shards.offset + 1], edits.codes[-1, shards.offset + 1] = float("-inf"), KEEP
    edits = shards.local_edits(edits)
    bias = shards.local(torch.randint(-2, 3, (VOCAB,), generator=g).float().to(DEVICE))
    logits = shard.shard_logits(hidden, shards.local(weight), edits=edits, bias=bias)
    ours = fused(shards, hidden, weight, layout, params, positions, edits=edits, bias=bias)
    theirs = shard.summarize(logits, layout, params, positions, shards.offset, VOCAB)
    unpacked = check_fields(ours, theirs, layout, params)
    assert unpacked.lse[0, -1].isnan()
    check_keys(unpacked, logits, shards.offset)
    # The softcap's tanh rounds apart from torch's: the floats within float32 rounding.
    params = SamplingParams.create(BATCH + 1, seed=6, device=DEVICE,
                                   temperature=[0.5, 1.0, 2.0, 1.0])
    layout = summary.summary_layout("sample", shards, params)
    logits = shard.shard_logits(hidden, shards.local(weight), bias=bias, softcap=8.0)
    ours = fused(shards, hidden, weight, layout, params, positions, bias=bias, softcap=8.0)
    theirs = shard.summarize(logits, layout, params, positions, shards.offset, VOCAB)
    check_fields(ours, theirs, layout, params, exact=False)


VERIFIED = {"greedy+sampled": dict(do_sample=[False, True], temperature=[1.0, 0.5]),
            "greedy+truncated": dict(do_sample=[False, True], temperature=[1.0, 0.5],
                                     top_k=[0, 4]),
            # 70: between a shard's size and the vocabulary's, truncated
            "truncated": dict(temperature=[1.0, 0.5], top_k=[3, 70])}


@pytest.mark.parametrize("where", list(SHARDS))
@pytest.mark.parametrize("rows", list(VERIFIED))
@pytest.mark.parametrize("with_edits", [False, True])
def test_verify(where, rows, with_edits):
    """Drafts inside and outside the shard (and padding); with edits, counts that add the
    drafts this shard holds before each position. Where every row is sampled and truncated,
    stage 1 reads no draft logit: DRAFT is -inf (the candidates decide those rows)."""
    shards = SHARDS[where]
    hidden, weight, positions, g = problem(4, 2, 3)
    params = SamplingParams.create(2, seed=7, device=DEVICE, **VERIFIED[rows])
    # Position 1 of row 0 drafts the next shard's first token (the whole's: its first).
    next_first = (shards.offset + shards.size) % VOCAB
    drafts = torch.tensor([[shards.offset + 3, next_first], [shards.offset + 20, -1]],
                          device=DEVICE)
    layout = summary.summary_layout("verify", shards, params, candidates=6)
    edits = shards.local_edits(whole_edits(g, (2, 3)) if with_edits else None)
    flat_edits = None
    if with_edits:
        column = drafts - shards.offset
        flat_edits = edits.flat(torch.where((column >= 0) & (column < shards.size), column, -1))
    logits = shard.shard_logits(hidden.flatten(0, 1), shards.local(weight), edits=flat_edits)
    ours = fused(shards, hidden, weight, layout, params, positions, drafts=drafts, edits=edits)
    flat_params = params.repeat_interleave(3)
    flat_positions = (positions[:, None] + torch.arange(3, device=DEVICE)).flatten()
    theirs = shard.summarize(logits, layout, flat_params, flat_positions, shards.offset, VOCAB,
                             flat_drafts(drafts))
    unpacked = check_fields(ours, theirs, layout, flat_params)
    if rows == "truncated":
        assert (unpacked.draft == float("-inf")).all()
    else:
        assert unpacked.draft[0, 0] > float("-inf")
        assert (unpacked.draft[0, 1] == float("-inf")) == (shards.size < VOCAB)
    if layout.num_candidates:
        check_keys(unpacked, logits, shards.offset)


def test_candidates_beyond_the_merge_and_beyond_the_shard():
    """A budget above what the kernel merges (16 keys, then PAD), one of top-k + 1 (not a
    power of two), one that leaves tiles out of the merge, and one that holds the whole
    shard, under a config whose tiles keep every token (floor PAD)."""
    shards = SHARDS["unaligned"]
    hidden, weight, positions, _ = problem(5, BATCH)
    params = SamplingParams.create(BATCH, top_k=[2, 5, 40], seed=8, device=DEVICE)
    logits = shard.shard_logits(hidden, shards.local(weight))
    every_token = kernels.TileConfig(block_v=16, block_r=16, block_d=16, candidates=16,
                                     max_support=64)
    for candidates, config, listed in [(40, CONFIG, 16), (6, CONFIG, 6), (2, CONFIG, 2),
                                       (64, every_token, shards.size)]:
        layout = summary.SummaryLayout(summary.FIELDS["sample"], candidates)
        ours = fused(shards, hidden, weight, layout, params, positions, config=config)
        unpacked = summary.unpack(ours[None], layout)
        check_keys(unpacked, logits, shards.offset, config)
        assert (unpacked.keys[0] != summary.PAD_KEY).sum(dim=1).tolist() == [listed] * BATCH
        assert (unpacked.floor[0] == summary.PAD_KEY).all() == (listed == shards.size)


def given_logits(shards, logits: torch.Tensor):
    """hidden ``[R, D]`` and a weight whose shard's logits are exactly `logits` ``[R, V_r]``
    (row r of hidden is the r-th unit vector)."""
    num_rows = logits.shape[0]
    weight = torch.zeros(VOCAB, DIM)
    weight[shards.offset:shards.offset + shards.size, :num_rows] = logits.T
    return torch.eye(num_rows, DIM).to(DEVICE), weight.to(DEVICE)


def test_floor_covers_the_tiles_left_out():
    """Tiles are chosen for the merge by their largest logit's order key with its low bits
    replaced by the tile's index: a tile left out may hold a logit a few ulps above the
    chosen ones' (here tile 2's 1 + 2**-23 against tiles 0 and 1's 1.0, C = 2: two tiles of
    four merged). Its token is missing; the floor is above it."""
    shards = SHARDS["unaligned"]
    logits = torch.zeros(1, shards.size)
    logits[0, [5, 20]] = 1.0
    logits[0, 40] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    hidden, weight = given_logits(shards, logits)
    params = SamplingParams.create(1, top_k=1, seed=0, device=DEVICE)
    layout = summary.SummaryLayout(summary.FIELDS["sample"], 2)
    ours = fused(shards, hidden, weight, layout, params,
                 torch.zeros(1, dtype=torch.int64, device=DEVICE))
    unpacked = summary.unpack(ours[None], layout)
    assert (summary.unpack_candidates(unpacked.keys[0, 0])[1] - shards.offset).tolist() == [5, 20]
    check_keys(unpacked, logits.to(DEVICE), shards.offset)


def test_ties_go_to_the_lowest_global_id():
    """A greedy row's largest logit in two interleaved tiles (32 tokens: groups 0 and 2 in
    tile 0, 1 and 3 in tile 1): the lower id wins, in the later tile."""
    shards = SHARDS["unaligned"]
    logits = torch.zeros(2, shards.size)
    logits[:, [20, 40]] = 3.0
    hidden, weight = given_logits(shards, logits)
    params = SamplingParams.create(2, do_sample=[False, True], top_k=[0, 5], seed=0,
                                   device=DEVICE)
    layout = summary.summary_layout("sample", shards, params)
    config = kernels.TileConfig(block_v=32, block_r=16, block_d=16, candidates=4)
    ours = fused(shards, hidden, weight, layout, params,
                 torch.zeros(2, dtype=torch.int64, device=DEVICE), config=config)
    assert int(summary.unpack(ours[None], layout).token[0, 0]) == shards.offset + 20


SCREEN_AND_RACE = kernels.TileConfig(block_v=16, block_r=16, block_d=16, screen=True,
                                     race=True)


@pytest.mark.parametrize("config,non_finite", [(CONFIG, False), (SCREEN_AND_RACE, False),
                                               (SCREEN_AND_RACE, True)],
                         ids=["exact", "screen+race", "screen+non-finite"])
def test_noise_is_keyed_by_global_ids(config, non_finite):
    """Each shard's best is the Gumbel-max of its columns with `rng.gumbel` of their global
    ids; merged over the shards, the tokens are the unsharded fused kernel's. Every row is
    sampled: the race's paths run; a non-finite row sends its tiles through the screen's
    exact path instead (`epilogue._screen`)."""
    hidden, weight, positions, _ = problem(6, BATCH + 1)
    hidden *= 0.25  # logits within the noise's span: many columns compete
    if non_finite:
        hidden[-1, 0] = float("nan")
    params = SamplingParams.create(BATCH + 1, temperature=[1.0, 0.5, 1.0, 1.0], seed=9,
                                   device=DEVICE)
    words = []
    for rank in range(2):
        shards = VocabShards((37, 59), rank)
        layout = summary.summary_layout("sample", shards, params)
        words.append(fused(shards, hidden, weight, layout, params, positions, config=config))
        unpacked = summary.unpack(words[-1][None], layout)
        ids = shards.offset + torch.arange(shards.size, device=DEVICE)
        logits = shard.shard_logits(hidden, shards.local(weight))
        noise = rng.gumbel(params.seed[:, None], positions[:, None], ids, dtype=torch.float32)
        perturbed = logits / params.temperature.float()[:, None] + noise
        best, index = perturbed[:BATCH].max(dim=-1)
        torch.testing.assert_close(unpacked.best[0, :BATCH], best, rtol=1e-6, atol=2e-6)
        assert torch.equal(unpacked.token[0, :BATCH], ids[index])
    merged = merge.merge_rows(summary.unpack(torch.stack(words), layout), shards, params,
                              positions)
    whole = kernels.fused_sample(hidden, weight, params, positions, config=config)
    assert torch.equal(merged.tokens[:BATCH], whole.tokens[:BATCH])
    assert merged.finite.tolist() == [True] * BATCH + [not non_finite]
    torch.testing.assert_close(merged.lse, whole.lse, rtol=1e-6, atol=1e-5, equal_nan=True)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the warp-specialized kernel needs a Hopper GPU")
@pytest.mark.parametrize("top_k", [0, 20])
def test_warp_specialized_shard_equals_the_triton_kernel_gpu(top_k):
    """The Gluon stage 1 over a shard whose first id is a multiple of 16 writes the Triton
    kernel's words: the same tiles and 64-deep steps sum each logit in the same order, so
    every field but the log-sum-exp (its sums' order) is equal. A shard whose first id is
    not a multiple of 16 is refused it."""
    shards = VocabShards((4096, 8192), 1)
    g = torch.Generator().manual_seed(10)
    weight = (torch.randn(shards.vocab_size, 256, generator=g) / 16).to(DEVICE, torch.bfloat16)
    hidden = torch.randn(256, 256, generator=g).to(DEVICE, torch.bfloat16)
    params = SamplingParams.create(256, temperature=0.7, top_k=top_k, seed=3, device=DEVICE)
    positions = torch.arange(256, device=DEVICE)
    layout = summary.summary_layout("sample", shards, params)
    ws = kernels.default_config(256, truncation=top_k > 0, warp_specialized=True)
    same_tiles = kernels.TileConfig(block_v=128, block_r=128, block_d=64, num_warps=8,
                                    num_stages=3, epilogue_parts=2)
    ours, theirs = (summary.unpack(fused(shards, hidden, weight, layout, params, positions,
                                         config=config)[None], layout)
                    for config in (ws, same_tiles))
    for name in ("best", "token", "score", "keys", "floor"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a is None or torch.equal(a, b), name
    torch.testing.assert_close(ours.lse, theirs.lse, rtol=1e-6, atol=1e-5)
    unaligned = VocabShards((4100, 8188), 1)
    sampled = SamplingParams.create(256, temperature=0.7, seed=3, device=DEVICE)
    with pytest.raises(ValueError, match="vocab_offset that is a multiple of 16"):
        fused(unaligned, hidden, weight, summary.summary_layout("sample", unaligned), sampled,
              positions, config=kernels.default_config(256, warp_specialized=True))


def test_compile_variants_of_a_shard_runs_every_setting(monkeypatch):
    """The engine's precompilation on a tensor-parallel head (`samplers.compile_variants`
    with `shards`): every kernel setting through the per-shard kernels, sampling and
    verifying, at the shard's offset and with the whole vocabulary's size (a top-k of V is
    V's, not the shard's), with neutral edits, then the merge of that many ranks' words
    (both acceptance modes in verification); no exchange."""
    from flashspec.generation import samplers

    seen = []
    real = kernels.fused_shard_summaries

    def recorded(hidden, weight, layout, params, positions, offset, vocab_size, **kwargs):
        seen.append((offset, vocab_size, int(params.top_k.max()), kwargs["edits"]))
        return real(hidden, weight, layout, params, positions, offset, vocab_size, **kwargs)

    merges = []
    real_merge = kernels.merge_shard_summaries

    def merged(words, layout, vocab_size, params, positions, drafts, acceptance):
        merges.append((words.shape[0], layout, vocab_size, drafts is not None, acceptance))
        return real_merge(words, layout, vocab_size, params, positions, drafts, acceptance)

    monkeypatch.setattr(kernels, "fused_shard_summaries", recorded)
    monkeypatch.setattr(kernels, "merge_shard_summaries", merged)
    shards = VocabShards((40, 60), 1)          # this rank holds tokens 40-99
    weight = torch.randn(60, 16, device=DEVICE)
    for width in (0, 2):
        samplers.compile_variants(weight, 2, width, edits=("codes", "counts"), shards=shards)
    settings = samplers.kernel_settings(100)
    assert len(seen) == 2 * len(settings)
    # The merge of each: two ranks' words; verification in both acceptance modes.
    assert len(merges) == 3 * len(settings)
    assert {(ranks, vocab) for ranks, _, vocab, *_ in merges} == {(2, 100)}
    assert {(verify, acceptance) for *_, verify, acceptance in merges} == {
        (False, "strict"), (True, "strict"), (True, "probabilistic")}
    assert any(layout.num_candidates for _, layout, *_ in merges)
    assert {(offset, vocab) for offset, vocab, _, _ in seen} == {(40, 100)}
    assert 100 in {top_k for _, _, top_k, _ in seen}          # the "top-k of V" setting
    assert all(edits.codes.shape[-1] == 60 and not edits.codes.any()
               and edits.counts.shape == (2, 60) for *_, edits in seen)
