"""Detector scoring (checked against scikit-learn and a brute-force count) and the detector study."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from kvfast.bugs.score import confusion, detector_metrics, median_detection_step, roc_auc
from kvfast.model.bugs import BUGS, EVICT_WINDOW, VISIBLE_AT_STEP_1
from kvfast.studies import STUDIES, detector
from kvfast.sweep import run_inline
from kvfast.sweep.grid import load_grid


def brute_auc(scores, labels) -> Fraction:
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(Fraction(1) if p > n else Fraction(1, 2) if p == n else Fraction(0) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(8))
def test_auc_is_mann_whitney_with_ties_half_and_agrees_with_sklearn(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    labels = rng.random(n) < 0.6
    labels[0], labels[1] = True, False
    # few distinct values: many ties, within and across classes
    scores = rng.integers(0, 5, size=n) * 0.25 if seed % 2 else rng.standard_normal(n)
    ours = roc_auc(scores, labels)
    exact = brute_auc(scores, labels)
    assert ours == float(exact)  # one correctly rounded division of exact counts
    assert math.isclose(ours, roc_auc_score(labels, scores), rel_tol=1e-12, abs_tol=0.0)


def test_auc_edge_cases():
    assert roc_auc([0.0, 0.0, 0.0], [True, False, True]) == 0.5  # all tied
    assert roc_auc([3.0, 2.0, 1.0], [True, True, False]) == 1.0
    assert roc_auc([1.0, 2.0, 3.0], [True, True, False]) == 0.0
    assert roc_auc([np.inf, 1.0], [True, False]) == 1.0
    assert math.isnan(roc_auc([1.0, 2.0], [True, True]))
    with pytest.raises(ValueError, match="scores: NaN is not allowed"):
        roc_auc([np.nan, 1.0], [True, False])
    with pytest.raises(ValueError, match=r"scores: shape \(3,\) is not allowed"):
        roc_auc([1.0, 2.0, 3.0], [True, False])
    with pytest.raises(ValueError, match="labels: values other than"):
        roc_auc([1.0, 2.0], [2, 0])


def test_confusion_counts():
    flags = [True, True, False, False, True]
    labels = [True, False, True, False, True]
    c = confusion(flags, labels)
    assert (c.tp, c.fp, c.tn, c.fn) == (2, 1, 1, 1)
    assert (c.recall, c.precision, c.fpr) == (2 / 3, 2 / 3, 1 / 2)
    none = confusion([False, False], [True, False])
    assert math.isnan(none.precision) and none.recall == 0.0 and none.fpr == 0.0
    m = detector_metrics(np.array(flags), [5.0, 4.0, 0.0, 0.0, 3.0], labels)
    assert m["auc"] == float(brute_auc([5.0, 4.0, 0.0, 0.0, 3.0], labels))
    with pytest.raises(ValueError, match="flags: dtype"):
        confusion([1, 0], [True, False])


def test_median_detection_step():
    assert median_detection_step([True, True, False, True], [3, None, 1, 8]) == 5.5  # the unflagged 1 is left out
    assert math.isnan(median_detection_step([True, False], [np.nan, 2]))  # flagged, but no step reported
    assert math.isnan(median_detection_step([False, False], [1, 2]))  # nothing flagged
    with pytest.raises(ValueError, match=r"steps: shape \(1,\) is not allowed"):
        median_detection_step([True, False], [1])


def test_detector_cases_design():
    all_cases = load_grid("detector").configs
    assert len(all_cases) == 540
    assert pd.DataFrame(all_cases).groupby("model").size().to_dict() == {"random": 270, "trained": 270}
    designs = {}
    for model in ("random", "trained"):
        cases = [c for c in all_cases if c["model"] == model]
        df = pd.DataFrame(cases)
        assert (df.groupby("bug").size() == 30).all() and set(df["bug"]) == {*BUGS, "none"}
        assert len([c for c in cases if c["bug"] != "none"]) == 240
        case_cols = ["seed", "n_layer", "n_head", "prompt_len"]
        per_bug = {b: set(map(tuple, g[case_cols].to_numpy().tolist())) for b, g in df.groupby("bug")}
        assert len(per_bug["none"]) == 30 and all(s == per_bug["none"] for s in per_bug.values())
        assert (df["prompt_len"] < EVICT_WINDOW).all()
        designs[model] = per_bug
    assert designs["random"] == designs["trained"]  # the same 30 cases on both model kinds
    assert STUDIES["detector"] is detector.STUDY


def test_the_random_cases_keep_their_run_ids():
    """Adding the trained model kind added runs: the random ones are the same configs (same ids) as before."""
    from kvfast.sweep.ids import run_id

    grid = load_grid("detector")
    random = [r for r in grid.runs if r.config["model"] == "random"]
    assert len(random) == 270
    assert all(r.run_id == run_id("detector", detector.VERSION, r.config) for r in random)
    first = random[0].config
    assert first == {
        "bug": "stale", "model": "random", "seed": 10, "n_layer": 1, "n_head": 1, "d_model": 16, "d_ff": 32,
        "vocab": 32, "prompt_len": 3, "steps": 16, "preset": "f64",
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> pd.DataFrame:
    """Two cases per bug and per control, taken from the study's own random-model case list."""
    cases = [c for c in load_grid("detector").configs if c["model"] == "random"]
    picked = []
    for bug in [*BUGS, "none"]:
        mine = [c for c in cases if c["bug"] == bug]
        picked += [mine[0], mine[-1]]
    return run_inline(picked, study="detector")


def test_every_step_recall_is_one_for_every_bug_that_deviates(runs):
    s = detector.scored(runs)
    deviating = s[s["bug_present"] & (s["every_step_score"] > 0)]
    assert set(deviating["bug"]) == set(BUGS)
    assert deviating["every_step_flag"].all()
    table = detector.summarize(runs)
    row = table[(table["detector"] == "every-step") & (table["scope"] == "all") & (table["label"] == "bug present")]
    assert row["recall"].item() == 1.0 and row["fpr"].item() == 0.0 and row["auc"].item() == 1.0
    for bug in BUGS:
        r = table[(table["detector"] == "every-step") & (table["scope"] == bug)]
        assert r["recall"].item() == 1.0


def test_one_step_recall_is_below_one_and_misses_exactly_the_growth_bugs(runs):
    s = detector.scored(runs)
    bugged = s[s["bug_present"]]
    assert (bugged["one_step_flag"] == bugged["bug"].map(VISIBLE_AT_STEP_1)).all()
    assert not s[~s["bug_present"]]["one_step_flag"].any()
    table = detector.summarize(runs)
    for label in ("output changed", "bug present"):
        row = table[(table["detector"] == "one-step") & (table["scope"] == "all") & (table["label"] == label)]
        assert row["recall"].item() < 1.0
    row = table[(table["detector"] == "one-step") & (table["scope"] == "all") & (table["label"] == "bug present")]
    assert row["recall"].item() == 0.5  # four of the eight bugs are invisible at step 1


def test_steps_to_detection(runs):
    steps = detector.steps_to_detection(runs).set_index("bug")
    for bug in BUGS:
        if bug == "evict":
            prompts = runs[runs["bug"] == "evict"]["prompt_len"]
            assert steps.loc[bug, "steps_min"] == EVICT_WINDOW + 1 - prompts.max()
            assert steps.loc[bug, "steps_max"] == EVICT_WINDOW + 1 - prompts.min()
        else:
            expected = 1 if VISIBLE_AT_STEP_1[bug] else 2
            assert steps.loc[bug, "steps_min"] == steps.loc[bug, "steps_max"] == expected
    assert steps.loc["none", "every_step_flagged"] == 0


def test_metrics_match_an_independent_count(runs):
    """The summary's figures recomputed by hand from the run columns."""
    table = detector.summarize(runs)
    bugged = runs[runs["bug"] != "none"]
    changed = bugged["tokens_changed"].to_numpy(bool)
    one_flag = bugged["first_bad_step"].isin([0, 1]).to_numpy()
    row = table[(table["detector"] == "one-step") & (table["scope"] == "all") & (table["label"] == "output changed")]
    assert row["cases"].item() == len(bugged) and row["positives"].item() == int(changed.sum())
    assert row["recall"].item() == (one_flag & changed).sum() / changed.sum()
    every = bugged["dev_all"].to_numpy()
    row = table[(table["detector"] == "every-step") & (table["scope"] == "all") & (table["label"] == "output changed")]
    assert row["auc"].item() == float(brute_auc(every, changed))


def test_claims_on_the_small_set(runs):
    claims = {c.claim: c for c in detector.claims(runs)}
    assert claims['every-step exact check on the label "bug present" (bugged runs vs clean controls)'].holds
    assert claims["the one-step check catches none of the growth bugs"].holds


def test_trained_cases_are_scored_apart_and_keep_the_large_margins():
    """Two trained-model cases per bug beside the random ones: summaries and steps per model kind; the trained
    model's clean generations have top-2 margins far above the random models'."""
    cases = [c for c in load_grid("detector").configs if c["model"] == "trained" and c["n_layer"] == 1]
    picked = []
    for bug in ["stale", "freeze", "none"]:
        picked += [c for c in cases if c["bug"] == bug][:2]
    trained = run_inline(picked, study="detector")
    assert (trained["clean_dev"] == 0.0).all()
    assert trained["clean_margin_min"].min() > 0.5
    summary = detector.summarize(trained)
    assert set(summary["model"]) == {"trained"} and list(summary.columns[:2]) == ["model", "detector"]
    steps = detector.steps_to_detection(trained).set_index("bug")
    assert steps.loc["freeze", "steps_min"] == 2 and steps.loc["stale", "steps_max"] == 1
    assert not trained[trained["bug"] == "stale"]["tokens_changed"].any()  # the seed's 0% for stale
    claims = detector.claims(trained)
    assert [c.claim[:22] for c in claims] == ['trained "cycle" model:']  # no random runs: no seed rows
