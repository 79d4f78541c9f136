"""Issue 23 findings 1 and 2: nothing crosses the protocol boundary by reference.

A clean model that returns one preallocated buffer from every call, or that writes into the token
array it is handed, is checked correctly in both modes and both scenarios (before: DIVERGENT / bug,
false failures from the checker's own bookkeeping); a real bug behind the same habits is still found.
"""

from __future__ import annotations

import numpy as np
import pytest
from toymodels import Toy

import kvfast

PROMPT = [1, 2, 3, 4, 5, 6]


class ReusedBuffers(Toy):
    """Every call returns the same preallocated output buffer (per method), overwritten by the next call."""

    def __init__(self, bug=None):
        super().__init__(bug)
        self.row = np.zeros(7)
        self.rows = np.zeros((64, 7))

    def _rows(self, out):
        self.rows[: len(out)] = out
        return self.rows[: len(out)]

    def recompute(self, tokens):
        return self._rows(super().recompute(tokens))

    def prefill(self, tokens):
        return self._rows(super().prefill(tokens))

    def extend(self, tokens):
        out = [Toy.decode(self, int(t)) for t in tokens]
        return self._rows(np.array(out))

    def decode(self, token):
        self.row[:] = super().decode(token)
        return self.row


class NoExtendReusedBuffer(ReusedBuffers):
    extend = None  # the resume scenario feeds the second chunk through decode(): one row buffer, stacked


class WritesIntoTokens(Toy):
    """Every call scribbles over the token array it was given once it is done with it."""

    def recompute(self, tokens):
        out = super().recompute(tokens)
        tokens[:] = (tokens + 1) % 7
        return out

    def prefill(self, tokens):
        out = super().prefill(tokens)
        tokens[:] = 0
        return out

    def extend(self, tokens):
        out = np.array([Toy.decode(self, int(t)) for t in tokens])
        tokens[::-1] = tokens.copy()
        return out


MODELS = [ReusedBuffers, NoExtendReusedBuffer, WritesIntoTokens]


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["exact", "control"])
@pytest.mark.parametrize("fast", [True, False])
def test_clean_model_with_hostile_buffers_passes_both_scenarios(cls, mode, fast):
    report = kvfast.check_cache(cls(), PROMPT, 10, mode=mode, fast=fast)
    want = "exact" if mode == "exact" else "rounding"
    assert report.verdict == want, report.format()
    assert {s.verdict for s in report.scenarios.values()} == {want}
    assert report.max_deviation == 0.0
    assert not any("not append-invariant" in n for n in report.notes)


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_hostile_buffers_do_not_hide_a_real_bug(cls):
    class Bugged(cls):
        def __init__(self):
            super().__init__("posfrozen")

    report = kvfast.check_cache(Bugged(), PROMPT, 10, mode="exact")
    assert report.verdict == "divergent"
    assert report.scenarios["decode"].first_divergent_step == 2  # posfrozen first acts at decode step 2


def test_kept_logits_are_the_checkers_own_copies():
    model = ReusedBuffers()
    report = kvfast.check_cache(model, PROMPT, 5, keep_logits=True, scenarios="decode")
    kept = report.scenarios["decode"].cache_logits
    model.row[:] = 99.0
    model.rows[:] = 99.0
    assert not np.shares_memory(kept, model.row) and not np.shares_memory(kept, model.rows)
    assert (kept != 99.0).all()


def test_a_model_that_writes_into_its_tokens_cannot_change_the_prompt():
    prompt = np.array(PROMPT, dtype=np.int64)
    report = kvfast.check_cache(WritesIntoTokens(), prompt, 6)
    assert prompt.tolist() == PROMPT
    assert report.prompt.tolist() == PROMPT
    assert report.verdict == "exact"
