"""SamplingParams: validation, HF defaults and precedence, seeds."""

import math

import pytest
import torch
from transformers import GenerationConfig

from flashspec import SamplingParams, rng


def test_create_broadcasts_scalars_and_keeps_exact_floats():
    p = SamplingParams.create(3, temperature=0.7, top_k=[0, 5, 20], top_p=0.95, seed=11)
    assert p.batch_size == 3
    assert p.temperature.dtype == torch.float64 and p.temperature.tolist() == [0.7] * 3
    assert p.top_k.tolist() == [0, 5, 20]
    assert p.seed.tolist() == [11, 12, 13]
    assert p.min_p.tolist() == [0.0] * 3


def test_greedy_rows():
    p = SamplingParams.create(4, do_sample=[True, False, True, True],
                              temperature=[1.0, 1.0, 0.0, 0.5], seed=0)
    assert p.is_greedy.tolist() == [False, True, True, False]


@pytest.mark.parametrize("name,value,match", [
    ("temperature", -0.1, "temperature.*-0.1.*>= 0"),
    ("temperature", float("nan"), "temperature.*nan"),
    ("temperature", float("inf"), "temperature.*inf"),
    ("temperature", 1e-50, "temperature.*1e-50.*float32"),  # greedy in float32
    ("top_p", 0.0, r"top_p.*0.0.*\(0, 1\]"),
    ("top_p", 1.5, r"top_p.*1.5.*\(0, 1\]"),
    ("top_p", float("nan"), "top_p.*nan"),
    ("min_p", -0.01, r"min_p.*-0.01.*\[0, 1\]"),
    ("min_p", 1.01, r"min_p.*1.01.*\[0, 1\]"),
    ("min_p", float("nan"), "min_p.*nan"),
    ("top_k", -1, "top_k.*-1.*>= 0"),
    ("top_k", 2.5, "top_k.*int"),
    ("do_sample", 1, "do_sample.*bool"),
    ("seed", -5, "seed.*-5"),
    ("seed", 2**63, "seed"),
    ("seed", 1.5, "seed"),
])
def test_bad_values_name_parameter_value_and_range(name, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.create(2, **{name: value})


def test_bad_shapes_and_devices():
    with pytest.raises(ValueError, match=r"top_k.*shape \[3\].*\(2,\)"):
        SamplingParams.create(3, top_k=[1, 2])
    with pytest.raises(ValueError, match="seed.*shape"):
        SamplingParams.create(2, seed=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="batch_size"):
        SamplingParams.create(0)
    good = SamplingParams.create(2, seed=0)
    with pytest.raises(ValueError, match="temperature.*rows"):
        SamplingParams(good.do_sample, good.temperature[:1], good.top_k, good.top_p,
                       good.min_p, good.seed)
    with pytest.raises(ValueError, match="top_p.*dtype"):
        SamplingParams(good.do_sample, good.temperature, good.top_k, good.top_p.float(),
                       good.min_p, good.seed)
    with pytest.raises(ValueError, match="temperature.*meta"):
        SamplingParams(good.do_sample, good.temperature.to("meta"), good.top_k, good.top_p,
                       good.min_p, good.seed)


def test_hf_defaults_when_sampling():
    p = SamplingParams.from_generation_config(GenerationConfig(do_sample=True), 2, seed=0)
    assert p.top_k.tolist() == [50, 50]          # transformers' default top_k when sampling
    assert p.temperature.tolist() == [1.0, 1.0]
    assert p.top_p.tolist() == [1.0, 1.0]
    assert p.min_p.tolist() == [0.0, 0.0]
    assert not p.is_greedy.any()


def test_hf_precedence_explicit_values_win():
    config = GenerationConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.05)
    p = SamplingParams.from_generation_config(config, 1, seed=3)
    assert (p.temperature.item(), p.top_k.item(), p.top_p.item(), p.min_p.item()) == (
        0.6, 20, 0.95, 0.05)
    p = SamplingParams.from_generation_config(GenerationConfig(do_sample=True, top_k=0), 1, seed=3)
    assert p.top_k.item() == 0                   # explicit 0 disables top-k, as in HF


def test_greedy_configs():
    for config in (GenerationConfig(), GenerationConfig(do_sample=False, temperature=0.3)):
        assert SamplingParams.from_generation_config(config, 2, seed=0).is_greedy.all()


@pytest.mark.parametrize("options,error,match", [
    (dict(temperature=0.0), ValueError, "`temperature`=0.0 .*float > 0.*do_sample=False"),
    (dict(temperature=2), ValueError, "`temperature`=2 .*float > 0"),
    (dict(temperature="0.5"), ValueError, "`temperature`='0.5' \\(str\\)"),
    (dict(temperature=[0.5, 1.0]), ValueError, "`temperature`=\\[0.5, 1.0\\] \\(list\\)"),
    (dict(top_k=5.0), ValueError, "`top_k`=5.0 .*int > 0"),
    (dict(top_k=-1), ValueError, "`top_k`=-1"),
    (dict(top_p="0.9"), TypeError, "`top_p`='0.9'.*real number"),
    (dict(top_p=-0.1), ValueError, "`top_p`=-0.1.*\\[0, 1\\]"),
    (dict(min_p=1.5), ValueError, "`min_p`=1.5"),
    (dict(min_p=float("nan")), ValueError, "`min_p`=nan"),
    (dict(do_sample="yes"), TypeError, "`do_sample`='yes'"),
])
def test_sampling_values_follow_transformers_rules(options, error, match):
    """Refused where transformers' warpers refuse them, naming option, value and source."""
    with pytest.raises(error, match=match):
        SamplingParams.from_generation_config(GenerationConfig(**{"do_sample": True, **options}), 1)


def test_sampling_values_transformers_accepts():
    """What transformers runs, with its meaning: top_p=0 keeps the most likely token, top_p
    >= 1 (or NaN) and top_k=0 truncate nothing, a huge top_k keeps everything."""
    def params(**options):
        return SamplingParams.from_generation_config(GenerationConfig(do_sample=True, **options), 1)
    p = params(top_p=0.0)
    assert (p.top_k.item(), p.top_p.item()) == (1, 1.0)
    for top_p in (1, 1.5, float("nan")):
        assert params(top_p=top_p).top_p.item() == 1.0
    assert params(top_k=2**63).top_k.item() == 2**63 - 1
    assert params(top_k=0, temperature=1).top_k.item() == 0


def test_a_dict_is_not_a_generation_config():
    with pytest.raises(TypeError, match="`generation_config` must be a transformers GenerationConfig, got dict"):
        SamplingParams.from_generation_config({"do_sample": True}, 1)


@pytest.mark.parametrize("option,value", [("typical_p", 0.9), ("epsilon_cutoff", 3e-4),
                                          ("eta_cutoff", 3e-4), ("top_h", 0.5)])
def test_unfused_warpers_are_refused(option, value):
    with pytest.raises(ValueError, match=f"`{option}`.*not supported.*sampler='flash'"):
        SamplingParams.from_generation_config(GenerationConfig(do_sample=True, **{option: value}), 1)


def test_beam_search_is_refused():
    with pytest.raises(ValueError, match="num_beams.*beam search"):
        SamplingParams.from_generation_config(GenerationConfig(num_beams=4), 1)


def test_seed_from_torch_default_generator_is_repeatable():
    config = GenerationConfig(do_sample=True)
    torch.manual_seed(0)
    a = SamplingParams.from_generation_config(config, 4).seed
    torch.manual_seed(0)
    b = SamplingParams.from_generation_config(config, 4).seed
    c = SamplingParams.from_generation_config(config, 4).seed
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert len(set(a.tolist())) == 4 and int(a.min()) >= 0


def test_seed_forms():
    assert SamplingParams.create(3, seed=torch.tensor([5, 1, 9])).seed.tolist() == [5, 1, 9]
    assert SamplingParams.create(2, seed=[rng.MAX_SEED, 0]).seed.tolist() == [rng.MAX_SEED, 0]
    # Every seed of the documented range serves every batch: row b uses seed + b mod 2**63.
    assert SamplingParams.create(3, seed=rng.MAX_SEED).seed.tolist() == [rng.MAX_SEED, 0, 1]
    with pytest.raises(ValueError, match="seed.*row b uses seed \\+ b"):
        SamplingParams.create(2, seed=rng.MAX_SEED + 1)
    with pytest.raises(ValueError, match="`seed`=18446744073709551616 .*int64"):
        SamplingParams.create(2, seed=[0, 2**64])


def test_repeat_interleave_and_to():
    p = SamplingParams.create(2, top_k=[1, 2], seed=[7, 8])
    r = p.repeat_interleave(3)
    assert r.top_k.tolist() == [1, 1, 1, 2, 2, 2] and r.seed.tolist() == [7, 7, 7, 8, 8, 8]
    assert p.to("cpu").device == torch.device("cpu")
    assert math.isclose(r.top_p[0].item(), 1.0)


@pytest.mark.parametrize("rows,flags", [
    # (all_greedy, any_top_k, any_top_p, any_min_p, top-k everywhere below V = 30, every
    #  sampled row truncated at V = 30, any_greedy)
    (dict(do_sample=False, top_k=5), (True, False, False, False, False, True, True)),
    (dict(top_k=[20, 5], top_p=[0.95, 1.0]), (False, True, True, False, True, True, False)),
    (dict(top_k=[20, 30], top_p=[0.95, 1.0]), (False, True, True, False, False, False, False)),
    (dict(top_k=[20, 0], top_p=[1.0, 0.9]), (False, True, True, False, False, True, False)),
    (dict(do_sample=[True, False], top_k=20, min_p=0.1),
     (False, True, False, True, False, True, True)),
    (dict(temperature=[0.7, 0.0], top_p=0.9), (False, False, True, False, False, True, True)),
    (dict(top_k=0, top_p=[0.9, 1.0]), (False, False, True, False, False, False, False)),
    # A top-p that rounds to 1 in float32, a min-p that rounds to 0: the kernels, which read
    # them in float32, truncate nothing with them.
    (dict(top_k=0, top_p=[1 - 1e-9, 0.9]), (False, False, True, False, False, False, False)),
    (dict(top_k=0, min_p=[1e-50, 0.1]), (False, False, False, True, False, False, False)),
])
def test_kernel_flags(rows, flags):
    """The host-side summaries that pick kernel variants: greedy rows (do_sample off or
    temperature 0) use no warper; a top-k "everywhere" needs every row sampled with one
    below the vocabulary; a sampled row is truncated by such a top-k, a top-p or a min-p
    (as float32 reads them). A subset selected without validation keeps flags that hold for
    it."""
    params = SamplingParams.create(2, seed=0, **rows)
    assert params.kernel_flags(30) == flags
    assert params.select(torch.tensor([1]), validate=False).kernel_flags(30) == flags


@pytest.mark.gpu
def test_a_tensor_on_the_current_cuda_device_is_on_cuda():
    """``device="cuda"`` means the current CUDA device: a seed tensor made there is accepted."""
    seeds = torch.arange(3, device="cuda")
    params = SamplingParams.create(3, temperature=0.8, seed=seeds, device="cuda")
    assert torch.equal(params.seed, seeds)
