"""One function per layer and direction.

Forward functions take the kernel codes of a :class:`~kvfast.numerics.Numerics`
(``nx``: its :class:`~kvfast.kernels.precision.Formats`) and run on the explicit-order kernels; the
norms, projections and MLP run in the block of :mod:`kvfast.model.block`, the
very code of the compiled forward and the decode.
Backward functions are float64: gradients are for training and the gradient
check, where the summation order is not the experiment, but their products run
on the sequential float64 kernel (:func:`product`), never on NumPy's BLAS,
whose kernel (and so the last bits of every gradient) depends on the CPU it
runs on: a trained model's numbers must depend only on its config.

Shapes: T positions, d = d_model, f = d_ff, H heads of width hd = d / H,
S key positions (S = T without a cache).
"""

from __future__ import annotations

import math

import numpy as np

from kvfast.kernels.attention import attention_into
from kvfast.kernels.matmul import matmul
from kvfast.kernels.precision import F64, Formats
from kvfast.kernels.reduce import SEQUENTIAL
from kvfast.kernels.rowops import embed_into, exp_array, log_array
from kvfast.model.block import Activations, attention_input_into, block_output_into, head_into

# --- embedding: x (T, d) = wte[tokens] + wpe[positions] -----------------------------------


def embedding_forward(wte, wpe, tokens, positions, nx: Formats) -> np.ndarray:
    x = np.empty((tokens.shape[0], wte.shape[1]))
    embed_into(wte, wpe, tokens, positions, nx[0], x)
    return x


def embedding_backward(dx, tokens, positions, vocab: int, max_pos: int):
    dwte = np.zeros((vocab, dx.shape[1]))
    dwpe = np.zeros((max_pos, dx.shape[1]))
    np.add.at(dwte, tokens, dx)
    np.add.at(dwpe, positions, dx)
    return dwte, dwpe


# --- the block around attention and the head: kvfast.model.block, the code of every forward --
#
# Run here as Python (``.py_func``: the block's own source) calling the compiled kernels, the very
# ``matmul_into``, ``rmsnorm_into`` ... the compiled forward links: compiling the three block functions
# for Python would link and optimise every kernel below them three times more (about 18 s of a cold
# start that also trains; ``benchmarks/compile_profile.py --reproduce``).
#
# attention_input_forward: h = rmsnorm(x) * g1; q, k, v = h @ wq, h @ wk, h @ wv
# block_output_forward:    x_mid = x + y @ wo; h2 = rmsnorm(x_mid) * g2; u = h2 @ w1; a = silu(u);
#                          x_out = x_mid + a @ w2
# head_forward:            hf = rmsnorm(x) * gf; logits = hf @ w_out


def attention_input_forward(w, layer: int, x, eps: float, nx: Formats):
    """Returns ``(h, inv1, q, k, v)``: (T, d), (T,), then (T, d) each (``w``: the stacked weights)."""
    acts = _activations(x, None, w)
    attention_input_into.py_func(None, w, layer, eps, nx, acts)
    return acts.h, acts.inv1, acts.q, acts.k, acts.v


def block_output_forward(w, layer: int, x, y, eps: float, nx: Formats):
    """Returns ``(x_mid, h2, inv2, u, a, x_out)``: (T, d), (T, d), (T,), (T, f), (T, f), (T, d)."""
    acts = _activations(x, y, w)
    block_output_into.py_func(None, w, layer, eps, nx, acts)
    return acts.x_mid, acts.h2, acts.inv2, acts.u, acts.a, acts.x_out


def head_forward(w, x, eps: float, nx: Formats):
    """Returns ``(hf, invf, logits)``: (T, d), (T,), (T, vocab)."""
    T, d = x.shape
    hf, invf, logits = np.empty((T, d)), np.empty(T), np.empty((T, w.w_out.shape[1]))
    head_into.py_func(None, w, eps, nx, x, hf, invf, logits)
    return hf, invf, logits


def _activations(x, y, w) -> Activations:
    """A fresh :class:`~kvfast.model.block.Activations` record around the layer's input ``x`` (and attention's
    output ``y``): every other tensor its own new array, as the tape keeps them."""
    T, d = x.shape
    f = w.w1.shape[2]
    rows, norms, wide = (lambda: np.empty((T, d))), (lambda: np.empty(T)), (lambda: np.empty((T, f)))
    return Activations(
        x, rows(), norms(), rows(), rows(), rows(), rows() if y is None else y, rows(), rows(), norms(), wide(), wide(),
        rows(),
    )  # fmt: skip


# --- rmsnorm: h (T, d) = x / sqrt(mean(x^2) + eps) * g ----------------------------------------


def rmsnorm_backward(dh, x, g, inv):
    d = x.shape[1]
    gdh = dh * g
    # inv * inv * inv, not inv**3: NumPy's power picks its code by the CPU's SIMD features
    dx = inv[:, None] * gdh - x * (inv * inv * inv)[:, None] * (gdh * x).sum(axis=1, keepdims=True) / d
    dg = (dh * x * inv[:, None]).sum(axis=0)
    return dx, dg


# --- linear: y (T, m) = x (T, n) @ w (n, m) ------------------------------------------------


def product(a, b) -> np.ndarray:
    """``a @ b`` in float64, each element summed in sequential order: the same bits on every machine."""
    return matmul(np.ascontiguousarray(a), np.ascontiguousarray(b), F64, F64, SEQUENTIAL)


def linear_backward(dy, x, w):
    return product(dy, w.T), product(x.T, dy)


# --- attention: y (T, d) from q (T, d) over k, v (S, d), H heads ---------------------------


def attention_forward(
    q,
    k,
    v,
    n_head: int,
    causal: bool,
    nx: Formats,
    pos0: int = 0,
    keep_att: bool = False,
    attn: tuple[int, int] = (0, 0),
):
    """Row t sits at position ``pos0 + t`` and, under the mask, sees keys ``0..pos0+t``.

    Returns ``(y, att)``; ``att`` (H, T, S) is filled only with ``keep_att``.
    ``attn`` = ``Numerics.attention_codes`` (mode, block); ``keep_att`` needs the
    standard mode (0).
    """
    T, d = q.shape
    n_keys = pos0 + T if causal else k.shape[0]
    y = np.empty((T, d))
    att = np.zeros((n_head, T, n_keys)) if keep_att else np.empty((0, 0, 0))
    scale = 1.0 / math.sqrt(d // n_head)
    attention_into(q, k, v, pos0, n_keys, causal, n_head, scale, nx[0], nx[1], nx[2], y, att, attn[0], attn[1])
    return y, att


def attention_backward(dy, q, k, v, att, n_head: int):
    """Gradients of ``y = softmax(q k^T * scale) v`` per head (att from the forward)."""
    T, d = q.shape
    hd = d // n_head
    scale = 1.0 / math.sqrt(hd)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for h in range(n_head):
        cols = slice(h * hd, (h + 1) * hd)
        p = att[h]
        dv[:, cols] = product(p.T, dy[:, cols])
        dp = product(dy[:, cols], v[:, cols].T)
        ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
        dq[:, cols] = product(ds, k[:, cols]) * scale
        dk[:, cols] = product(ds.T, q[:, cols]) * scale
    return dq, dk, dv


# --- silu: a = u * sigmoid(u) -------------------------------------------------------------


def silu_backward(da, u):
    sig = 1.0 / (1.0 + exp_array(-u))
    return da * sig * (1.0 + u * (1.0 - sig))


# --- cross entropy: mean over positions of -log softmax(logits)[target] --------------------


def cross_entropy_forward(logits, targets):
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = exp_array(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    rows = np.arange(targets.shape[0])
    loss = float(-np.mean(log_array(probs[rows, targets])))
    return loss, probs


def cross_entropy_backward(probs, targets):
    dlogits = probs.copy()
    dlogits[np.arange(targets.shape[0]), targets] -= 1.0
    return dlogits / targets.shape[0]
