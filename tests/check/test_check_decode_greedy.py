"""The ``decode_greedy`` shortcut (issue 30): a check that asks for every greedy decode step in one call judges the
same rows as one ``decode`` call per step, bit for bit, and a hook that feeds other tokens cannot pass."""

from __future__ import annotations

import numpy as np
import pytest
from shared import SHORTCUT_CHECKS, same_report

from kvfast.check import KvfastModel, ModelUnderTestError, check_cache
from kvfast.check.lossy import LossyKvfastModel
from kvfast.model.bugs import BUGS
from kvfast.model.config import ModelConfig, init_params

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=24)
PARAMS = init_params(CFG, 3)
PROMPT = np.array([3, 1, 4, 1, 5])


class StepByStep(KvfastModel):
    """kvfast's model without the shortcut: the checker decodes it one call per step."""

    decode_greedy = None


class Counting(KvfastModel):
    """Counts the shortcut's calls and ``decode``'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"decode_greedy": 0, "decode": 0}

    def decode_greedy(self, token, n):
        self.calls["decode_greedy"] += 1
        return super().decode_greedy(token, n)

    def decode(self, token):
        self.calls["decode"] += 1
        return super().decode(token)


class OffByOne(KvfastModel):
    """A shortcut that feeds the second-best token from step 2 on (not what it says)."""

    def decode_greedy(self, token, n):
        out = np.empty((n, self.vocab_size))
        for i in range(n):
            out[i] = self.decode(token)
            token = int(np.argsort(out[i])[-2])
        return out


class Declines(KvfastModel):
    def decode_greedy(self, token, n):
        raise NotImplementedError("not this time")


class Breaks(KvfastModel):
    def decode_greedy(self, token, n):
        raise RuntimeError("the hook broke")


class NonFinite(KvfastModel):
    def decode_greedy(self, token, n):
        out = super().decode_greedy(token, n)
        out[2, 7] = np.nan
        return out


def assert_rows_of_greedy_decodes(rows: np.ndarray, model, token: int) -> None:
    """``rows`` are, bit for bit, what ``model.decode`` returns step by step, fed ``token`` and then each argmax."""
    for i in range(len(rows)):
        row = model.decode(token)
        assert row.tobytes() == rows[i].tobytes()
        token = int(np.argmax(row))


@pytest.mark.parametrize("bug", [None, *BUGS])
@pytest.mark.parametrize("numerics", ["f64", "bf16"])
def test_decode_greedy_returns_the_rows_of_one_decode_per_step_fed_greedily(bug, numerics):
    fast, slow = KvfastModel(CFG, PARAMS, numerics, bug), KvfastModel(CFG, PARAMS, numerics, bug)
    fast.prefill(PROMPT)
    slow.prefill(PROMPT)
    rows = fast.decode_greedy(7, 9)
    assert_rows_of_greedy_decodes(rows, slow, 7)
    assert fast.cache.length == slow.cache.length
    assert fast.cache.k.tobytes() == slow.cache.k.tobytes()


def test_decode_greedy_goes_through_an_overridden_decode():
    """A subclass that changes decode (a lossy cache) is decoded by its own decode."""
    fast, slow = LossyKvfastModel(CFG, PARAMS, "f64", fmt="int8"), LossyKvfastModel(CFG, PARAMS, "f64", fmt="int8")
    plain = KvfastModel(CFG, PARAMS, "f64")
    for m in (fast, slow, plain):
        m.prefill(PROMPT)
    rows = fast.decode_greedy(2, 6)
    assert_rows_of_greedy_decodes(rows, slow, 2)
    assert plain.decode_greedy(2, 6).tobytes() != rows.tobytes()  # control: the lossy cache changes them


def test_decode_greedy_declines_without_room_and_leaves_the_cache():
    model = KvfastModel(CFG, PARAMS, "f64")
    model.prefill(PROMPT)
    room = CFG.max_pos - PROMPT.shape[0]
    with pytest.raises(NotImplementedError, match="pass the cache's 24"):
        model.decode_greedy(1, room + 1)
    assert model.cache.length == PROMPT.shape[0]
    assert model.decode_greedy(1, room).shape == (room, CFG.vocab)
    with pytest.raises(ValueError, match="^n: 0 is not allowed"):
        model.decode_greedy(1, 0)


@pytest.mark.parametrize("options", SHORTCUT_CHECKS)
@pytest.mark.parametrize("bug", [None, "stale", "posfrozen", "maskfrozen"])
def test_a_check_with_the_shortcut_reports_what_one_call_per_step_reports(options, bug):
    numerics = "bf16" if options.get("mode") == "control" else "f64"
    fast = check_cache(Counting(CFG, PARAMS, numerics, bug), PROMPT, 12, keep_logits=True, **options)
    slow = check_cache(StepByStep(CFG, PARAMS, numerics, bug), PROMPT, 12, keep_logits=True, **options)
    assert same_report(fast, slow)
    # control: the comparison sees a report of another bug
    other = check_cache(StepByStep(CFG, PARAMS, numerics, "noscale"), PROMPT, 12, keep_logits=True, **options)
    assert not same_report(fast, other)


def test_the_shortcut_replaces_the_greedy_steps_only():
    model = Counting(CFG, PARAMS, "f64")
    check_cache(model, PROMPT, 12, scenarios="decode", follow="cache")
    assert model.calls == {"decode_greedy": 1, "decode": 12}  # its own decode calls, inside the one hook call
    model = Counting(CFG, PARAMS, "f64")
    check_cache(model, PROMPT, 12, scenarios="decode", fast=False)  # the recompute's tokens: step by step
    assert model.calls == {"decode_greedy": 0, "decode": 12}


def test_a_shortcut_that_feeds_other_tokens_cannot_pass_for_its_decode():
    """The checker derives the tokens fed from the rows it gets: following the cache, a hook that fed others is
    compared with the recompute of the sequence it claims, and differs. Following the recompute, its rows only
    find the tokens: they differ from the recompute's, and the scenario is judged on ``decode`` step by step fed
    the recompute's tokens (exact here: the model's decode is)."""
    assert check_cache(KvfastModel(CFG, PARAMS, "f64"), PROMPT, 12, scenarios="decode", follow="cache").passed
    report = check_cache(OffByOne(CFG, PARAMS, "f64"), PROMPT, 12, scenarios="decode", follow="cache")
    assert not report.passed
    assert report.scenarios["decode"].first_divergent_step == 2
    shared = check_cache(OffByOne(CFG, PARAMS, "f64"), PROMPT, 12, scenarios="decode", keep_logits=True)
    slow = check_cache(StepByStep(CFG, PARAMS, "f64"), PROMPT, 12, scenarios="decode", keep_logits=True)
    assert shared.passed and any("greedy token differs from the recompute's at step 2" in n for n in shared.notes)
    assert shared.scenarios["decode"].cache_logits.tobytes() == slow.scenarios["decode"].cache_logits.tobytes()


def test_a_declining_shortcut_is_decoded_step_by_step():
    declined = check_cache(Declines(CFG, PARAMS, "f64", "stale"), PROMPT, 12, keep_logits=True, follow="cache")
    slow = check_cache(StepByStep(CFG, PARAMS, "f64", "stale"), PROMPT, 12, keep_logits=True, follow="cache")
    assert same_report(declined, slow)
    assert not declined.passed  # control: the bug is still found


def test_a_shortcut_that_raises_or_returns_non_finite_logits_is_the_models_failure():
    with pytest.raises(ModelUnderTestError, match=r"^model.decode_greedy\(\d+, 12\) raised RuntimeError: the hook"):
        check_cache(Breaks(CFG, PARAMS, "f64"), PROMPT, 12, follow="cache")
    with pytest.raises(ValueError, match=r"^model.decode_greedy of steps 1-12 \(positions 5-16\): logits hold nan "):
        check_cache(NonFinite(CFG, PARAMS, "f64"), PROMPT, 12, follow="cache")
