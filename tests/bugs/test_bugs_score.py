"""kvfast.score_detector: the three built-in detectors against the catalogue, and any user detector."""

from __future__ import annotations

import numpy as np
import pytest

from kvfast.bugs.score import DETECTORS, Detection, every_step_exact, one_step_allclose
from kvfast.model.bugs import BUGS, VISIBLE_AT_STEP_1
from kvfast.studies.detector import DetectorCase, compare_detectors, default_cases, score_detector


@pytest.fixture(scope="module")
def cases():
    """The first 6 models of the detector study's cases, for every bug and the clean control (54 cases)."""
    by_bug: dict[str, list] = {}
    for c in default_cases():
        by_bug.setdefault(c.config["bug"], []).append(c)
    return [c for group in by_bug.values() for c in group[:6]]


@pytest.fixture(scope="module")
def table(cases):
    return compare_detectors(cases=cases).set_index("bug")


def test_default_cases_are_the_detector_studys(cases):
    all_cases = default_cases()
    assert len(all_cases) == 270
    assert sum(c.bug is None for c in all_cases) == 30
    assert {c.bug for c in all_cases} == {*BUGS, None}
    assert all(c.steps == c.config["steps"] - 1 for c in all_cases)
    assert len(cases) == 6 * (len(BUGS) + 1)
    assert [c.bug is None for c in all_cases] == [False] * 240 + [True] * 30  # the bugged cases, then the controls
    shapes = {(c.config["n_layer"], c.config["n_head"], c.config["d_model"]) for c in all_cases}
    assert shapes == {(n_layer, n_head, 16) for n_layer in (1, 2, 3) for n_head in (1, 2)}


def test_every_step_exact_catches_every_bug_and_no_clean_case(table):
    for bug in BUGS:
        assert table.loc[bug, "every_step_exact.recall"] == 1.0
        assert table.loc[bug, "every_step_exact.auc"] == 1.0
    assert table.loc["all", "every_step_exact.fpr"] == 0.0


def test_one_step_tolerance_check_is_blind_to_growth_bugs(table):
    for bug in BUGS:
        if not VISIBLE_AT_STEP_1[bug]:
            # exactly 0.0 deviation at step 1: no tolerance can see it, and it ties with the clean cases
            assert table.loc[bug, "one_step_allclose.recall"] == 0.0
            assert table.loc[bug, "one_step_allclose.auc"] == 0.5
            assert table.loc[bug, "every_step_exact.steps"] >= 2
    assert table.loc["all", "one_step_allclose.recall"] < table.loc["all", "every_step_exact.recall"]


def test_token_strings_never_beat_the_every_step_check(table):
    for bug in (*BUGS, "all"):
        assert table.loc[bug, "token_strings.recall"] <= table.loc[bug, "every_step_exact.recall"]
    assert table.loc["all", "token_strings.fpr"] == 0.0


def test_table_columns(table):
    for name in DETECTORS:
        for col in ("recall", "steps", "auc", "fpr"):
            assert f"{name}.{col}" in table.columns
    assert table.loc["all", "cases"] == 6 * len(BUGS)


def test_markdown_table(table):
    from kvfast.bugs.score import markdown

    table = table.reset_index()
    text = markdown(table)
    lines = text.splitlines()
    assert len(lines) == 2 + len(table)
    assert lines[0].startswith("| bug | cases | one_step_allclose: recall, steps, AUC")
    every = table.set_index("bug").loc["all"]
    assert f"| all | {6 * len(BUGS)} |" in text and f"(FPR {every['every_step_exact.fpr']:.3f})" in text


def test_a_users_detector_may_return_a_bool_or_a_number(cases):
    few = [c for c in cases if c.config["bug"] in ("posoff", "freeze", "none")]

    def flag_only(model, case):
        return every_step_exact(model, case).flag

    def number(model, case):
        return one_step_allclose(model, case).score

    flags = score_detector(flag_only, few).set_index("bug")
    assert flags.loc["all", "recall"] == 1.0 and np.isnan(flags.loc["all", "steps_to_detection"])
    nums = score_detector(number, few).set_index("bug")
    assert nums.loc["posoff", "recall"] == 1.0 and nums.loc["freeze", "recall"] == 0.0


def test_bad_detectors_and_cases(cases):
    few = [c for c in cases if c.config["bug"] in ("posoff", "none")]
    with pytest.raises(ValueError, match="detector: 3 is not allowed"):
        score_detector(3, few)
    with pytest.raises(ValueError, match="returned 'yes'; allowed: a bool, a number"):
        score_detector(lambda m, c: "yes", few)
    with pytest.raises(ValueError, match="need both clean controls"):
        score_detector(every_step_exact, [c for c in few if c.bug])
    with pytest.raises(ValueError, match="bug 'nope' is not allowed"):
        score_detector(every_step_exact, [DetectorCase({**few[0].config, "bug": "nope"})])
    with pytest.raises(ValueError, match="cases: int is not allowed"):
        score_detector(every_step_exact, [1])
    assert isinstance(every_step_exact(few[0].model(), few[0]), Detection)


def test_the_catalogue_can_be_named(cases):
    from kvfast.bugs import score

    few = [c for c in cases if c.config["bug"] in ("posoff", "freeze", "none")]
    with pytest.raises(ValueError, match="bugs: 'posoff' is not allowed; allowed: None"):
        score.score_detector(every_step_exact, few, bugs="posoff")
    with pytest.raises(ValueError, match="cases: bug 'freeze' is not allowed; allowed: None, posoff"):
        score.score_detector(every_step_exact, few, bugs=("posoff",))
    got = score.score_detector(every_step_exact, few, bugs=("freeze", "posoff"))
    assert list(got["bug"]) == ["freeze", "posoff", "all"]  # in the catalogue's order
