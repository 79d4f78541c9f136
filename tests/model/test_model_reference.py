"""Tolerance checks of the model (kept apart from the exactness tests in test_model.py).

- An independent float64 NumPy forward, written here from the architecture's definition
  (pre-norm decoder: RMSNorm, causal multi-head attention, SiLU MLP; not from the kernels),
  agrees with ``kvfast.forward`` in the f64 preset to a relative 1e-12 (its sums run in
  NumPy's order, so bit equality is not the claim).
- The hand-written gradients agree with independently written central differences
  over every parameter tensor of a 2-layer, 2-head model; the worst relative error is
  reported and must be at most 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfast import ModelConfig, Numerics, forward, forward_trace, init_params, loss_and_grads

# --- the independent reference ------------------------------------------------------------------


def ref_rmsnorm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def ref_silu(u: np.ndarray) -> np.ndarray:
    return u / (1.0 + np.exp(-u))


def ref_softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_forward(cfg: ModelConfig, p: dict, tokens: np.ndarray, causal: bool = True) -> dict:
    """The pre-norm decoder from its definition, in float64 NumPy (no kvfast kernel)."""
    T = tokens.shape[0]
    d, H = cfg.d_model, cfg.n_head
    hd = d // H
    x = p["wte"][tokens] + p["wpe"][np.arange(T)]
    mask = np.tril(np.ones((T, T), dtype=bool)) if causal else np.ones((T, T), dtype=bool)
    resid, ks, vs = [x], [], []
    for layer in range(cfg.n_layer):
        w = {name: p[f"h{layer}.{name}"] for name in ("g1", "wq", "wk", "wv", "wo", "g2", "w1", "w2")}
        h = ref_rmsnorm(x, w["g1"], cfg.eps)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        heads = []
        for i in range(H):
            c = slice(i * hd, (i + 1) * hd)
            s = q[:, c] @ k[:, c].T / np.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            heads.append(ref_softmax(s) @ v[:, c])
        x = x + np.concatenate(heads, axis=1) @ w["wo"]
        h2 = ref_rmsnorm(x, w["g2"], cfg.eps)
        x = x + ref_silu(h2 @ w["w1"]) @ w["w2"]
        resid.append(x)
        ks.append(k)
        vs.append(v)
    logits = ref_rmsnorm(x, p["gf"], cfg.eps) @ p["w_out"]
    return {"logits": logits, "resid": np.stack(resid), "k": np.stack(ks), "v": np.stack(vs)}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


REF_CASES = [
    # (seed, vocab, d_model, n_head, n_layer, d_ff, T)
    (0, 13, 8, 2, 2, 12, 7),
    (1, 29, 16, 4, 3, 40, 11),
    (2, 7, 12, 1, 1, 8, 1),
    (3, 50, 24, 3, 4, 64, 16),
]


@pytest.mark.parametrize("order", ["sequential", "pairwise"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: f"s{c[0]}-d{c[2]}-H{c[3]}-L{c[4]}-T{c[6]}")
def test_independent_reference_agrees_to_1e_12(case, causal, order):
    seed, vocab, d, H, L, f, T = case
    cfg = ModelConfig(vocab=vocab, d_model=d, n_head=H, n_layer=L, d_ff=f, max_pos=T + 2)
    params = init_params(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, vocab, size=T)
    nx = Numerics.preset("f64", order=order)
    ref = ref_forward(cfg, params, tokens, causal)
    got = forward(cfg, params, tokens, nx, causal=causal)
    assert rel_err(got, ref["logits"]) <= 1e-12
    trace = forward_trace(cfg, params, tokens, nx, causal=causal)
    for key in ("resid", "k", "v"):
        for layer in range(trace[key].shape[0]):
            assert rel_err(trace[key][layer], ref[key][layer]) <= 1e-12, (key, layer)


def test_reference_is_sensitive():
    """Control: the 1e-12 comparison fails for a model that differs in one detail
    (the attention scale, or the mask)."""
    cfg = ModelConfig(vocab=13, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=9)
    params = init_params(cfg, 0)
    tokens = np.arange(7) % 13
    got = forward(cfg, params, tokens, "f64")
    assert rel_err(got, ref_forward(cfg, params, tokens)["logits"]) <= 1e-12
    assert rel_err(got, ref_forward(cfg, params, tokens, causal=False)["logits"]) > 1e-6
    scaled = dict(params)
    for layer in range(cfg.n_layer):
        scaled[f"h{layer}.wq"] = params[f"h{layer}.wq"] * np.sqrt(cfg.head_dim)  # as if no 1/sqrt(hd)
    assert rel_err(got, ref_forward(cfg, scaled, tokens)["logits"]) > 1e-6


# --- loss and gradient check ---------------------------------------------------------------------


def ref_cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    return float(np.mean(lse - logits[np.arange(targets.size), targets]))


def test_loss_matches_reference_cross_entropy():
    cfg = ModelConfig(vocab=13, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=9)
    params = init_params(cfg, 3)
    rng = np.random.default_rng(3)
    tokens, targets = rng.integers(0, 13, size=8), rng.integers(0, 13, size=8)
    loss, _ = loss_and_grads(cfg, params, tokens, targets, "f64")
    want = ref_cross_entropy(ref_forward(cfg, params, tokens)["logits"], targets)
    assert abs(loss - want) <= 1e-12 * abs(want)


def central_differences(cfg, params, tokens, targets, h: float) -> dict[str, np.ndarray]:
    """d loss / d theta by (L(theta + h e_i) - L(theta - h e_i)) / 2h, element by element,
    with the loss computed from kvfast.forward's logits by the reference cross-entropy."""

    def loss(p):
        return ref_cross_entropy(forward(cfg, p, tokens, "f64"), targets)

    grads = {}
    for name, arr in params.items():
        g = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            plus = {**params, name: arr.copy()}
            minus = {**params, name: arr.copy()}
            plus[name][idx] += h
            minus[name][idx] -= h
            g[idx] = (loss(plus) - loss(minus)) / (2 * h)
        grads[name] = g
    return grads


def test_gradient_check_2_layer_2_head(record_property):
    cfg = ModelConfig(vocab=7, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=6)
    params = init_params(cfg, 11)
    rng = np.random.default_rng(11)
    tokens, targets = rng.integers(0, cfg.vocab, size=5), rng.integers(0, cfg.vocab, size=5)
    loss, grads = loss_and_grads(cfg, params, tokens, targets, "f64")
    assert set(grads) == set(params)
    numeric = central_differences(cfg, params, tokens, targets, h=1e-5)
    errors = {}
    for name in params:
        assert grads[name].shape == params[name].shape
        scale = max(np.max(np.abs(numeric[name])), np.max(np.abs(grads[name])))
        assert scale > 0, f"{name}: zero gradient"
        errors[name] = float(np.max(np.abs(grads[name] - numeric[name])) / scale)
    worst = max(errors, key=errors.get)
    print(f"\ngradient check: worst relative error {errors[worst]:.2e} ({worst}) over {len(errors)} tensors")
    record_property("worst_grad_rel_err", errors[worst])
    assert len(errors) == 4 + 8 * cfg.n_layer  # every tensor
    assert errors[worst] <= 1e-6, errors
    # and the check can fail: one gradient element off by 1% is seen
    broken = grads["h1.wk"].copy()
    i = np.argmax(np.abs(broken))
    broken.flat[i] *= 1.01
    assert np.max(np.abs(broken - numeric["h1.wk"])) / np.max(np.abs(numeric["h1.wk"])) > 1e-6
