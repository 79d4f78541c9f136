"""The ``prepare_check(plan)`` hook (:mod:`kvfast.check.protocol`): the checker calls it once before any other
call of a check, with a plain record of what the check will do (:class:`~kvfast.check.protocol.CheckPlan`), and
its notes head the report's (vLLM pins its GEMMs' row count there for a bit-for-bit check:
tests/engines/test_engines_vllm.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfast.check import check_cache
from kvfast.check.protocol import CheckPlan, ModelUnderTestError
from tests.toymodels import Toy

PROMPT = [1, 2, 3, 4]
NOTE = "decode ran the recompute's arithmetic (pinned for exact mode)"


class RowCountToy(Toy):
    """A toy whose decode adds in another order than its recompute (one unit of difference at every step) unless
    it is pinned to the recompute's arithmetic: what ``prepare_check`` does in exact mode."""

    def __init__(self):
        super().__init__()
        self.pinned = False
        self.calls: list[tuple[str, object]] = []

    def prepare_check(self, plan):
        self.calls.append(("prepare_check", plan))
        self.pinned = not plan.measures_noise
        return [NOTE] if self.pinned else []

    def recompute(self, tokens):
        self.calls.append(("recompute", len(tokens)))
        return super().recompute(tokens)

    def decode(self, token):
        out = super().decode(token)
        return out if self.pinned else np.nextafter(out, np.inf)


def test_the_hook_runs_first_with_the_plan_and_its_notes_head_the_report():
    model = RowCountToy()
    report = check_cache(model, PROMPT, 6, mode="exact", split=3)
    assert report.verdict == "exact", report.format()  # unpinned, every decode step would differ by one unit
    assert report.notes[0] == NOTE
    assert [c for c, _ in model.calls][:2] == ["prepare_check", "recompute"]
    plan = model.calls[0][1]
    assert isinstance(plan, CheckPlan) and [c for c, _ in model.calls].count("prepare_check") == 1
    assert (plan.prompt.tolist(), plan.split, plan.steps, plan.scenarios) == (PROMPT, 3, 6, ("decode", "resume"))
    assert plan.measures_noise is False
    for mode in ("control", "auto"):  # both judge against the model's order noise: it runs its own arithmetic
        judged = check_cache(model, PROMPT, 6, mode=mode)
        assert not model.pinned and NOTE not in judged.notes
        assert judged.verdict == "rounding", judged.format()


def test_without_the_hook_the_same_model_is_divergent_in_exact_mode():
    class Unprepared(RowCountToy):
        prepare_check = None  # no hook (read as absent): never pinned

    assert check_cache(Unprepared(), PROMPT, 6, mode="exact").verdict == "divergent"


@pytest.mark.parametrize("notes", ["one note", [1], {"a": "b"}])
def test_notes_that_are_not_a_list_of_strings_are_bad_input(notes):
    model = RowCountToy()
    model.prepare_check = lambda options: notes
    with pytest.raises(ValueError, match="^model.prepare_check: .* allowed: None or a list of str"):
        check_cache(model, PROMPT, 4)


def test_the_hook_raising_is_the_models_error():
    model = RowCountToy()

    def fails(options):
        raise RuntimeError("no engine")

    model.prepare_check = fails
    with pytest.raises(ModelUnderTestError, match="prepare_check"):
        check_cache(model, PROMPT, 4)
