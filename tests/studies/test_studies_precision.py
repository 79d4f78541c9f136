"""Structural claims of the precision and near-tied studies, on small documented case sets.

Exact claims are asserted with ``==`` on bits; nothing here has a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfast.kernels.precision import to_bfloat16
from kvfast.numerics import PRESETS
from kvfast.studies import neartied, precision
from kvfast.sweep import run_inline

SMALL = {"n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32, "vocab": 32, "prompt_len": 8, "steps": 8}
WIDE = {"n_layer": 2, "n_head": 4, "d_model": 64, "d_ff": 256, "vocab": 32, "prompt_len": 16, "steps": 16}


def _run(storage: str, accum: str, attention: str = "standard", seed: int = 0, order: str = "sequential", **kw):
    config = dict(SMALL, decode_attention="same")
    config.update(kw)
    config.update(seed=seed, storage=storage, accum=accum, attention=attention, prefill_order=order)
    return precision.run(config)


# bf16 storage in the default run; f64 and f32 storage (the same bf16 accumulator, each about a minute of Numba
# compilation for its formats on 2 cores) are -m slow
@pytest.mark.parametrize(
    "storage", [pytest.param("f64", marks=pytest.mark.slow), pytest.param("f32", marks=pytest.mark.slow), "bf16"]
)
def test_orders_really_differ_with_a_bf16_accumulator(storage):
    r = _run(storage, "bf16")
    assert r["fwd_pos_agree"] < 1.0
    assert r["fwd_max_diff"] > 0.0
    assert r["fwd_first_diff"] != ""
    assert r["cache_pos_agree"] < 1.0


# The documented set: the precision grid's small models, seeds 0..3, both prefill orders, the
# standard and the aligned-block kernels.
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("attention", ["standard", "online:4", "splitkv:4"])
def test_bf16_storage_with_f64_accumulator_agrees_across_orders(seed, attention):
    for order in ("sequential", "pairwise"):
        r = _run("bf16", "f64", attention, seed=seed, order=order)
        assert r["fwd_pos_agree"] == 1.0
        assert r["fwd_values_agree"] == 1.0
        assert r["fwd_max_diff"] == 0.0
        assert r["cache_pos_agree"] == 1.0
        assert r["cache_max_diff"] == 0.0


def test_f32_accumulator_exception_is_a_one_ulp_split_in_a_wide_model():
    """The listed exception: bf16 storage + f32 accumulator, wide model, seed 2. The two orders' f32
    sums straddle a rounding boundary of the bf16 grid, so the stored values are adjacent bf16 numbers."""
    config = dict(
        WIDE,
        seed=2,
        storage="bf16",
        accum="f32",
        attention="standard",
        decode_attention="same",
        prefill_order="sequential",
    )
    r = precision.run(config)
    assert r["fwd_pos_agree"] < 1.0
    cfg, params, tokens = precision.model_for(config)
    w = precision.Weights.prepare(cfg, params, precision.numerics_for("bf16", "f32", "sequential", "standard"))
    ta = precision.full_trace(cfg, w, tokens, precision.numerics_for("bf16", "f32", "sequential", "standard"))
    tb = precision.full_trace(cfg, w, tokens, precision.numerics_for("bf16", "f32", "pairwise", "standard"))
    # the first split, in forward order
    kind = r["fwd_first_diff"].split("[")[0]
    layer = int(r["fwd_first_diff"].split("layer=")[1].split(",")[0])
    pos = int(r["fwd_first_diff"].split("pos=")[1].split(",")[0])
    col = int(r["fwd_first_diff"].split("col=")[1].split("]")[0])
    a, b = ta[kind][layer, pos, col], tb[kind][layer, pos, col]
    assert a != b
    lo, hi = min(a, b), max(a, b)
    # adjacent bfloat16 values: nothing on the bf16 grid lies strictly between them
    mid = (lo + hi) / 2
    assert to_bfloat16(np.array([mid]))[0] in (lo, hi)
    assert np.float32(lo).view(np.uint32) >> 16 in (
        (np.float32(hi).view(np.uint32) >> 16) - 1,
        (np.float32(hi).view(np.uint32) >> 16) + 1,
    )
    # the same model with an f64 accumulator: no split
    assert precision.run(dict(config, accum="f64"))["fwd_pos_agree"] == 1.0


@pytest.mark.parametrize(("storage", "accum"), [("f64", "f64"), ("f32", "f32"), ("bf16", "f32")])
def test_cache_exact_with_aligned_blocks_not_with_count_splits(storage, accum):
    for attention in ("standard", "online:4", "splitkv:4", "online:3", "splitkv:5"):
        r = _run(storage, accum, attention, seed=1)
        assert r["same_exact"] is True
        assert r["same_max_diff"] == 0.0
    for attention in ("splitcount:2", "splitcount:3"):
        r = _run(storage, accum, attention, seed=1)
        assert r["same_exact"] is False
        assert r["same_max_diff"] > 0.0


@pytest.mark.parametrize(("storage", "accum"), [("bf16", "f64"), ("bf16", "f32")])
def test_a_prefill_kernel_and_a_decode_kernel_that_round_differently_break_the_cache(storage, accum):
    """Flash-attention prefill (online:4) + flash-decoding decode (splitkv:4), both aligned, same order:
    not exact even where bf16 storage absorbs every change of summation order."""
    r = _run(storage, accum, "online:4", seed=1, decode_attention="splitkv:4")
    assert r["fwd_pos_agree"] == 1.0  # the orders alone agree here ...
    assert r["same_exact"] is False  # ... the kernels do not
    assert r["same_max_diff"] > 0.0


def test_precision_config_is_validated():
    good = dict(
        SMALL,
        seed=0,
        storage="bf16",
        accum="f64",
        attention="online:4",
        decode_attention="splitkv:4",
        prefill_order="pairwise",
    )
    precision.validate_config(good)
    for field, value, pattern in [
        ("attention", "flash:4", "attention: 'flash:4'"),
        ("attention", "online:0", "attention: 'online:0'"),
        ("attention", "online", "attention: 'online'"),
        ("decode_attention", "splitkv", "decode_attention: 'splitkv'"),
        ("storage", "fp8", "storage: 'fp8'"),
        ("prefill_order", "random", "prefill_order: 'random'"),
        ("seed", -1, "seed: -1"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            precision.validate_config(dict(good, **{field: value}))


def test_summary_and_claims_of_a_small_table():
    df = run_inline(
        {
            "study": "precision",
            "fixed": {**SMALL, "seed": 0, "decode_attention": "same"},
            "axes": {"attention": ["standard", "splitcount:3"], "prefill_order": ["sequential", "pairwise"]},
            "tied": [{"storage": ["bf16", "bf16", "bf16"], "accum": ["f64", "f32", "bf16"]}],
        }
    )
    assert len(df) == 12
    summary = precision.summarize(df)
    assert len(summary) == 6
    claims = {c.claim: c for c in precision.claims(df)}
    assert any(c.holds for c in claims.values())
    assert all(isinstance(c.kvfast_figure, str) and c.kvfast_figure for c in claims.values())


# --- near-tied --------------------------------------------------------------------------------

NT = {
    "model": "random",
    "n_layer": 2,
    "n_head": 2,
    "d_model": 16,
    "d_ff": 32,
    "vocab": 32,
    "prompt_len": 8,
    "steps": 16,
    "prefill_order": "sequential",
}


def test_twin_head_construction():
    config = dict(NT, seed=3, storage="f64", accum="f64", twin_exp=6)
    cfg, params, prompt = neartied.twin_head_model(config)
    w = params["w_out"]
    gap = (w[:, 1::2] - w[:, 0::2]) * 2.0**6
    assert prompt.shape == (8,)
    assert np.abs(gap).max() > 0.0
    r = neartied.run(config)
    assert r["twin_top2_frac"] > 0.9  # the top two are twins at (nearly) every step
    assert 0.0 < r["margin_median"] < 0.05


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_neartied_flips_only_with_a_bf16_accumulator_and_same_order_cache_is_exact(seed):
    base = dict(NT, seed=seed, twin_exp=6)
    r16 = neartied.run(dict(base, storage="bf16", accum="bf16"))
    assert r16["cached_max_diff"] > 0.0 and r16["control_max_diff"] > 0.0
    for accum in ("f64", "f32"):
        r = neartied.run(dict(base, storage="bf16", accum=accum))
        assert r["flip_cached"] is False and r["flip_control"] is False
    for storage, accum in PRESETS.values():
        r = neartied.run(dict(base, storage=storage, accum=accum))
        assert r["same_exact"] is True
        assert r["same_max_diff"] == 0.0


def test_neartied_bf16_accumulator_flips_tokens_on_this_set():
    flips = [neartied.run(dict(NT, seed=s, twin_exp=6, storage="bf16", accum="bf16")) for s in range(4)]
    assert sum(r["flip_cached"] for r in flips) > 0
    assert sum(r["flip_control"] for r in flips) > 0


def test_neartied_config_is_validated():
    good = dict(NT, seed=0, storage="bf16", accum="bf16", twin_exp=6)
    neartied.validate_config(good)
    with pytest.raises(ValueError, match="vocab: 31"):
        neartied.validate_config(dict(good, vocab=31))
    with pytest.raises(ValueError, match="twin_exp: -1"):
        neartied.validate_config(dict(good, twin_exp=-1))
    with pytest.raises(ValueError, match="accum: 'fp16'"):
        neartied.validate_config(dict(good, accum="fp16"))
    with pytest.raises(ValueError, match="model: 'pretrained' is not allowed; allowed: random, trained"):
        neartied.validate_config(dict(good, model="pretrained"))
    with pytest.raises(ValueError, match="steps: 25 is not allowed with prompt_len=8 and model=trained"):
        neartied.validate_config(dict(good, model="trained", steps=25))


def test_twin_head_on_the_trained_model():
    """The trained cycle model with its head rebuilt in twins: every other weight is the trained one, the prompt
    is in-distribution, the top two are twins at nearly every step, and a same-order cache stays bit-exact."""
    from kvfast.studies import bugs

    config = dict(NT, model="trained", seed=3, storage="bf16", accum="bf16", twin_exp=6)
    cfg, params, prompt = neartied.twin_head_model(config)
    _, trained = bugs.model_for(config)
    assert set(params) == set(trained)
    for name in trained:
        if name != "w_out":
            assert params[name] is trained[name]
    assert (params["w_out"][:, 0::2] == trained["w_out"][:, 0::2]).all()
    assert not (params["w_out"][:, 1::2] == trained["w_out"][:, 1::2]).all()
    assert (prompt[bugs.TASK_PREFIX :] == prompt[: len(prompt) - bugs.TASK_PREFIX]).all()  # the cycle task
    r = neartied.run(config)
    assert r["twin_top2_frac"] > 0.9 and r["same_exact"] is True
    assert neartied.run(dict(config, model="random")) != r


def test_grids_expand():
    from kvfast.sweep.grid import load_grid

    assert len(load_grid("precision")) == 864
    near = load_grid("neartied")
    assert len(near) == 1200
    assert sum(r.config["model"] == "random" for r in near.runs) == 600
