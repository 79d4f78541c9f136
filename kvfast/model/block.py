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
(:func:`kvfast.model.decode.decode_kernel`) all call these three functions, so
a decode step runs the very code of a forward row, on (1, d) arrays. What
stays with each caller is the store of K/V and the attention call between the
two halves: the forward stores rows ``pos0 ..`` and attends every row
(:func:`kvfast.kernels.attention.attention_into`, which keeps the
probabilities for the tape), the decode stores one row and attends it over
the cache's ``lo .. hi-1``, where the bug catalogue's marked lines act.

The compiled forward and decode call them as ordinary jitted functions
(compiled once, linked into both: small, since the large kernels below them
are called by address, :mod:`kvfast.model.addresses`; inlined in Numba IR they
were typed and lowered again in each entry); the layer-by-layer forward
runs their Python source (``.py_func``), which calls the same compiled kernels.
The formats are run-time integers either way.
Every value is rounded as in the kernels; nothing here changes an order.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.rowops import add_into, silu_into
from kvfast.model.addresses import call_matmul, call_rmsnorm


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


@nb.njit(**JIT_OPTIONS)
def attention_input_into(kern, w, layer, x, eps, storage, acc, order, h, inv1, q, k, v) -> None:
    """``h = rmsnorm(x) * g1`` (``inv1``: each row's 1/rms) and ``q, k, v = h @ wq, h @ wk, h @ wv``.

    ``w``: :class:`~kvfast.model.block.StackedWeights`, read at ``layer``.
    Writes ``h``, ``inv1``, ``q``, ``k``, ``v``; none may overlap ``x``.
    """
    # x, h, q, k, v: (T, d); inv1: (T,)
    call_rmsnorm(kern, x, w.g1[layer], eps, storage, acc, order, h, inv1)
    call_matmul(kern, h, w.wq[layer], storage, acc, order, q)
    call_matmul(kern, h, w.wk[layer], storage, acc, order, k)
    call_matmul(kern, h, w.wv[layer], storage, acc, order, v)


@nb.njit(**JIT_OPTIONS)
def block_output_into(kern, w, layer, x, y, eps, storage, acc, order, x_mid, h2, inv2, u, a, x_out) -> None:
    """The rest of the block after attention: ``x_mid = x + y @ wo``, ``h2 = rmsnorm(x_mid) * g2``
    (``inv2``: 1/rms), ``u = h2 @ w1``, ``a = silu(u)``, ``x_out = x_mid + a @ w2``.

    ``w``: the stacked weights, read at ``layer``. ``x_out`` may be ``x``
    itself (``x`` is read only before ``x_out`` is written); no other output
    may overlap an input.
    """
    # x, y, x_mid, h2, x_out: (T, d); inv2: (T,); u, a: (T, f)
    T, d = x.shape
    o = np.empty((T, d))  # (T, d) y @ wo
    call_matmul(kern, y, w.wo[layer], storage, acc, order, o)
    add_into(x, o, storage, x_mid)
    call_rmsnorm(kern, x_mid, w.g2[layer], eps, storage, acc, order, h2, inv2)
    call_matmul(kern, h2, w.w1[layer], storage, acc, order, u)
    silu_into(u, storage, a)
    m = np.empty((T, d))  # (T, d) a @ w2
    call_matmul(kern, a, w.w2[layer], storage, acc, order, m)
    add_into(x_mid, m, storage, x_out)


@nb.njit(**JIT_OPTIONS)
def head_into(kern, w, x, eps, storage, acc, order, hf, invf, logits) -> None:
    """``hf = rmsnorm(x) * gf`` (``invf``: 1/rms) and ``logits = hf @ w_out`` (``w``: the stacked weights)."""
    # x, hf: (T, d); invf: (T,); logits: (T, vocab)
    call_rmsnorm(kern, x, w.gf, eps, storage, acc, order, hf, invf)
    call_matmul(kern, hf, w.w_out, storage, acc, order, logits)
