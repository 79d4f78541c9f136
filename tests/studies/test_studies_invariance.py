"""The per-layer invariance study on a small case set, in all three presets."""

from __future__ import annotations

import pandas as pd
import pytest

from kvfast.studies import STUDIES, invariance
from kvfast.sweep import run_inline
from kvfast.sweep.grid import load_grid


def small_cases() -> list[dict]:
    cases = []
    for preset in ("f64", "f32", "bf16"):
        for causal in (True, False):
            for n_layer, n_head, prompt_len, seed in ((3, 2, 1, 0), (3, 1, 6, 1), (2, 4, 11, 2)):
                cases.append(
                    {
                        "preset": preset,
                        "causal": causal,
                        "seed": seed,
                        "n_layer": n_layer,
                        "n_head": n_head,
                        "d_model": 16,
                        "d_ff": 32,
                        "vocab": 32,
                        "prompt_len": prompt_len,
                    }
                )
    return cases


@pytest.fixture(scope="module")
def runs() -> pd.DataFrame:
    return run_inline(small_cases(), study="invariance")


def test_mask_on_is_exactly_zero_at_every_layer(runs):
    on = runs[runs["causal"]]
    assert len(on) == 9
    for _, r in on.iterrows():
        assert len(r["resid_dev"]) == r["n_layer"] + 1 and len(r["k_dev"]) == len(r["v_dev"]) == r["n_layer"]
        assert all(x == 0.0 for x in [*r["resid_dev"], *r["k_dev"], *r["v_dev"], r["logits_dev"]])
        assert r["max_dev"] == 0.0


def test_mask_off_is_exact_at_layer_1_and_moves_from_layer_2(runs):
    off = runs[~runs["causal"]]
    assert set(off["preset"]) == {"f64", "f32", "bf16"}
    for _, r in off.iterrows():
        assert r["resid_dev"][0] == 0.0 and r["k_dev"][0] == 0.0 and r["v_dev"][0] == 0.0
        assert r["resid_dev"][1] > 0.0  # layer 1's output already moved: it feeds layer 2
        for layer in range(1, r["n_layer"]):
            assert r["resid_dev"][layer] > 0.0 and r["k_dev"][layer] > 0.0 and r["v_dev"][layer] > 0.0
        assert r["logits_dev"] > 0.0


def test_summary_and_claims(runs):
    table = invariance.summarize(runs)
    assert set(table["preset"]) == {"f64", "f32", "bf16"}
    on = table[table["causal"]]
    assert (on[["resid_in", "k", "v", "resid_out"]].to_numpy() == 0.0).all()
    off = table[~table["causal"]]
    assert (off[off["layer"] == 1][["resid_in", "k", "v"]].to_numpy() == 0.0).all()
    assert (off[off["layer"] >= 2]["k_min"] > 0.0).all()
    claims = invariance.claims(runs)
    assert len(claims) == 3 and all(c.holds for c in claims)


def test_runs_are_deterministic():
    case = small_cases()[-1]
    a, b = invariance.run(case), invariance.run(case)
    assert a == b


def test_built_in_grid():
    cases = load_grid("invariance").configs
    assert len(cases) == 192
    df = pd.DataFrame(cases)
    assert set(df["preset"]) == {"f64", "f32", "bf16"} and set(df["causal"]) == {True, False}
    assert (df["n_layer"] >= 2).all()
    for c in cases:
        invariance.validate_config(c)
    assert STUDIES["invariance"] is invariance.STUDY


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"causal": 1}, "causal: 1 is not allowed; allowed: True, False"),
        ({"preset": "f16"}, "preset: 'f16' is not allowed"),
        ({"prompt_len": 0}, "prompt_len: 0 is not allowed"),
        ({"n_head": 3}, "d_model: 16 is not allowed with n_head=3"),
    ],
)
def test_bad_config_is_a_value_error(change, message):
    with pytest.raises(ValueError, match=message):
        invariance.validate_config({**small_cases()[0], **change})


def test_the_figures_table_shows_mask_on_exact_and_mask_off_moving_from_layer_2(runs):
    table = invariance.layer_table(runs)
    assert list(table.columns) == invariance.LAYER_COLUMNS
    on, off = table[table["mask"] == "on"], table[table["mask"] == "off"]
    assert (on["exact_runs"] == on["runs"]).all() and (on[["k_max", "v_max", "resid_in_max"]] == 0.0).all().all()
    first, later = off[off["layer"] == 1], off[off["layer"] >= 2]
    assert (first["exact_runs"] == first["runs"]).all()
    assert (later["exact_runs"] == 0).all() and (later["kv_min"] > 0.0).all()
    assert set(table["preset"]) == {"f64", "f32", "bf16"} and len(table) == 3 * 2 * 3
