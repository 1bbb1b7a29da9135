"""flashspec.rng: Philox known answers, uniformity, independence, and bit identity with the
Triton side (interpreter on CPU, compiled on a GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from flashspec import rng
from flashspec.kernels import noise
from flashspec.bench.statistics import assert_samples_match, ks_uniform_pvalue

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Random123's published known-answer vectors for Philox4x32-10 (kat_vectors).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    words = rng.philox4x32(*[torch.tensor(c) for c in counter], *[torch.tensor(k) for k in key])
    assert tuple(int(w) for w in words) == expected


def check_uniformity(n=200_000, seed=1234):
    """KS test of u over random (seed, position, token) triples, and of the Gumbel CDF."""
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, rng.MAX_SEED, (n,), generator=g)
    positions = torch.randint(0, 2**20, (n,), generator=g)
    tokens = torch.randint(0, 2**18, (n,), generator=g)
    u = rng.uniform(seeds, positions, tokens)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert ks_uniform_pvalue(u) > 1e-4, "uniform noise fails KS"
    g32 = rng.gumbel(seeds, positions, tokens, dtype=torch.float32).double()
    assert ks_uniform_pvalue(torch.exp(-torch.exp(-g32))) > 1e-4, "Gumbel CDF of noise fails KS"


def test_uniformity():
    check_uniformity()


def check_independence(shift: str, n=100_000, bins=10):
    """Joint histogram of noise at neighbouring (seed | position | token id | next Philox
    block) against the uniform grid: a chi-squared test of independence."""
    base_seed, base_pos, base_tok = 987654321, torch.arange(n) // 64, torch.arange(n) % 64 * 8
    a = rng.uniform(base_seed, base_pos, base_tok)
    deltas = {"seed": (1, 0, 0), "position": (0, 1, 0), "token": (0, 0, 1), "block": (0, 0, 4)}
    ds, dp, dt = deltas[shift]
    b = rng.uniform(base_seed + ds, base_pos + dp, base_tok + dt)
    cell = (a * bins).long() * bins + (b * bins).long()
    uniform_grid = torch.full((bins * bins,), 1.0 / bins**2, dtype=torch.float64)
    assert_samples_match(cell, uniform_grid, what=f"noise at neighbouring {shift}")
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert abs(float(corr)) < 5 / n**0.5, f"correlation {float(corr):.4g} across {shift}"


@pytest.mark.parametrize("shift", ["seed", "position", "token", "block"])
def test_independence_of_neighbours(shift):
    check_independence(shift)


def test_gumbel_finite_and_accurate_in_both_tails():
    extremes = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])
    u = (extremes.double() + 0.5) * 2.0**-32
    exact = -torch.log(-torch.log(u))  # float64 with u exact: the true value
    for dtype in (torch.float32, torch.float64):
        e = rng.exponential_from_bits(extremes, dtype)
        g = -torch.log(e)
        assert torch.isfinite(g).all()
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert torch.allclose(g.double(), exact, rtol=tol, atol=tol), (dtype, g, exact)
    assert float(exact.max()) == pytest.approx(22.87, abs=0.01)


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="`seed`"):
        rng.uniform(-1, 0, 0)
    with pytest.raises(ValueError, match="`position`"):
        rng.uniform(0, 2**32, 0)
    with pytest.raises(ValueError, match="`token_ids`"):
        rng.uniform(0, 0, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="`stream`"):
        rng.uniform(0, 0, 0, stream=7)
    with pytest.raises(ValueError, match="`dtype`"):
        rng.gumbel(0, 0, 0, dtype=torch.float16)


@triton.jit
def _noise_probe_kernel(seed_ptr, pos_ptr, tok_ptr, bits_ptr, accept_bits_ptr, gumbel_ptr,
                        N: tl.constexpr):
    offs = tl.arange(0, N)
    seed = tl.load(seed_ptr + offs)
    pos = tl.load(pos_ptr + offs)
    tok = tl.load(tok_ptr + offs)
    tl.store(bits_ptr + offs, noise.philox_bits(seed, pos, tok, noise.GUMBEL_STREAM).to(tl.int64))
    tl.store(accept_bits_ptr + offs,
             noise.philox_bits(seed, pos, tok, noise.ACCEPT_STREAM).to(tl.int64))
    tl.store(gumbel_ptr + offs, noise.gumbel_noise(seed, pos, tok))


def check_triton_matches_torch(seed=0, n=1024):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, rng.MAX_SEED, (n,), generator=g)
    seeds[:4] = torch.tensor([0, 1, 2**62, rng.MAX_SEED])
    positions = torch.randint(0, rng.MAX_POSITION + 1, (n,), generator=g)
    tokens = torch.randint(0, rng.MAX_TOKEN_ID + 1, (n,), generator=g)
    tokens[4:36] = torch.arange(32)  # every word of the Philox blocks of two token groups
    args = [t.to(DEVICE) for t in (seeds, positions, tokens)]
    bits = torch.empty(n, dtype=torch.int64, device=DEVICE)
    accept_bits = torch.empty_like(bits)
    gumbel = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _noise_probe_kernel[(1,)](*args, bits, accept_bits, gumbel, n)
    assert torch.equal(bits.cpu(), rng.random_bits(seeds, positions, tokens)), "Gumbel-stream bits"
    assert torch.equal(accept_bits.cpu(),
                       rng.random_bits(seeds, positions, tokens, rng.ACCEPT_STREAM)), "accept bits"
    reference = rng.gumbel(seeds, positions, tokens, dtype=torch.float32)
    # Same bits, same float32 steps; only the `log` implementation may differ by an ulp or so.
    assert torch.allclose(gumbel.cpu(), reference, rtol=2e-6, atol=2e-6)


def test_triton_noise_is_bit_identical_to_torch():
    check_triton_matches_torch()


@pytest.mark.gpu
def test_torch_noise_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, rng.MAX_SEED, (4096,), generator=g)
    positions = torch.randint(0, 2**32, (4096,), generator=g)
    tokens = torch.randint(0, 2**17, (4096,), generator=g)
    cpu = rng.random_bits(seeds, positions, tokens)
    cuda = rng.random_bits(seeds.cuda(), positions.cuda(), tokens.cuda())
    assert torch.equal(cpu, cuda.cpu())


@triton.jit
def _noise_tile_probe_kernel(seed_ptr, pos_ptr, out_ptr, FIRST: tl.constexpr,
                             ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    seed = tl.load(seed_ptr + rows)[:, None, None]
    pos = tl.load(pos_ptr + rows)[:, None, None]
    blocks = noise.philox_blocks(FIRST // 16 + tl.arange(0, COLS // 16), tl.arange(0, 4))
    tile = noise.gumbel_from_bits(noise.philox_tile_bits(seed, pos, blocks, ROWS, COLS))
    tl.store(out_ptr + rows[:, None] * COLS + tl.arange(0, COLS)[None, :], tile)


def test_token_to_philox_block_and_word():
    """Token 16a + 8h + 2m + l is word 2h + l of Philox block 4a + m (the documented contract)."""
    seed, position = 2**40 + 7, 99
    tokens = torch.arange(64)
    a, h, m, l = tokens // 16, (tokens // 8) % 2, (tokens // 2) % 4, tokens % 2
    words = rng.philox4x32(4 * a + m, torch.tensor(position), torch.tensor(rng.GUMBEL_STREAM),
                           torch.tensor(0), torch.tensor(seed & 0xFFFFFFFF), torch.tensor(seed >> 32))
    expected = torch.stack(words).gather(0, (2 * h + l)[None, :])[0]
    assert torch.equal(rng.random_bits(seed, position, tokens), expected)
    # A bijection: 64 tokens use each of the 16 blocks' four words exactly once.
    assert len(set(zip((4 * a + m).tolist(), (2 * h + l).tolist()))) == 64


def test_tile_noise_uses_all_four_philox_words_in_token_order():
    seeds = torch.tensor([3, 2**62 + 5], device=DEVICE)
    positions = torch.tensor([0, 12345], device=DEVICE)
    out = torch.empty(2, 32, device=DEVICE)
    _noise_tile_probe_kernel[(1,)](seeds, positions, out, 64, 2, 32)
    tokens = torch.arange(64, 96)
    expected = rng.gumbel(seeds.cpu()[:, None], positions.cpu()[:, None], tokens[None, :],
                          dtype=torch.float32)
    assert torch.allclose(out.cpu(), expected, rtol=2e-6, atol=2e-6)


def test_gumbel_bounds_hold_at_the_extreme_words():
    """GUMBEL_MIN and GUMBEL_MAX bound the noise (the CPU race leaves out tokens by them): its
    extremes are at words 0 and 2**32 - 1, and every word between lies inside too."""
    words = torch.cat([torch.arange(4096), torch.arange(2**32 - 4096, 2**32),
                       torch.randint(0, 2**32, (1 << 16,), generator=torch.Generator().manual_seed(0))])
    for dtype in (torch.float32, torch.float64):
        noise = -torch.log(rng.exponential_from_bits(words, dtype))
        assert noise.min() == noise[0] and noise.max() == noise[8191]
        assert rng.GUMBEL_MIN < float(noise.min()) < rng.GUMBEL_MIN + 0.1
        assert rng.GUMBEL_MAX - 0.2 < float(noise.max()) < rng.GUMBEL_MAX
