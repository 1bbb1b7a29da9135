"""Offline models at real shapes: random weights from shipped configs.

``flashspec/assets/configs`` holds the shape fields of real models' config.json files
(Qwen3-1.7B, Qwen3-0.6B, Llama-3.1-8B, Llama-3.2-1B, and Qwen3.5-9B's widths with an MTP
layer; each file's ``_source`` says which).
`random_model` builds a causal LM from one of them, or from any config.json, with seeded
random weights: nothing is downloaded, and a forward costs what the real model's does.
Random models are nearly flat; `peak_weights` makes one decisive. scripts/tok_per_s.py and
scripts/acceptance_rate.py build their ``--random-init`` models here.

    model = random_model("qwen3-1.7b", device="cuda", dtype=torch.bfloat16)
    model = peak_weights(model)           # optional: greedy self-drafts all accepted
    head = random_eagle3(model, "llama-3.1-8b")   # an EAGLE-3 head at a published shape
    random_mtp(model)       # a model whose config has num_mtp_layers: random MTP layers
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "assets" / "configs"
# Published EAGLE-3 heads' config.json files (shapes only), by their target's name.
EAGLE3_CONFIGS_DIR = CONFIGS_DIR.parent / "eagle3"
# The shipped configs' note on where a shape comes from: not a transformers config field.
SOURCE_FIELD = "_source"
# Kinds of random-init weights (the scripts' --weights) and how their reports describe them.
WEIGHTS = {"random": "random init",
           "peaked": "random init, peaked (flashspec.bench.random_init.peak_weights)"}
# peak_weights: the projections that write into the residual stream, scaled by this.
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")
PEAKED_BRANCH_SCALE = 1e-3


def config_names() -> list[str]:
    """The shipped configs' names (their file names without .json), sorted."""
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.json"))


def config_path(shape: str) -> Path:
    """The config.json of `shape`: a shipped config's name, else `shape` as a file path."""
    named = CONFIGS_DIR / f"{shape}.json"
    return named if named.is_file() else Path(shape)


def random_config(shape: str) -> PretrainedConfig:
    """The transformers config of `shape` (see `config_path`). ValueError, saying why, when
    it is not a JSON object with a model_type that transformers knows."""
    path = config_path(shape)
    if not path.is_file():
        raise ValueError(f"{shape!r} is neither a config shipped in flashspec/assets/configs "
                         f"({', '.join(config_names())}) nor a config.json file")
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{shape!r}: cannot read {path}: {error}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{shape!r}: {path} has no 'model_type'")
    # Checked here: transformers' own error lists every model type it knows.
    if fields["model_type"] not in CONFIG_MAPPING:
        raise ValueError(f"{shape!r}: {path} has model_type {fields['model_type']!r}, which "
                         "this version of transformers does not know")
    fields.pop(SOURCE_FIELD, None)
    return AutoConfig.for_model(**fields)


def random_model(shape: str, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0):
    """An AutoModelForCausalLM of `shape` (see `config_path`) with random weights, built on
    `device` in `dtype`, in eval mode. torch's global RNGs are seeded `seed` first, so that a
    seed gives the same weights on a device."""
    config = random_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def peak_weights(model):
    """Make a random-init model decisive, in place: scale the projections that write into
    the residual stream (attention and MLP outputs) by PEAKED_BRANCH_SCALE and give the LM
    head the embedding's values. The final hidden state is then dominated by the current
    token's embedding, whose own logit leads every other by a wide margin, so that
    greedy self-speculation accepts every draft despite bf16 rounding differences
    between one-token and many-token forwards (random models are nearly flat: their
    top-2 logits tie within that rounding a few times in a hundred tokens). The cost of a
    forward does not depend on the weights' values. Returns `model`."""
    scaled = [module for name, module in model.named_modules()
              if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS
              and isinstance(module, torch.nn.Linear)]
    expected = len(RESIDUAL_OUTPUTS) * model.config.num_hidden_layers
    if len(scaled) != expected:
        raise ValueError(f"peak_weights: found {len(scaled)} residual output projections "
                         f"named {RESIDUAL_OUTPUTS}, expected {expected} in "
                         f"{type(model).__name__}")
    with torch.no_grad():
        for module in scaled:
            module.weight.mul_(PEAKED_BRANCH_SCALE)
        head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        if head is not embedding:
            head.copy_(embedding)
    return model


def eagle3_shapes() -> list[str]:
    """The published EAGLE-3 heads' shapes shipped in flashspec/assets/eagle3, by name."""
    return sorted(path.stem for path in EAGLE3_CONFIGS_DIR.glob("*.json"))


def random_eagle3(model, shape: str | None = None, seed: int = 0, draft_vocab_size: int = 32000,
                  taps: tuple[int, ...] | None = None):
    """A random-init EAGLE-3 head (`flashspec.Eagle3`) for `model`, on its LM head's device
    in its dtype: at the shape of the published head whose config
    ``flashspec/assets/eagle3/<shape>.json`` holds (or any such config.json path), or, with
    no `shape`, one layer as wide as the model's with a draft vocabulary of
    ``min(draft_vocab_size, V)`` tokens. Its draft tokens are a seeded random subset of the
    model's vocabulary; torch's global RNGs are seeded `seed` first."""
    from ..generation.eagle3 import Eagle3
    from ..generation.eagle3_model import Eagle3Model, config_taps
    from transformers import LlamaConfig

    target = model.config.get_text_config()
    if shape is not None:
        path = EAGLE3_CONFIGS_DIR / f"{shape}.json"
        path = path if path.is_file() else Path(shape)
        if not path.is_file():
            raise ValueError(f"{shape!r} is neither an EAGLE-3 config shipped in "
                             f"flashspec/assets/eagle3 ({', '.join(eagle3_shapes())}) nor a file")
        fields = json.loads(path.read_text())
        fields.pop(SOURCE_FIELD, None)
    else:
        heads = target.num_attention_heads
        fields = dict(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                      num_attention_heads=heads,
                      num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
                      head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
                      vocab_size=target.vocab_size, rms_norm_eps=1e-6,
                      draft_vocab_size=min(draft_vocab_size, target.vocab_size))
    fields.pop("architectures", None)
    config = LlamaConfig(**{**fields, "num_hidden_layers": 1})
    torch.manual_seed(seed)
    weight = model.get_output_embeddings().weight
    with torch.device(weight.device):
        head = Eagle3Model(config, own_embeddings=False).placed(weight.device, weight.dtype).eval()
    draft_vocab = head.lm_head.out_features
    used = torch.randperm(config.vocab_size, device=weight.device)[:draft_vocab].sort().values
    head.d2t.copy_(used - torch.arange(draft_vocab, device=weight.device))
    taps = taps if taps is not None else config_taps(fields, target.num_hidden_layers)
    return Eagle3(head, model, taps)


def random_mtp(model, seed: int = 0):
    """Random-init MTP layers (transformers' `MtpModel`) for `model`, whose config has
    ``num_mtp_layers``, kept as its MTP layers (`flashspec.generation.mtp.keep_mtp`), so that
    ``generate(use_mtp=True, sampler="flash")`` runs offline; on the model's LM-head device
    in its dtype (the embedding, LM head and rotary table stay the model's own). torch's
    global RNGs are seeded `seed` first."""
    from transformers.modeling_layers import MtpModel

    from ..generation.mtp import keep_mtp, mtp_layers

    layers = mtp_layers(model)
    if layers is None:
        raise ValueError(f"random_mtp: {type(model).__name__}'s config has no num_mtp_layers")
    weight = model.get_output_embeddings().weight
    torch.manual_seed(seed)
    with torch.device(weight.device):
        mtp = MtpModel(model, layers).eval()
    # MtpModel's own initialisation leaves what it does not know (MoE experts) as allocated:
    # the model's class initialises its layers' modules.
    with torch.no_grad():
        for module in mtp.layers.modules():
            model._init_weights(module)
    mtp.layers.to(weight.dtype)         # not the shared modules: the model's, as they are
    if mtp.use_shared_post_norm:
        mtp.shared_post_norm.to(weight.dtype)
    keep_mtp(model, mtp)
    return mtp
