"""The toy tasks, the hand-written Adam and the trained model of the bug study."""

from __future__ import annotations

import numpy as np
import pytest

from kvfast import ModelConfig, init_params
from kvfast.studies import bugs
from kvfast.studies.toytask import AdamState, CycleTask, _train_cached, adam_step, evaluate, make_batch, train


def test_cycle_task_follows_its_rule():
    rng = np.random.default_rng(0)
    x, y = make_batch(CycleTask(vocab=9, length=11, prefix=3), rng, 5)
    assert x.shape == y.shape == (5, 10) and x.dtype == y.dtype == np.int64
    seq = np.concatenate([x, y[:, -1:]], axis=1)
    assert (y == seq[:, 1:]).all()
    assert (seq[:, 3:] == seq[:, :-3]).all()
    assert CycleTask(vocab=9, length=12, prefix=6).loss_from == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab": 9, "length": 3, "prefix": 3}, "length: 3 is not allowed"),
        ({"vocab": 1, "length": 9, "prefix": 3}, "vocab: 1 is not allowed"),
        ({"vocab": 9, "length": 9, "prefix": 0}, "prefix: 0 is not allowed"),
    ],
)
def test_bad_task_is_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CycleTask(**kwargs)


def test_adam_step_is_the_textbook_update():
    rng = np.random.default_rng(1)
    params = {"a": rng.standard_normal((3, 2)), "b": rng.standard_normal(4)}
    ref = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    state = AdamState.zeros(params)
    lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-8
    for t in range(1, 6):
        grads = {k: rng.standard_normal(v.shape) for k, v in params.items()}
        adam_step(params, grads, state, lr)
        for k, g in grads.items():
            m[k] = b1 * m[k] + (1 - b1) * g
            v2[k] = b2 * v2[k] + (1 - b2) * g * g
            m_hat = m[k] / (1 - b1**t)
            v_hat = v2[k] / (1 - b2**t)
            ref[k] = ref[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
    assert state.t == 5
    for k in params:
        assert np.array_equal(params[k], ref[k])


def test_adam_minimises_a_quadratic():
    params = {"x": np.array([3.0, -2.0])}
    state = AdamState.zeros(params)
    for _ in range(500):
        adam_step(params, {"x": 2.0 * params["x"]}, state, 0.05)
    assert np.abs(params["x"]).max() < 1e-2


def test_training_is_deterministic_and_memoised():
    cfg = ModelConfig(vocab=8, d_model=8, n_head=2, n_layer=1, d_ff=8, max_pos=8)
    task = CycleTask(vocab=8, length=9, prefix=2)
    a = train(cfg, task, 5, 20, 0.01)
    b = train(cfg, task, 5, 20, 0.01)
    assert all(a[k] is b[k] for k in a)  # memoised: the same arrays
    assert not a["wte"].flags.writeable
    _train_cached.cache_clear()
    c = train(cfg, task, 5, 20, 0.01)
    assert all(np.array_equal(a[k], c[k]) and a[k] is not c[k] for k in a)  # retrained, same bits
    d = train(cfg, task, 6, 20, 0.01)
    assert not np.array_equal(a["wte"], d["wte"])
    e = train(cfg, task, 5, 0, 0.01)
    assert all(np.array_equal(e[k], init_params(cfg, 5)[k]) for k in e)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": -1}, "seed: -1 is not allowed"),
        ({"steps": 1.5}, "steps: 1.5 is not allowed"),
        ({"lr": 0.0}, "lr: 0.0 is not allowed"),
        ({"batch": 0}, "batch: 0 is not allowed"),
        ({"task": CycleTask(vocab=9, length=9, prefix=2)}, "task.vocab: 9 is not allowed"),
        ({"task": CycleTask(vocab=8, length=10, prefix=2)}, "task.length: 10 is not allowed"),
    ],
)
def test_bad_training_arguments(change, message):
    cfg = ModelConfig(vocab=8, d_model=8, n_head=2, n_layer=1, d_ff=8, max_pos=8)
    args = {"config": cfg, "task": CycleTask(vocab=8, length=9, prefix=2), "seed": 0, "steps": 1, "lr": 0.01}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        train(**args)


@pytest.mark.parametrize(("n_layer", "n_head"), [(1, 1), (2, 2), (3, 2)])
def test_bug_study_trained_model_solves_its_task(n_layer, n_head):
    """The trained models of the bug study (1 layer, 1 head), the near-tied study's twin head (2, 2) and the
    detector study's deepest (3, 2): held-out loss and accuracy."""
    case = {"model": "trained", "vocab": 32, "d_model": 16, "d_ff": 32, "n_layer": n_layer, "n_head": n_head, "seed": 0}
    cfg, params = bugs.model_for(case)
    task = bugs.task_for(32)
    before = evaluate(cfg, bugs.model_for({**case, "model": "random"})[1], task, 99)
    after = evaluate(cfg, params, task, 99)
    assert after["loss"] < before["loss"] / 10
    assert after["accuracy"] >= 0.95
