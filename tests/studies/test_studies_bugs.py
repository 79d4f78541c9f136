"""The bug study on a small case set: the structural claims, the columns, determinism, bad configs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from kvfast.model.bugs import BUGS, EVICT_WINDOW, VISIBLE_AT_STEP_1
from kvfast.studies import STUDIES, bugs
from kvfast.sweep import run_inline
from kvfast.sweep.grid import load_grid

BASE = {"vocab": 32, "d_model": 16, "d_ff": 32, "steps": 16, "preset": "f64"}


def small_cases() -> list[dict]:
    """Every bug and the clean control x (random: 2 cases; trained 1 layer/1 head: 1 case)."""
    cases = []
    for bug in [*BUGS, "none"]:
        for model, seed, n_layer, n_head, prompt_len in (
            ("random", 0, 1, 2, 4),
            ("random", 1, 2, 1, 13),
            ("trained", 2, 1, 1, 7),
        ):
            cases.append(
                {
                    **BASE,
                    "bug": bug,
                    "model": model,
                    "seed": seed,
                    "n_layer": n_layer,
                    "n_head": n_head,
                    "prompt_len": prompt_len,
                }
            )
    return cases


@pytest.fixture(scope="module")
def runs() -> pd.DataFrame:
    return run_inline(small_cases(), study="bugs")


def expected_first_bad(bug: str, prompt_len: int) -> int:
    if bug == "none":
        return -1
    if bug == "evict":
        return EVICT_WINDOW + 1 - prompt_len
    return 1 if VISIBLE_AT_STEP_1[bug] else 2


def test_growth_bugs_are_exactly_zero_at_step_1_and_bite_later(runs):
    growth = runs[runs["bug"].isin([b for b in BUGS if not VISIBLE_AT_STEP_1[b]])]
    assert len(growth) == 12
    assert (growth["dev_step1"] == 0.0).all()
    assert (growth["dev_all"] > 0.0).all()
    visible = runs[runs["bug"].isin([b for b in BUGS if VISIBLE_AT_STEP_1[b]])]
    assert (visible["dev_step1"] > 0.0).all()


def test_first_bad_step_is_each_bugs_signature(runs):
    for _, r in runs.iterrows():
        assert r["first_bad_step"] == expected_first_bad(r["bug"], r["prompt_len"]), (r["bug"], r["prompt_len"])
        dev = np.asarray(r["dev_per_step"])
        assert dev.shape == (r["steps"],)
        assert dev.max() == r["dev_all"] and dev[1] == r["dev_step1"]
        if r["first_bad_step"] >= 0:
            assert (dev[: r["first_bad_step"]] == 0.0).all() and dev[r["first_bad_step"]] > 0.0


def test_clean_path_is_exact_in_every_run_and_the_control_changes_nothing(runs):
    assert (runs["clean_dev"] == 0.0).all()
    control = runs[runs["bug"] == "none"]
    assert len(control) == 3
    assert (control["dev_all"] == 0.0).all()
    assert not control["tokens_changed"].any()
    assert (control["tokens"] == control["clean_tokens"]).all()
    changed = runs["tokens"] != runs["clean_tokens"]
    assert (changed == runs["tokens_changed"]).all()


def test_trained_model_is_more_peaked_than_random(runs):
    margin = runs.groupby("model")["clean_margin_min"].min()
    assert margin["trained"] > margin["random"]


def test_runs_are_deterministic_and_fit_the_schema(runs):
    again = run_inline(small_cases()[::7], study="bugs")
    first = runs.iloc[::7].reset_index(drop=True)
    for col in bugs.RESULT_FIELDS:
        assert list(again[col]) == list(first[col]), col
    schema = pa.schema([*bugs.CONFIG_FIELDS.items(), *bugs.RESULT_FIELDS.items()])
    table = pa.Table.from_pandas(runs, schema=schema, preserve_index=False)
    assert table.num_rows == len(runs)


def test_summary_and_claims(runs):
    table = bugs.summarize(runs)
    assert list(table["bug"][table["model"] == "random"]) == [*BUGS, "none"]
    row = table[(table["model"] == "random") & (table["bug"] == "posfrozen")].iloc[0]
    assert row["seed_all_steps"] == 25.5 and row["step_1"] == 0.0 and row["first_bad_step"] == "2"
    assert np.isnan(table[table["bug"] == "kvswap"]["seed_step_1"]).all()
    claims = {c.claim: c for c in bugs.claims(runs)}
    growth = next(c for k, c in claims.items() if k.startswith("growth bugs are exactly 0.0"))
    assert growth.holds
    assert claims["clean cached path equals a full recompute (every run's control)"].holds
    assert claims["step-1-visible bugs deviate at step 1 in every run"].holds


def test_status_column_is_respected(runs):
    df = runs.assign(status="ok")
    df.loc[df["bug"] == "stale", "status"] = "error"
    assert "stale" not in set(bugs.summarize(df)["bug"])


def test_built_in_grid():
    cases = load_grid("bugs").configs
    assert len(cases) == 768
    per = pd.DataFrame(cases).groupby(["bug", "model"]).size()
    assert len(per) == 16 and (per == 48).all()
    assert all(c["prompt_len"] < EVICT_WINDOW for c in cases)
    # evict bites within the generation in every case
    assert all(EVICT_WINDOW + 1 - c["prompt_len"] <= c["steps"] - 1 for c in cases)
    for c in cases:
        bugs.validate_config(c)
    assert STUDIES["bugs"] is bugs.STUDY


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bug": "stael"}, "bug: 'stael' is not allowed; allowed: stale, posoff"),
        ({"model": "big"}, "model: 'big' is not allowed; allowed: random, trained"),
        ({"prompt_len": EVICT_WINDOW}, f"prompt_len: {EVICT_WINDOW} is not allowed"),
        ({"steps": 1}, "steps: 1 is not allowed"),
        ({"steps": 30}, "steps: 30 is not allowed; allowed: an integer >= 2, <= 29"),
        ({"n_head": 3}, "d_model: 16 is not allowed with n_head=3"),
        ({"preset": "fp8"}, "preset: 'fp8' is not allowed"),
        ({"seed": -1}, "seed: -1 is not allowed"),
    ],
)
def test_bad_config_is_a_value_error(change, message):
    case = {**small_cases()[0], **change}
    with pytest.raises(ValueError, match=message):
        bugs.validate_config(case)
