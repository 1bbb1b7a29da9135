"""Speculative generation samples whole sequences from exactly the target's distribution.

A tiny-vocabulary target (V = 24, float64 so that nothing is a rounding question) generates
4 new tokens for 20,000 seeded rows in one batch, drafted by the target itself (greedy
drafts, accepted where the sampled token is the argmax) or by prompt lookup, so that
acceptance is ragged across rows and steps. The
first token comes from the prefill, the drafted steps give the next three: the joint
distribution of their 24^3 possible values (the first token summed out) is enumerated from
the target in float64 with transformers' warpers, and the samples must pass the
chi-squared test of `flashspec.bench.statistics` (false-alarm rate 1e-4 per test).
"""

import dataclasses

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import flashspec
from flashspec import reference
from flashspec.bench.statistics import assert_acceptance_matches, assert_samples_match

VOCAB = 24
NEW_TOKENS = 4
NUM_RUNS = 20_000

CONFIGS = {
    "plain": dict(do_sample=True, top_k=0),
    "T0.8_top_k8_top_p0.9": dict(do_sample=True, temperature=0.8, top_k=8, top_p=0.9),
    "min_p0.05": dict(do_sample=True, top_k=0, min_p=0.05),
}


def _tiny_llama(seed: int, layers: int, head_scale: float):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():   # a peaked distribution, so that a wrong sampler is visible
        model.lm_head.weight.mul_(head_scale)
    return model


@pytest.fixture(scope="module")
def target():
    return flashspec.wrap(_tiny_llama(seed=0, layers=2, head_scale=30.0))


@pytest.fixture(scope="module")
def prompt(target):
    """[3, 17, c, 3, 17]: c is the target's most likely next token there. Drafts begin after
    the first token (likely c): prompt lookup then matches "17 c" and drafts "3 17"."""
    candidates = torch.tensor([[3, 17, c, 3, 17] for c in range(VOCAB)])
    with torch.no_grad():
        logits = target(candidates).logits[:, -1]
    best = int(logits[torch.arange(VOCAB), torch.arange(VOCAB)].argmax())
    return [[3, 17, best, 3, 17]]


def _exact_joint(model, prompt: list, sampling: dict) -> torch.Tensor:
    """float64 [V^3]: P(x2, x3, x4 | prompt) under the transformed target distribution (x1,
    the prefill's token, summed out)."""
    prompt = torch.tensor(prompt)
    triples = torch.cartesian_prod(*[torch.arange(VOCAB)] * 3)                 # [V^3, 3]
    inputs = torch.cat([prompt.expand(len(triples), -1), triples], dim=1)
    with torch.no_grad():
        logits = model(inputs).logits[:, -NEW_TOKENS:].double()              # [V^3, 4, V]
    params = flashspec.SamplingParams.from_generation_config(
        GenerationConfig(**sampling), len(triples) * NEW_TOKENS)
    probs = reference.transform_logits(logits.reshape(-1, VOCAB), params).softmax(-1)
    probs = probs.view(VOCAB, VOCAB, VOCAB, NEW_TOKENS, VOCAB)
    p1 = probs[0, 0, 0, 0]                                   # p(x1 | prompt)
    p2 = probs[:, 0, 0, 1]                                   # p(x2 | prompt, x1)
    p3 = probs[:, :, 0, 2]                                   # p(x3 | prompt, x1, x2)
    p4 = probs[:, :, :, 3]                                   # p(x4 | prompt, x1, x2, x3)
    joint = p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4
    return joint.sum(dim=0).reshape(-1)


def _outcomes(sequences: torch.Tensor) -> torch.Tensor:
    """Each row's last three new tokens as one index into `_exact_joint`."""
    new = sequences[:, -3:]
    return (new[:, 0] * VOCAB + new[:, 1]) * VOCAB + new[:, 2]


@pytest.fixture(scope="module")
def speculative_run(target, prompt):
    """`run(drafter, config)`: the seeded speculative run of NUM_RUNS rows, generated once
    (the distribution test and the acceptance check's teeth read the same run)."""
    runs = {}

    def run(drafter: str, config: str):
        if (drafter, config) not in runs:
            drafting = (dict(assistant_model=target, num_assistant_tokens=2) if drafter == "self"
                        else dict(prompt_lookup_num_tokens=2))
            prompts = torch.tensor(prompt).expand(NUM_RUNS, -1)
            runs[drafter, config] = target.generate(
                prompts, sampler="flash", max_new_tokens=NEW_TOKENS, seed=1000,
                return_dict_in_generate=True, **drafting, **CONFIGS[config])
        return runs[drafter, config]
    return run


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("drafter", ["self", "prompt_lookup"])
def test_speculative_sequences_follow_the_target_distribution(target, prompt, speculative_run,
                                                             drafter, config):
    sampling = CONFIGS[config]
    out = speculative_run(drafter, config)
    stats = out.flash_stats
    # Drafts were really verified, and rows advanced unevenly. Self-drafts are accepted
    # wherever the sampled token is the argmax; lookup's "3 17" after the first token falls
    # outside some truncated supports, so its runs may check only rejections.
    assert stats.drafted.sum() > NUM_RUNS // 2 and stats.accepted.sum() < stats.drafted.sum()
    assert drafter != "self" or stats.accepted.sum() > 0
    assert_samples_match(_outcomes(out.sequences), _exact_joint(target, prompt, sampling),
                         what=f"{drafter} / {sampling}: continuations")
    # Each reached draft was accepted with probability p(x), as reported.
    assert_acceptance_matches(stats, what=f"{drafter} / {sampling}: accepted drafts")


def test_the_acceptance_check_sees_slightly_wrong_accept_probabilities(speculative_run):
    """Teeth: the run's self-drafted acceptances, right against p(x), fail against p(x)
    scaled by 0.9."""
    stats = speculative_run("self", "plain").flash_stats
    check = assert_acceptance_matches(stats)
    assert check.std > 0
    wrong = dataclasses.replace(stats, accept_probs=stats.accept_probs * 0.9)
    with pytest.raises(AssertionError, match=r"expected from p\(x\)"):
        assert_acceptance_matches(wrong)


def test_the_check_sees_a_slightly_wrong_temperature(target, prompt, speculative_run):
    """Teeth: the same samples fail against the joint distribution at temperature 1.1."""
    sequences = speculative_run("self", "plain").sequences
    with pytest.raises(AssertionError, match="chi-squared"):
        assert_samples_match(_outcomes(sequences), _exact_joint(target, prompt, {**CONFIGS["plain"], "temperature": 1.1}))
