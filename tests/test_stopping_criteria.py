"""A caller's `stopping_criteria` run on the engine, as stock's plain decoding runs them:
checked after every new token, the row cut at the first token where they hold, the same
with and without speculation; one of transformers' own kinds (which replaces transformers'
own there) defers the call to stock."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import MaxLengthCriteria

from _models import VOCAB
from test_logits_options import PROMPTS, SAMPLING, SEED, flash, left_pad, target
from test_generate import _quiet_single_threaded  # noqa: F401 - the module's autouse fixture


class AfterToken(StoppingCriteria):
    """Done once the row's last token is `token`, or the row holds `count` tokens from
    `start` on (stock's input_ids width counts the padding, as here)."""

    def __init__(self, token: int, width: int):
        self.token, self.width = token, width
        self.calls = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(tuple(input_ids.shape))
        return (input_ids[:, -1] == self.token) | (input_ids.shape[1] >= self.width)


def _stock(ids, mask, criteria, **kwargs):
    torch.manual_seed(0)
    return target().generate(ids, attention_mask=mask, max_new_tokens=12,
                             stopping_criteria=StoppingCriteriaList([criteria]), **kwargs)


def _unused_eos(free: torch.Tensor) -> int:
    """An EOS id no run emits: with an EOS, stock pads the rows its criteria finished (without
    one it keeps generating them, where flashspec pads: plan's deliberate differences)."""
    return min(set(range(VOCAB)) - set(free.flatten().tolist()))


@pytest.mark.parametrize("mode", ["plain", "self", "assistant", "lookup"])
def test_greedy_equals_stock_plain_decoding(mode):
    ids, mask = left_pad(PROMPTS)
    free = flash(target(), ids, mask, do_sample=False).sequences
    new = free[:, ids.shape[1]:]
    stop_token = int(new[1, 3])            # row 1 stops at its 4th new token, the others later
    special = dict(eos_token_id=_unused_eos(free), pad_token_id=0)
    criteria = AfterToken(stop_token, ids.shape[1] + 9)
    stock = _stock(ids, mask, AfterToken(stop_token, ids.shape[1] + 9), do_sample=False, **special)
    out = flash(target(), ids, mask, mode, do_sample=False, **special,
                stopping_criteria=StoppingCriteriaList([criteria])).sequences
    assert torch.equal(out, stock)
    assert out.shape[1] < free.shape[1]
    assert all(shape[0] == 1 for shape in criteria.calls)


def test_seeded_sampling_stops_at_the_same_token_with_drafts():
    """Each row is the free run cut after its first stop token (then padding), plain and
    speculative."""
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    free = flash(target(), ids, mask, seed=SEED, pad_token_id=0, **SAMPLING).sequences
    stop_token = int(free[0, width + 2])
    expected = free.clone()
    for row in range(free.shape[0]):
        hits = (free[row, width:] == stop_token).nonzero()
        if len(hits):
            expected[row, width + int(hits[0]) + 1:] = 0
    for mode in ("plain", "self", "lookup"):
        out = flash(target(), ids, mask, mode, seed=SEED, pad_token_id=0, **SAMPLING,
                    stopping_criteria=StoppingCriteriaList([AfterToken(stop_token, 99)])).sequences
        assert torch.equal(out, expected[:, :out.shape[1]]) and not expected[:, out.shape[1]:].any(), mode


def test_a_criterion_of_transformers_own_kind_defers_to_stock():
    ids, mask = left_pad(PROMPTS)
    criteria = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 3)])
    with pytest.warns(UserWarning, match="defers this call to stock.*MaxLengthCriteria"):
        out = flash(target(), ids, mask, do_sample=False, stopping_criteria=criteria).sequences
    assert out.shape[1] == ids.shape[1] + 3       # the custom max length replaced the config's


def test_bad_criteria_are_clear_errors():
    ids, mask = left_pad(PROMPTS)
    with pytest.raises(TypeError, match="`stopping_criteria` must be a StoppingCriteriaList"):
        flash(target(), ids, mask, stopping_criteria=AfterToken(1, 99))

    class ReadsScores(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return scores.argmax(dim=-1) == 0

    with pytest.raises(AttributeError) as caught:
        flash(target(), ids, mask, stopping_criteria=StoppingCriteriaList([ReadsScores()]))
    assert any("scores=None" in note for note in caught.value.__notes__)


def test_long_runs_grow_the_criteria_buffer():
    """Rows longer than the criteria's first buffer (256 new tokens) keep stock's input_ids."""
    ids, mask = left_pad(PROMPTS[:1])
    seen = []

    class Length(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(input_ids[0].clone())
            return torch.tensor([input_ids.shape[1] >= ids.shape[1] + 300])

    out = target().generate(ids, attention_mask=mask, sampler="flash", do_sample=False,
                            max_new_tokens=400, eos_token_id=None,
                            stopping_criteria=StoppingCriteriaList([Length()]))
    assert out.shape[1] == ids.shape[1] + 300
    assert torch.equal(seen[-1], out[0])
