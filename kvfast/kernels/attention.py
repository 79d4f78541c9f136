"""Causal multi-head attention of query rows over a key/value buffer.

One query row ``q[r]`` attends keys ``lo .. hi-1`` of the buffers, head by head
(heads are contiguous column slices of width ``head_dim``)::

    s_j  = round_s(dot(q_h, k_jh) * scale)          # dot in the accumulator, in order
    e_j  = round_s(exp(s_j - max_j s_j))
    z    = sum_j e_j                                 # in order, in the accumulator
    p_j  = round_s(e_j / z)
    out  = round_s(sum_j p_j * v_jh)                 # per column, in order

The same row function serves a batched prefill (every row of a prompt) and a
one-token decode (one row over the cache), so with the same order the two are
the same computation, and the cache is exact by construction of the arithmetic,
not by luck.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from kvfast.kernels.precision import rnd
from kvfast.kernels.reduce import STACK_DEPTH, new_stack, ordered_dot, ordered_sum, weighted_rows_sum

_JIT = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy"}


@nb.njit(**_JIT)
def attend_row(
    q, qr, kbuf, vbuf, lo, hi, n_head, scale, storage, acc, order, out, outr, probs, pr, scratch, sstack, vstack
):
    """Attention of ``q[qr]`` over keys ``lo..hi-1``; writes ``out[outr]``.

    ``probs`` (H, rows, keys) receives the probabilities at ``probs[h, pr, j]``
    when it has rows (for the backward pass); ``scratch`` holds >= 2*(hi-lo)
    floats; ``sstack`` is (STACK_DEPTH,) and ``vstack`` (STACK_DEPTH, >= head_dim)
    scratch for pairwise sums.
    """
    d = q.shape[1]
    hd = d // n_head
    nk = hi - lo
    scores = scratch[:nk]
    expd = scratch[nk : 2 * nk]
    qrow = q[qr]
    orow = out[outr]
    for h in range(n_head):
        c0 = h * hd
        smax = -np.inf
        for j in range(nk):
            s = rnd(ordered_dot(qrow, c0, kbuf[lo + j], c0, hd, acc, order, sstack) * scale, storage)
            scores[j] = s
            if s > smax:
                smax = s
        for j in range(nk):
            expd[j] = rnd(math.exp(scores[j] - smax), storage)
        z = ordered_sum(expd, 0, nk, acc, order, sstack)
        for j in range(nk):
            expd[j] = rnd(expd[j] / z, storage)
        if probs.shape[0] > 0:
            for j in range(nk):
                probs[h, pr, lo + j] = expd[j]
        weighted_rows_sum(expd, 0, vbuf, lo, nk, c0, hd, acc, order, orow[c0 : c0 + hd], vstack)
        for c in range(c0, c0 + hd):
            orow[c] = rnd(orow[c], storage)


@nb.njit(**_JIT)
def attention_into(q, kbuf, vbuf, pos0, n_keys, causal, n_head, scale, storage, acc, order, out, probs):
    """Attention of every row of ``q`` (T, d) over the first ``n_keys`` buffer rows.

    Row t sits at absolute position ``pos0 + t``; under the causal mask it sees
    keys ``0 .. pos0+t``, otherwise all ``n_keys``.
    """
    T = q.shape[0]
    d = q.shape[1]
    scratch = np.empty(2 * max(n_keys, 1), dtype=np.float64)
    sstack = np.empty(STACK_DEPTH, dtype=np.float64)
    vstack = new_stack(d // n_head)
    for t in range(T):
        hi = pos0 + t + 1 if causal else n_keys
        attend_row(
            q, t, kbuf, vbuf, 0, hi, n_head, scale, storage, acc, order, out, t, probs, t, scratch, sstack, vstack
        )
