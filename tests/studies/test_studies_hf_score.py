"""The anchors' cache tests scored on Hugging Face models through the one scoring path (the hf_score study).

One tiny Llama per dtype (float32, bfloat16), one prompt of 4 tokens, a given continuation of 8 tokens, every
bug of HF_BUGS and a clean control: the scores, steps and AUCs asserted here follow from where each bug first
acts (kvfast.bugs.hf.first_acting_step: window at step 5 for this prompt, posoff 1, freeze 2, f16 0 (resume),
restart 1 and replay 0 in the resume scenario only).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

from kvfast.bugs.hf import HF_BUGS, HF_LOGIC_BUGS, first_acting_step  # noqa: E402
from kvfast.bugs.score import markdown, score_detector  # noqa: E402
from kvfast.studies.hf_score import DETECTORS, HFCase, kvfast_control, score_table  # noqa: E402
from kvfast.sweep import run_inline  # noqa: E402

STEPS = 8
GRID = {
    "study": "hf_score",
    "fixed": {"family": "llama", "attention": "sdpa", "seed": 0, "prompt": 0, "steps": STEPS},
    "axes": {"dtype": ["float32", "bfloat16"], "bug": ["none", *HF_BUGS]},
}


@pytest.fixture(scope="module")
def runs():
    return run_inline(GRID)


@pytest.fixture(scope="module")
def few(runs):
    config = [c for c in runs.columns if c in ("family", "dtype", "attention", "seed", "prompt", "steps", "bug")]
    return [HFCase(row) for row in runs[config].to_dict("records")]


@pytest.fixture(scope="module")
def table(runs):
    return score_table(runs).drop(columns="attention").set_index(["dtype", "bug"])


def test_cases_are_hf_bugs_and_clean_controls(few):
    assert len(few) == 2 * (len(HF_BUGS) + 1)
    assert {c.bug for c in few} == {None, *HF_BUGS}
    case = few[1]
    assert isinstance(case, HFCase) and case.steps == STEPS and case.prompt.shape == (4,)
    assert case.config == {"family": "llama", "dtype": "float32", "attention": "sdpa", "seed": 0, "prompt": 0,
                           "steps": STEPS, "bug": case.bug}  # fmt: skip
    adapter = case.model()
    assert adapter.bug == case.bug and case.model() is not adapter


def test_the_table_has_recall_steps_auc_and_fpr_per_dtype(table):
    for dtype in ("float32", "bfloat16"):
        assert table.loc[(dtype, "all"), "cases"] == len(HF_BUGS)
        for name in DETECTORS:
            for col in ("recall", "steps", "auc", "fpr"):
                assert f"{name}.{col}" in table.columns


def test_the_promoted_check_finds_every_bug_where_it_first_acts(table, few):
    prompt_len = few[0].prompt.shape[0]
    for dtype in ("float32", "bfloat16"):
        assert table.loc[(dtype, "all"), "kvfast_promoted.fpr"] == 0.0
        assert table.loc[(dtype, "all"), "kvfast_control.fpr"] == 0.0
        for bug in HF_BUGS:
            row = table.loc[(dtype, bug)]
            acts = [first_acting_step(bug, name, prompt_len) for name in ("decode", "resume")]
            first = min(s for s in acts if s is not None)
            assert row["kvfast_promoted.recall"] == 1.0 and row["kvfast_promoted.auc"] == 1.0, (dtype, bug)
            assert row["kvfast_promoted.steps"] == first, (dtype, bug)
            if dtype == "float32" and bug in HF_LOGIC_BUGS:
                assert row["kvfast_control.recall"] == 1.0 and row["kvfast_control.steps"] == first, bug


def test_the_three_token_check_never_resumes(table):
    for dtype in ("float32", "bfloat16"):
        for bug in ("restart", "replay"):  # they act in the resume scenario only: the same score as clean
            assert table.loc[(dtype, bug), "three_token_allclose.recall"] == 0.0
            assert table.loc[(dtype, bug), "three_token_allclose.auc"] == 0.5
        # a growing window acts at step 5 and a frozen key at step 2: after its one compared step
        for bug in ("window", "freeze"):
            assert table.loc[(dtype, bug), "three_token_allclose.recall"] == 0.0
    assert table.loc[("float32", "posoff"), "three_token_allclose.steps"] == 1


def test_exact_mode_flags_clean_sdpa_models_in_float32(table):
    assert table.loc[("float32", "all"), "kvfast_exact.fpr"] == 1.0  # order noise: what control mode is for
    assert table.loc[("float32", "all"), "kvfast_exact.auc"] == 1.0  # ... but its deviation ranks the bugs


def test_markdown_has_a_dtype_column(table):
    text = markdown(table.reset_index()[["bug", "dtype", *table.columns]])
    lines = text.splitlines()
    assert lines[0].startswith("| bug | dtype | cases | three_token_allclose: recall, steps, AUC")
    assert len(lines) == 2 + 2 * (len(HF_BUGS) + 1)
    assert "| all | bfloat16 | 6 |" in text


def test_the_catalogue_is_checked(few):
    with pytest.raises(ValueError, match="cases: bug 'window' is not allowed; allowed: None, stale"):
        score_detector(kvfast_control, few)  # kvfast's own catalogue by default
    with pytest.raises(ValueError, match="bugs: 'window' is not allowed"):
        score_detector(kvfast_control, few, bugs="window")
    got = score_detector(lambda model, case: np.float64(case.bug is not None), few[:7], bugs=HF_BUGS)
    assert list(got["bug"]) == [*HF_BUGS, "all"] and (got["recall"] == 1.0).all()


def test_the_stored_detections_score_as_the_detectors_run_directly(few, table):
    """The study stores each detector's detections; scoring them is the one scoring path over the cases."""
    from kvfast.bugs.score import compare_detectors

    for dtype in ("float32", "bfloat16"):
        direct = compare_detectors(DETECTORS, [c for c in few if c.config["dtype"] == dtype], HF_BUGS)
        stored = table.xs(dtype, level="dtype").reset_index()
        assert stored.equals(direct[stored.columns]), dtype
