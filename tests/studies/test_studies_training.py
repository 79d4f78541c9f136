"""The cached-prefix training study: its gradient is the gradient of its own loss, and differs from the full one."""

from __future__ import annotations

import numpy as np
import pytest

from kvfast.model import layers as L
from kvfast.model.cache import KVCache
from kvfast.model.config import ModelConfig, init_params
from kvfast.model.transformer import Weights, forward_prepared, loss_and_grads_prepared
from kvfast.studies import training as T
from kvfast.sweep.grid import load_grid

CFG = ModelConfig(vocab=8, d_model=8, n_head=2, n_layer=2, d_ff=16, max_pos=T.SEQ_LEN)
PREFIX = 6


def main_budget() -> dict:
    """The built-in grid's first run: the main budget (training.toml), seed 0, prefix 0."""
    return load_grid("training").configs[0]


def _sequence(seed: int = 0):
    inputs, targets = T.successor_batch(np.random.default_rng(seed), 1, CFG.vocab)
    return inputs[0], targets[0]


def _grads(params, x, y, prefix, detach):
    w = Weights.prepare(CFG, params, T.F64)
    return loss_and_grads_prepared(CFG, w, x, y, T.F64, loss_from=prefix, detach_kv_before=detach)


def cached_prefix_loss(
    cfg: ModelConfig, params: dict, frozen: dict, tokens: np.ndarray, targets: np.ndarray, prefix_len: int
) -> float:
    """The training study's cached-prefix loss of one sequence: prefix K/V from ``frozen`` (via a KVCache), the
    rest from ``params``.

    Mean cross-entropy over positions ``prefix_len..11``. At ``params == frozen``
    it equals the ordinary loss bit for bit (the cache is exact); its gradient
    in ``params`` at that point is the cached-prefix gradient.
    """
    f64 = T.F64
    cache = KVCache.empty(cfg, f64, tokens.shape[0])
    if prefix_len > 0:
        forward_prepared(cfg, Weights.prepare(cfg, frozen, f64), tokens[:prefix_len], f64, cache)
    logits = forward_prepared(cfg, Weights.prepare(cfg, params, f64), tokens[prefix_len:], f64, cache)
    loss, _ = L.cross_entropy_forward(logits, targets[prefix_len:])
    return loss


def _central(params, frozen, x, y, name, idx, h=1e-5):
    plus = {k: v.copy() for k, v in params.items()}
    minus = {k: v.copy() for k, v in params.items()}
    plus[name][idx] += h
    minus[name][idx] -= h
    lp = cached_prefix_loss(CFG, plus, frozen, x, y, PREFIX)
    lm = cached_prefix_loss(CFG, minus, frozen, x, y, PREFIX)
    return (lp - lm) / (2 * h)


def _sample_entries(params, per_tensor: int, seed: int):
    rng = np.random.default_rng(seed)
    for name in sorted(params):
        shape = params[name].shape
        for _ in range(per_tensor):
            yield name, tuple(int(rng.integers(0, n)) for n in shape)


def test_task_is_the_successor_of_the_prefix():
    inputs, targets = T.successor_batch(np.random.default_rng(1), 5, 16)
    assert inputs.shape == targets.shape == (5, 12)
    assert (inputs[:, 0] == T.BOS).all()
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    assert ((targets >= 1) & (targets < 16)).all()
    assert (targets[:, 6:] == targets[:, :6] % 15 + 1).all()


def test_cached_prefix_loss_equals_the_detached_forward_loss_bit_for_bit():
    params = init_params(CFG, 3)
    x, y = _sequence(3)
    loss, _ = _grads(params, x, y, PREFIX, PREFIX)
    assert cached_prefix_loss(CFG, params, params, x, y, PREFIX) == loss


def test_cached_prefix_gradient_passes_central_differences_of_its_own_loss():
    params = init_params(CFG, 3)
    frozen = {k: v.copy() for k, v in params.items()}
    x, y = _sequence(3)
    _, g_cached = _grads(params, x, y, PREFIX, PREFIX)
    _, g_full = _grads(params, x, y, PREFIX, 0)
    worst_cached, worst_full = 0.0, 0.0
    for name, idx in _sample_entries(params, 3, seed=5):
        num = _central(params, frozen, x, y, name, idx)
        scale = max(1e-3, abs(num))
        worst_cached = max(worst_cached, abs(g_cached[name][idx] - num) / scale)
        worst_full = max(worst_full, abs(g_full[name][idx] - num) / scale)
    assert worst_cached < 1e-6
    # control: the full gradient is NOT the gradient of the cached-prefix loss (the check can fail)
    assert worst_full > 1e-2


def test_cached_prefix_gradient_differs_from_the_full_one():
    params = init_params(CFG, 4)
    inputs, targets = T.successor_batch(np.random.default_rng(4), 8, CFG.vocab)
    _, g_full = T.gradients(CFG, params, inputs, targets, PREFIX, cached=False)
    _, g_cached = T.gradients(CFG, params, inputs, targets, PREFIX, cached=True)
    a, b = T._flat(g_full), T._flat(g_cached)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert cos < 1.0
    assert 0.0 < cos
    # the output head sees no prefix K/V: its gradient is the same function of the same forward
    assert (g_full["w_out"] == g_cached["w_out"]).all()
    # the key/value projections lose the prefix's contribution
    assert (g_full["h0.wk"] != g_cached["h0.wk"]).any()


def test_prefix_zero_detaches_nothing():
    params = init_params(CFG, 2)
    inputs, targets = T.successor_batch(np.random.default_rng(2), 4, CFG.vocab)
    _, g_full = T.gradients(CFG, params, inputs, targets, 0, cached=False)
    _, g_cached = T.gradients(CFG, params, inputs, targets, 0, cached=True)
    for name in g_full:
        assert (g_full[name] == g_cached[name]).all()


def test_a_short_run_is_deterministic_and_complete():
    config = dict(main_budget(), seed=1, prefix_len=6, train_steps=3, grad_batch=4, eval_size=4)
    first = T.run(config)
    assert set(first) == set(T.RESULT_FIELDS)
    assert first == T.run(config)
    assert first["grad_cosine"] < 1.0
    assert all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for k, v in first.items() if k != "tensor_names")


def test_curves_agree_with_the_run_figures_bit_for_bit():
    """The cosine curve starts at grad_cosine, the held-out curve ends at suffix_loss_*, the per-tensor lists
    follow tensor_names, and the batch losses have one value per step."""
    config = dict(main_budget(), seed=2, prefix_len=6, train_steps=7, grad_batch=4, eval_size=4)
    r = T.run(config)
    assert r["curve_steps"] == T.curve_steps(7) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert T.curve_steps(100) == list(range(0, 101, 10)) and T.curve_steps(25) == [
        0,
        2,
        4,
        6,
        8,
        10,
        12,
        14,
        16,
        18,
        20,
        22,
        24,
        25,
    ]
    for variant in ("full", "cached"):
        assert len(r[f"curve_cosine_{variant}"]) == len(r["curve_steps"]) == len(r[f"curve_suffix_loss_{variant}"])
        assert r[f"curve_cosine_{variant}"][0] == r["grad_cosine"]
        assert r[f"curve_suffix_loss_{variant}"][-1] == r[f"suffix_loss_{variant}"]
        assert len(r[f"train_loss_{variant}"]) == 7
        assert all(len(t) == len(r["tensor_names"]) for t in r[f"curve_tensor_cosine_{variant}"])
    assert r["tensor_names"] == sorted(r["tensor_names"]) and len(r["tensor_names"]) == 4 + 8 * config["n_layer"]
    assert r["train_loss_full"][0] == r["train_loss_cached"][0]  # the same first batch at the same parameters
    assert r["curve_cosine_cached"][1:] != r["curve_cosine_full"][1:]  # the two variants part after one step
    names = r["tensor_names"]
    init = dict(zip(names, r["curve_tensor_cosine_full"][0], strict=True))
    # the prefix's K/V depend on the K/V projections: their gradients differ; the output head's cannot
    assert init["h0.wk"] < 0.999 and init["h0.wv"] < 0.999
    assert init["w_out"] > 1 - 1e-12


def test_taking_curve_points_changes_no_parameter():
    config = dict(main_budget(), seed=0, prefix_len=5, train_steps=4, grad_batch=4, eval_size=4)
    for cached in (False, True):
        plain, losses, points = T.train(config, cached)
        assert points == []
        probed, losses2, points2 = T.train(config, cached, probe=lambda p: float(p["wte"].sum()))
        assert losses == losses2 and len(points2) == len(T.curve_steps(4))
        for name in plain:
            assert (plain[name] == probed[name]).all()


def test_prefix_zero_curves_are_one_training():
    config = dict(main_budget(), seed=0, prefix_len=0, train_steps=3, grad_batch=4, eval_size=4)
    r = T.run(config)
    for a, b in (("curve_cosine_full", "curve_cosine_cached"), ("train_loss_full", "train_loss_cached")):
        assert r[a] == r[b]


def test_training_config_is_validated():
    good = dict(main_budget(), seed=0, prefix_len=6)
    T.validate_config(good)
    for field, value, pattern in [
        ("prefix_len", 12, "prefix_len: 12"),
        ("lr", 0.0, "lr: 0.0"),
        ("lr", True, "lr: True"),
        ("vocab", 2, "vocab: 2"),
        ("train_steps", -1, "train_steps: -1"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            T.validate_config(dict(good, **{field: value}))


def test_grid_expands():
    grid = load_grid("training")
    assert len(grid) == 39
    assert sorted({r.config["prefix_len"] for r in grid.runs}) == list(range(12))
