"""The transformer block and the head, written once for every forward and the decode.

    per layer:  h = rmsnorm(x) * g1;  q, k, v = h @ wq, h @ wk, h @ wv      (attention_input_into)
                y = attention(q, k, v)                                     (each caller's own)
                x_mid = x + y @ wo;  h2 = rmsnorm(x_mid) * g2;
                u = h2 @ w1;  a = silu(u);  x = x_mid + a @ w2               (block_output_into)
    hf = rmsnorm(x) * gf;  logits = hf @ w_out                              (head_into)

The compiled forward (:func:`kvfast.model.compiled.forward_kernel`), the
layer-by-layer forward that keeps the tape
(:func:`kvfast.model.transformer.forward_layers`, through
:mod:`kvfast.model.layers`) and the fused decode
(:func:`kvfast.model.generation.decode_kernel`) all call these three functions, so
a decode step runs the very code of a forward row, on (1, d) arrays. What
stays with each caller is the store of K/V and the attention call between the
two halves: the forward stores rows ``pos0 ..`` and attends every row
(:func:`kvfast.kernels.attention.attention_into`, which keeps the
probabilities for the tape), the decode stores one row and attends it over
the cache's ``lo .. hi-1``, where the bug catalogue's marked lines act.

The compiled forward and decode call the three functions through their
addresses (each compiled once, on its own: :mod:`kvfast.model.compiled`), and
they call the products and norms through theirs (:func:`call_matmul`,
:func:`call_rmsnorm`: the kernels' table, :class:`kvfast.model.compiled.Kernels`);
the layer-by-layer forward runs their Python source (``.py_func``), which calls
the same compiled kernels. The formats are run-time integers either way
(:class:`~kvfast.kernels.precision.Formats`). Every value is rounded as in the
kernels; nothing here changes an order.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from numba.extending import overload

from kvfast.kernels.indirect import through_address
from kvfast.kernels.jit import BORROWING, JIT_OPTIONS
from kvfast.kernels.matmul import MATMUL, matmul_into
from kvfast.kernels.rowops import RMSNORM, add_into, rmsnorm_into, silu_into


class StackedWeights(NamedTuple):
    """The parameters as the block (:mod:`kvfast.model.block`), the compiled forward and the decode take
    them: each per-layer tensor stacked on a leading layer axis. Fields are the parameters' short names
    (``h{l}.wq`` -> ``wq[l]``)."""

    wte: np.ndarray  # (vocab, d) token embeddings
    wpe: np.ndarray  # (max_pos, d) position embeddings
    g1: np.ndarray  # (n_layer, d) pre-attention RMSNorm gains
    wq: np.ndarray  # (n_layer, d, d)
    wk: np.ndarray  # (n_layer, d, d)
    wv: np.ndarray  # (n_layer, d, d)
    wo: np.ndarray  # (n_layer, d, d) attention output projection
    g2: np.ndarray  # (n_layer, d) pre-MLP RMSNorm gains
    w1: np.ndarray  # (n_layer, d, f) MLP in
    w2: np.ndarray  # (n_layer, f, d) MLP out
    gf: np.ndarray  # (d,) final RMSNorm gains
    w_out: np.ndarray  # (d, vocab) unembedding


class Activations(NamedTuple):
    """A block's tensors for T rows (the names of the module doc). ``x`` (and ``y``, attention's output) are the
    block's inputs; the block functions write the others. The compiled forward and decode pass one record for
    every layer (``x_out`` is ``x``: the residual stream updated in place; ``inv1``, ``inv2`` one array); the
    layer-by-layer forward a fresh one per layer (its tape keeps them)."""

    x: np.ndarray  # (T, d) the layer's input
    h: np.ndarray  # (T, d) rmsnorm(x) * g1
    inv1: np.ndarray  # (T,) 1 / rms of x
    q: np.ndarray  # (T, d)
    k: np.ndarray  # (T, d)
    v: np.ndarray  # (T, d)
    y: np.ndarray  # (T, d) attention's output, before wo
    x_mid: np.ndarray  # (T, d) x + y @ wo
    h2: np.ndarray  # (T, d) rmsnorm(x_mid) * g2
    inv2: np.ndarray  # (T,) 1 / rms of x_mid
    u: np.ndarray  # (T, f) h2 @ w1
    a: np.ndarray  # (T, f) silu(u)
    x_out: np.ndarray  # (T, d) x_mid + a @ w2


@nb.njit(**JIT_OPTIONS, inline="always")
def activations(T, d, f) -> Activations:
    """The record the compiled forward and decode pass to every layer: fresh buffers of ``T`` rows, cut from one
    allocation, ``x_out`` the same array as ``x`` and ``inv2`` as ``inv1`` (none of them is kept)."""
    block = np.empty(T * (8 * d + 2 * f + 1))
    rows = block[: T * 8 * d].reshape((8, T, d))  # x, h, q, k, v, y, x_mid, h2
    wide = block[T * 8 * d : T * (8 * d + 2 * f)].reshape((2, T, f))  # u, a
    inv = block[T * (8 * d + 2 * f) :]
    x = rows[0]
    return Activations(x, rows[1], inv, rows[2], rows[3], rows[4], rows[5], rows[6], rows[7], inv, wide[0], wide[1], x)


@nb.njit(**BORROWING)
def attention_input_into(kern, w, layer, eps, fmt, acts) -> None:
    """``h = rmsnorm(x) * g1`` (``inv1``: each row's 1/rms) and ``q, k, v = h @ wq, h @ wk, h @ wv``.

    ``w``: :class:`StackedWeights`, read at ``layer``; ``acts``: :class:`Activations` (reads ``x``, writes ``h``,
    ``inv1``, ``q``, ``k``, ``v``); ``fmt``: :class:`~kvfast.kernels.precision.Formats`.
    """
    call_rmsnorm(kern, acts.x, w.g1[layer], eps, fmt, acts.h, acts.inv1)
    call_matmul(kern, acts.h, w.wq[layer], fmt, acts.q)
    call_matmul(kern, acts.h, w.wk[layer], fmt, acts.k)
    call_matmul(kern, acts.h, w.wv[layer], fmt, acts.v)


@nb.njit(**BORROWING)
def block_output_into(kern, w, layer, eps, fmt, acts) -> None:
    """The rest of the block after attention: ``x_mid = x + y @ wo``, ``h2 = rmsnorm(x_mid) * g2``
    (``inv2``: 1/rms), ``u = h2 @ w1``, ``a = silu(u)``, ``x_out = x_mid + a @ w2``.

    ``w``: the stacked weights, read at ``layer``; ``acts``: :class:`Activations` (reads ``x``, ``y``). ``x_out``
    may be ``x`` itself (``x`` is read only before ``x_out`` is written); no other output may overlap an input.
    """
    call_matmul(kern, acts.y, w.wo[layer], fmt, acts.x_mid)  # y @ wo, then x + (y @ wo) in place
    add_into(acts.x, acts.x_mid, fmt.storage, acts.x_mid)
    call_rmsnorm(kern, acts.x_mid, w.g2[layer], eps, fmt, acts.h2, acts.inv2)
    call_matmul(kern, acts.h2, w.w1[layer], fmt, acts.u)
    silu_into(acts.u, fmt.storage, acts.a)
    call_matmul(kern, acts.a, w.w2[layer], fmt, acts.x_out)  # a @ w2 (x is read above: x_out may be x)
    add_into(acts.x_mid, acts.x_out, fmt.storage, acts.x_out)


@nb.njit(**BORROWING)
def head_into(kern, w, eps, fmt, x, hf, invf, logits) -> None:
    """``hf = rmsnorm(x) * gf`` (``invf``: 1/rms) and ``logits = hf @ w_out`` (``w``: the stacked weights)."""
    # x, hf: (T, d); invf: (T,); logits: (T, vocab)
    call_rmsnorm(kern, x, w.gf, eps, fmt, hf, invf)
    call_matmul(kern, hf, w.w_out, fmt, logits)


# --- the products and norms the block calls: by address from jitted code, the kernels themselves from Python ------

_matmul_at = through_address(MATMUL)
_rmsnorm_at = through_address(RMSNORM)


def call_matmul(kern, x, w, fmt, y) -> None:
    """``y = x @ w`` (``matmul_into``) in ``fmt``; jitted, ``matmul_with`` through ``kern``'s address of it, with
    ``kern``'s product bodies (called from every block function: linked, it was emitted again in each)."""
    matmul_into(x, w, fmt.storage, fmt.acc, fmt.order, y)


@overload(call_matmul, jit_options=BORROWING)
def _call_matmul_jitted(kern, x, w, fmt, y):
    def impl(kern, x, w, fmt, y):
        _matmul_at(kern.matmul, x, w, fmt.storage, fmt.acc, fmt.order, y, kern.products)

    return impl


def call_rmsnorm(kern, x, g, eps, fmt, out, inv) -> None:
    """``out = rmsnorm(x) * g`` (``inv``: each row's 1/rms; ``rmsnorm_into``) in ``fmt``; jitted, through
    ``kern``'s address of it."""
    rmsnorm_into(x, g, eps, fmt.storage, fmt.acc, fmt.order, out, inv)


@overload(call_rmsnorm, jit_options=BORROWING)
def _call_rmsnorm_jitted(kern, x, g, eps, fmt, out, inv):
    def impl(kern, x, g, eps, fmt, out, inv):
        _rmsnorm_at(kern.rmsnorm, x, g, eps, fmt.storage, fmt.acc, fmt.order, out, inv)

    return impl
