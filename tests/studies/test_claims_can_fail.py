"""Every claim's criterion can fail: each study's ``claims`` on a synthetic table where the claim holds, and on
the same table with one thing changed so that it must not.

The tables are built by hand (no model runs) with only the columns ``claims`` reads. A claim is found by the
start of its words; every claim a study emits on the holding table is covered by a failing case below
(``test_every_claim_has_a_failing_case``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvfast.model.bugs import BUGS, VISIBLE_AT_STEP_1
from kvfast.studies import (
    STUDIES,
    bugs,
    detector,
    exactness,
    gradcheck,
    hf_matrix,
    hf_score,
    invariance,
    neartied,
    precision,
    training,
)
from kvfast.studies import check as check_study
from kvfast.studies.criteria import DIRECTION, KINDS, judged, mcnemar_exact_p

# --- holding tables ----------------------------------------------------------------------------------------------


def exactness_table() -> pd.DataFrame:
    n = 6
    return pd.DataFrame(
        {
            "run_id": [str(i) for i in range(n)],
            "status": ["ok"] * n,
            "max_abs_dev": [0.0] * n,
            "tokens_equal": [True] * n,
        }
    )


def invariance_table() -> pd.DataFrame:
    rows = []
    for causal in (True, False):
        for seed in (0, 1):
            moved = 0.0 if causal else 0.5
            rows.append(
                {
                    "status": "ok",
                    "preset": "f64",
                    "causal": causal,
                    "n_layer": 2,
                    "prompt_len": 4,
                    "seed": seed,
                    "resid_dev": [0.0, moved, moved],
                    "k_dev": [0.0, moved],
                    "v_dev": [0.0, moved],
                }
            )
    return pd.DataFrame(rows)


SEED_CHANGED = {"stale": 0, "posoff": 25, "freeze": 24, "evict": 0, "posfrozen": 25}  # of 25: the seed's percents


def bugs_table() -> pd.DataFrame:
    rows = []
    for bug in BUGS:
        for i in range(25):
            visible = VISIBLE_AT_STEP_1[bug]
            changed = i < SEED_CHANGED.get(bug, 25)
            rows.append(
                {
                    "status": "ok",
                    "bug": bug,
                    "model": "random",
                    "dev_step1": 0.1 if visible else 0.0,
                    "dev_all": 1.0,
                    "clean_dev": 0.0,
                    "tokens_changed": changed,
                }
            )
    return pd.DataFrame(rows)


def detector_table() -> pd.DataFrame:
    """Per model kind, 240 bugged runs (180 changed) + 30 clean: one-step recall 0.500 and AUC 0.625, every-step
    1.000 / 1.000. The trained runs follow the random ones (the seed's claims count the random ones only: with the
    trained ones mixed in, "240 bugged runs" would fail)."""
    rows = []
    for model in ("random", "trained"):
        for bug in BUGS:
            visible = VISIBLE_AT_STEP_1[bug]
            for i in range(30):
                changed = i < 22 + (bug in ("stale", "posoff", "freeze", "evict"))  # 4 x 22 + 2 = 90 per class
                dev = 2.0 if changed else 1.0
                steps = [0.0, dev] + [dev] * 14 if visible else [0.0, 0.0] + [dev] * 14
                rows.append(_det_row(bug, steps, changed, model))
        for _ in range(30):
            rows.append(_det_row("none", [0.0] * 16, False, model))
    return pd.DataFrame(rows)


def _det_row(bug: str, steps: list[float], changed: bool, model: str = "random") -> dict:
    bad = [i for i, d in enumerate(steps) if d > 0]
    return {
        "status": "ok",
        "model": model,
        "clean_margin_min": 4.0 if model == "trained" else 0.02,
        "bug": bug,
        "dev_per_step": steps,
        "dev_all": max(steps),
        "first_bad_step": bad[0] if bad else -1,
        "tokens_changed": changed,
    }


def precision_table() -> pd.DataFrame:
    rows = []
    for seed in (0, 1):
        for storage in ("f64", "f32", "bf16"):
            for accum in ("f64", "f32", "bf16"):
                agree = 0.0 if accum == "bf16" else 1.0
                for attention, decode, exact in (
                    ("standard", "same", True),
                    ("online:4", "same", True),
                    ("splitcount:3", "same", False),
                    ("online:4", "splitkv:4", False),
                ):
                    rows.append(
                        {
                            "status": "ok",
                            "seed": seed,
                            "storage": storage,
                            "accum": accum,
                            "attention": attention,
                            "decode_attention": decode,
                            "fwd_pos_agree": agree,
                            "cache_pos_agree": agree,
                            "same_exact": exact,
                            "same_max_diff": 0.0 if exact else 0.01,
                        }
                    )
    return pd.DataFrame(rows)


def neartied_table() -> pd.DataFrame:
    """Random twin-head runs where every claim holds, then trained ones on which the claims are not judged (every
    run flips, so mixing them in would break the "no flip with a wide accumulator" claim)."""
    rows = []
    for storage, accum in (("bf16", "f64"), ("bf16", "f32"), ("bf16", "bf16"), ("f64", "f64"), ("f32", "f32")):
        for seed in range(24):
            tied = accum == "bf16"
            rows.append(
                {
                    "status": "ok",
                    "model": "random",
                    "storage": storage,
                    "accum": accum,
                    "twin_exp": 8,
                    "seed": seed,
                    "flip_cached": tied and seed < 3,
                    "flip_control": tied and 1 <= seed < 3,
                    "same_exact": True,
                }
            )
    trained = [dict(r, model="trained", flip_cached=True, flip_control=True) for r in rows]
    return pd.DataFrame(rows + trained)


def training_table() -> pd.DataFrame:
    rows = []
    for steps in (100, 300):
        for seed in range(3):
            rows.append(
                {
                    "status": "ok",
                    "seed": seed,
                    "prefix_len": 6,
                    "d_model": 16,
                    "train_steps": steps,
                    "grad_cosine": 0.89 + 0.01 * seed,  # the seeds' spread at initialisation: 0.02
                    "suffix_loss_full": 0.1,
                    "suffix_loss_cached": 1.0,
                    "curve_steps": [0, steps // 2, steps],
                    "curve_cosine_full": [0.89 + 0.01 * seed, 0.86, 0.95],  # lowest mean point 0.860
                }
            )
    return pd.DataFrame(rows)


def gradcheck_table() -> pd.DataFrame:
    rows = []
    for n_layer in (1, 2):
        n = 4 + 8 * n_layer
        rows.append(
            {
                "status": "ok",
                "n_layer": n_layer,
                "tensors": n,
                "rel_err": [1e-9] * n,
                "worst_rel_err": 1e-9,
                "worst_tensor": "wte",
            }
        )
    return pd.DataFrame(rows)


def check_table() -> pd.DataFrame:
    rows = []
    for bug in ("none", "posoff", "freeze"):
        for mode in ("exact", "control"):
            rows.append(
                {"run_id": f"{bug}-{mode}", "status": "ok", "factory": check_study.OWN_FACTORY[0], "bug": bug,
                 "mode": mode, "passed": bug == "none"}
            )  # fmt: skip
    return pd.DataFrame(rows)


def hf_matrix_table() -> pd.DataFrame:
    rows = [
        {"status": "ok", "bug": "none", "promote": "none", "verdict": "rounding", "logic_verdict": None,
         "logic_right_step": None},
        {"status": "ok", "bug": "none", "promote": "none", "verdict": "inconclusive", "logic_verdict": None,
         "logic_right_step": None},
        {"status": "ok", "bug": "posoff", "promote": "float64", "verdict": "bug", "logic_verdict": "bug",
         "logic_right_step": True},
        {"status": "ok", "bug": "replay", "promote": "float64", "verdict": "rounding", "logic_verdict": "bug",
         "logic_right_step": True},
    ]  # fmt: skip
    return pd.DataFrame(rows)


def hf_score_table() -> pd.DataFrame:
    rows = []
    for bug, flagged in (("none", False), ("none", False), ("posoff", True), ("replay", True)):
        row = {"status": "ok", "dtype": "float32", "attention": "sdpa", "bug": bug}
        for name in hf_score.DETECTORS:
            row.update(
                {f"{name}_flag": flagged, f"{name}_score": float(flagged), f"{name}_step": 1 if flagged else None}
            )
        rows.append(row)
    return pd.DataFrame(rows)


HOLDING = {
    "check": check_table,
    "exactness": exactness_table,
    "invariance": invariance_table,
    "bugs": bugs_table,
    "detector": detector_table,
    "precision": precision_table,
    "neartied": neartied_table,
    "training": training_table,
    "gradcheck": gradcheck_table,
    "hf_matrix": hf_matrix_table,
    "hf_score": hf_score_table,
}
MODULES = {
    "check": check_study,
    "exactness": exactness,
    "invariance": invariance,
    "bugs": bugs,
    "detector": detector,
    "precision": precision,
    "neartied": neartied,
    "training": training,
    "gradcheck": gradcheck,
    "hf_matrix": hf_matrix,
    "hf_score": hf_score,
}


def _set(df: pd.DataFrame, mask, column: str, value) -> pd.DataFrame:
    out = df.copy()
    idx = out.index[mask]
    for i in idx:
        out.at[i, column] = value
    return out


def _first(df: pd.DataFrame, mask) -> pd.Series:
    m = np.zeros(len(df), dtype=bool)
    m[np.nonzero(np.asarray(mask))[0][0]] = True
    return pd.Series(m, index=df.index)


def _bugged_exact(df):
    return (df["bug"] != "none") & (df["mode"] == "exact")


def _growth(df):
    return df["bug"].isin([b for b in BUGS if not VISIBLE_AT_STEP_1[b]])


def _visible(df):
    return df["bug"].isin([b for b in BUGS if VISIBLE_AT_STEP_1[b]])


def _unchanged_growth_made_visible(df):
    """30 changed growth-bug runs made visible at step 1: one-step recall 120/180 = 0.667."""
    out = df.copy()
    idx = out.index[_growth(out) & out["tokens_changed"]][:30]
    for i in idx:
        out.at[i, "dev_per_step"] = [0.0, 2.0] + [2.0] * 14
        out.at[i, "first_bad_step"] = 1
    return out


def _clean_deviates(df):
    out = df.copy()
    i = out.index[out["bug"] == "none"][0]
    out.at[i, "dev_per_step"] = [0.0] * 5 + [1e-300] * 11
    out.at[i, "dev_all"] = 1e-300
    out.at[i, "first_bad_step"] = 5
    return out


def _bug_never_deviates(df):
    out = df.copy()
    i = out.index[out["bug"] == "evict"][0]
    out.at[i, "dev_per_step"] = [0.0] * 16
    out.at[i, "dev_all"] = 0.0
    out.at[i, "first_bad_step"] = -1
    out.at[i, "tokens_changed"] = False
    return out


def _unchanged_above_changed(df, model="random"):
    out = df.copy()
    i = out.index[(out["model"] == model) & (out["bug"] == "posoff") & ~out["tokens_changed"]][0]
    out.at[i, "dev_per_step"] = [0.0] + [3.0] * 15
    out.at[i, "dev_all"] = 3.0
    return out


def _trained_changed_never_deviates(df):
    out = df.copy()
    i = out.index[(out["model"] == "trained") & (out["bug"] == "evict") & out["tokens_changed"]][0]
    out.at[i, "dev_per_step"] = [0.0] * 16
    out.at[i, "dev_all"] = 0.0
    out.at[i, "first_bad_step"] = -1
    return out


def _causal_layer(df, column, index, value, causal=True):
    out = df.copy()
    i = out.index[out["causal"] == causal][0]
    vals = list(out.at[i, column])
    vals[index] = value
    out.at[i, column] = vals
    return out


# (study, start of the claim's words, how to break it)
FAILING = [
    ("hf_matrix", "Hugging Face models", lambda d: _set(d, _first(d, d["bug"] == "none"), "verdict", "bug")),
    (
        "hf_matrix",
        "Hugging Face models",
        lambda d: _set(d, _first(d, d["bug"] != "none"), "logic_verdict", "inconclusive"),
    ),
    ("hf_matrix", "Hugging Face models", lambda d: _set(d, _first(d, d["bug"] != "none"), "logic_right_step", False)),
    ("hf_matrix", "Hugging Face models", lambda d: _set(d, _first(d, d["status"] == "ok"), "status", "error")),
    (
        "hf_score",
        "Hugging Face models",
        lambda d: _set(d, _first(d, d["bug"] != "none"), "kvfast_promoted_flag", False),
    ),
    ("hf_score", "Hugging Face models", lambda d: _set(d, _first(d, d["bug"] == "none"), "kvfast_promoted_flag", True)),
    ("hf_score", "Hugging Face models", lambda d: _set(d, _first(d, d["status"] == "ok"), "status", "error")),
    ("check", "check sweep", lambda d: _set(d, _first(d, d["bug"] == "none"), "passed", False)),
    (
        "check",
        "check sweep",
        lambda d: _set(d, _first(d, (d["bug"] != "none") & (d["mode"] == "exact")), "passed", True),
    ),
    ("check", "check sweep", lambda d: _set(d, _first(d, d["status"] == "ok"), "status", "error")),
    (
        "exactness",
        "cached decode == full recompute",
        lambda d: _set(d, _first(d, d["max_abs_dev"] == 0), "max_abs_dev", 5e-324),
    ),
    (
        "exactness",
        "cached decode == full recompute",
        lambda d: _set(d, _first(d, d["tokens_equal"]), "tokens_equal", False),
    ),
    (
        "exactness",
        "cached decode == full recompute",
        lambda d: _set(d, _first(d, d["status"] == "ok"), "status", "error"),
    ),
    ("invariance", "with the causal mask", lambda d: _causal_layer(d, "k_dev", 1, 5e-324)),
    ("invariance", "with the causal mask", lambda d: _causal_layer(d, "resid_dev", 2, 1e-300)),
    ("invariance", "without the mask, layer 1's K and V", lambda d: _causal_layer(d, "v_dev", 0, 1e-300, causal=False)),
    ("invariance", "without the mask, every layer from 2", lambda d: _causal_layer(d, "k_dev", 1, 0.0, causal=False)),
    ("bugs", "growth bugs are exactly 0.0", lambda d: _set(d, _first(d, _growth(d)), "dev_step1", 5e-324)),
    ("bugs", "growth bugs are exactly 0.0", lambda d: _set(d, d["bug"] == "evict", "dev_all", 0.0)),
    ("bugs", "step-1-visible bugs deviate", lambda d: _set(d, _first(d, _visible(d)), "dev_step1", 0.0)),
    ("bugs", "clean cached path", lambda d: _set(d, _first(d, d["clean_dev"] == 0), "clean_dev", 5e-324)),
    ("bugs", "stale changes", lambda d: _set(d, _first(d, d["bug"] == "stale"), "tokens_changed", True)),
    ("bugs", "posoff changes", lambda d: _set(d, _first(d, d["bug"] == "posoff"), "tokens_changed", False)),
    ("bugs", "freeze changes", lambda d: _set(d, d["bug"] == "freeze", "tokens_changed", True)),
    ("bugs", "evict changes", lambda d: _set(d, _first(d, d["bug"] == "evict"), "tokens_changed", True)),
    ("bugs", "posfrozen changes", lambda d: _set(d, _first(d, d["bug"] == "posfrozen"), "tokens_changed", False)),
    (
        "detector",
        "bugged runs whose generated output changed",
        lambda d: _set(d, _first(d, (d["bug"] != "none") & ~d["tokens_changed"]), "tokens_changed", True),
    ),
    ("detector", "one-step exact check: recall and AUC", _unchanged_growth_made_visible),
    ("detector", "every-step exact check: recall 1.000 and AUC 1.000", _unchanged_above_changed),
    ("detector", 'every-step exact check on the label "bug present"', _clean_deviates),
    ("detector", 'every-step exact check on the label "bug present"', _bug_never_deviates),
    ("detector", 'every-step exact check on the label "bug present"', lambda d: d[d["bug"] != "none"]),
    ("detector", "the one-step check catches none", _unchanged_growth_made_visible),
    ("detector", 'trained "cycle" model: every-step', lambda d: _unchanged_above_changed(d, "trained")),
    ("detector", 'trained "cycle" model: every-step', _trained_changed_never_deviates),
    (
        "precision",
        "bf16 storage + f64 accumulator",
        lambda d: _set(
            d,
            _first(d, (d["storage"] == "bf16") & (d["accum"] == "f64") & (d["attention"] == "standard")),
            "fwd_pos_agree",
            0.5,
        ),
    ),
    (
        "precision",
        "bf16 storage + f64 accumulator",
        lambda d: _set(
            d,
            _first(d, (d["storage"] == "bf16") & (d["accum"] == "f64") & (d["attention"] == "standard")),
            "cache_pos_agree",
            0.5,
        ),
    ),
    (
        "precision",
        "only a bf16 accumulator",
        lambda d: _set(
            d,
            _first(d, (d["storage"] == "bf16") & (d["accum"] == "f32") & (d["attention"] == "standard")),
            "fwd_pos_agree",
            0.9,
        ),
    ),
    (
        "precision",
        "only a bf16 accumulator",
        lambda d: _set(d, (d["storage"] == "bf16") & (d["accum"] == "bf16"), "fwd_pos_agree", 1.0),
    ),
    (
        "precision",
        "same order in prefill and decode",
        lambda d: _set(
            d,
            _first(d, (d["storage"] == "f32") & (d["accum"] == "f32") & (d["attention"] == "standard")),
            "same_exact",
            False,
        ),
    ),
    (
        "precision",
        "same order in prefill and decode",
        lambda d: _set(
            d,
            _first(d, (d["accum"] == "bf16") & (d["attention"] == "online:4") & (d["decode_attention"] == "same")),
            "same_exact",
            False,
        ),
    ),
    (
        "precision",
        "split-KV by count",
        lambda d: _set(d, _first(d, d["attention"] == "splitcount:3"), "same_exact", True),
    ),
    (
        "precision",
        "a prefill kernel and a decode kernel",
        lambda d: _set(d, _first(d, d["decode_attention"] != "same"), "same_exact", True),
    ),
    (
        "neartied",
        "near-tied model, bf16 storage + bf16 accumulator",
        lambda d: _set(d, (d["accum"] == "bf16") & (d["seed"] < 12), "flip_cached", True),
    ),
    (
        "neartied",
        "near-tied model, bf16 storage with an f32 or f64",
        lambda d: _set(d, _first(d, d["accum"] == "f32"), "flip_control", True),
    ),
    (
        "neartied",
        "near-tied model, same order",
        lambda d: _set(d, _first(d, d["storage"] == "f64"), "same_exact", False),
    ),
    (
        "neartied",
        "near-tied model, same order",
        lambda d: _set(d, _first(d, d["accum"] == "bf16"), "same_exact", False),
    ),
    (
        "training",
        "cached-prefix training: gradient cosine",
        lambda d: _set(d, _first(d, d["seed"] == 1), "grad_cosine", 1.0),
    ),
    (
        "training",
        "cached-prefix training: held-out suffix loss",
        lambda d: _set(d, d["train_steps"] == 300, "suffix_loss_cached", 0.1),
    ),
    (
        "training",
        "cached-prefix training: during full training",
        lambda d: _set(d, d["train_steps"] == 300, "curve_cosine_full", [0.9, 0.88, 0.95]),
    ),
    (
        "training",
        "cached-prefix training: during full training",
        lambda d: _set(d, d["train_steps"] == 100, "curve_cosine_full", [0.9, 0.8, 0.95]),
    ),
    ("gradcheck", "the hand-written gradient", lambda d: _set(d, _first(d, d["n_layer"] == 2), "worst_rel_err", 2e-6)),
    ("gradcheck", "the hand-written gradient", lambda d: _set(d, _first(d, d["n_layer"] == 2), "tensors", 19)),
    ("gradcheck", "the hand-written gradient", lambda d: _set(d, _first(d, d["n_layer"] == 1), "status", "error")),
]


def _claim(name: str, df: pd.DataFrame, start: str):
    found = [c for c in MODULES[name].claims(df) if c.claim.startswith(start)]
    assert len(found) == 1, f"{name}: {len(found)} claims start with {start!r}"
    return found[0]


@pytest.mark.parametrize("name", sorted(HOLDING))
def test_every_claim_holds_on_its_holding_table(name):
    claims = MODULES[name].claims(HOLDING[name]())
    assert claims, name
    for c in claims:
        assert c.holds, (name, c.claim, c.kvfast_figure, c.criterion)
        assert c.conditions and all(ok for _, ok in c.conditions)
        assert c.criterion.split(":")[0] in KINDS


@pytest.mark.parametrize(("name", "start", "breaker"), FAILING, ids=[f"{n}: {s[:40]}" for n, s, _ in FAILING])
def test_the_claim_fails_when_its_table_says_so(name, start, breaker):
    assert _claim(name, HOLDING[name](), start).holds
    broken = _claim(name, breaker(HOLDING[name]()), start)
    assert not broken.holds, (broken.kvfast_figure, broken.conditions)
    assert not all(ok for _, ok in broken.conditions)


@pytest.mark.parametrize("name", sorted(HOLDING))
def test_every_claim_has_a_failing_case(name):
    covered = {s for n, s, _ in FAILING if n == name}
    for c in MODULES[name].claims(HOLDING[name]()):
        assert any(c.claim.startswith(s) for s in covered), f"{name}: no failing case for {c.claim!r}"


def test_every_study_with_claims_is_covered():
    assert set(HOLDING) == {name for name, s in STUDIES.items() if s.claims is not None}


def test_direction_only_claims_say_so():
    found = [c for c in training.claims(training_table()) if c.claim.startswith("cached-prefix training: g")]
    found += [c for c in training.claims(training_table()) if c.claim.startswith("cached-prefix training: held")]
    assert len(found) == 2
    for c in found:
        assert c.criterion.startswith(f"{DIRECTION}:")


def test_the_closer_configurations_are_judged_apart():
    """The detector's and near-tied's seed claims count the random runs only; the trained detector row and the
    training-curve row are their own, with a criterion that is not a direction."""
    det = {c.claim: c for c in detector.claims(detector_table())}
    assert det["bugged runs whose generated output changed"].kvfast_figure == "180 of 240"
    trained = [c for c in det.values() if c.claim.startswith('trained "cycle" model')]
    assert len(trained) == 1 and trained[0].criterion.startswith("exact:")
    near = {c.claim[:40]: c for c in neartied.claims(neartied_table())}
    assert all(c.holds for c in near.values()) and len(near) == 3
    curve = [c for c in training.claims(training_table()) if c.claim.startswith("cached-prefix training: during")]
    assert len(curve) == 1 and curve[0].criterion.startswith("vs seed:")
    assert "0.860 at step 50 of 100" in curve[0].kvfast_figure and "<= 0.020" in curve[0].criterion


def test_judged_needs_a_condition_and_a_known_kind():
    assert not judged("x", "s", "k", "exact", []).holds
    assert judged("x", "s", "k", "exact", [("a", True)]).holds
    with pytest.raises(ValueError, match="kind: 'approximately' is not allowed"):
        judged("x", "s", "k", "approximately", [("a", True)])


def test_mcnemar_exact_p_values():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(1, 0) == 1.0  # 2 * P[X <= 0], X ~ B(1, 1/2) = 1.0
    assert mcnemar_exact_p(6, 0) == 2 * 0.5**6
    assert mcnemar_exact_p(3, 1) == mcnemar_exact_p(1, 3) == 2 * (1 + 4) / 16
    from scipy.stats import binomtest

    for a, b in [(5, 1), (9, 2), (4, 4), (12, 0), (7, 3)]:
        assert mcnemar_exact_p(a, b) == pytest.approx(binomtest(a, a + b, 0.5).pvalue, rel=1e-12)
