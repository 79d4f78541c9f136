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

Each score's dot product is computed four keys at a time (four independent
sums in flight, each still in its own order), which changes no bit.

Compile cost (a cold start): the row kernels (:func:`attend_row`,
:func:`attend_row_blocked`) are called through their addresses
(:mod:`kvfast.kernels.indirect`) by :func:`attention_with` (the forward's) and
the decode step, so each is compiled, and its machine code generated, once
(inlined or linked, it was generated again in each caller); :func:`score_dots`
calls the sequential body of its accumulator format by address too, compiled
on the first use of that format (:func:`dot_bodies`; the bodies are written
once, as a template, and written out per format: :mod:`kvfast.kernels.bodies`),
and the row kernels call :func:`score_dots` and the reductions
(:func:`kvfast.kernels.reduce.ordered_sum`,
:func:`kvfast.kernels.reduce.weighted_rows_sum`) by address, so these are not
optimised again inside both row kernels.

Real kernels' orders (``mode``, with an integer ``param``), per head, over the
scores ``s_j`` above (computed exactly as in the standard mode):

``ONLINE`` (flash attention), blocks of ``param`` keys aligned to absolute
positions (block b holds keys ``b*param .. (b+1)*param - 1``, clipped to the
row's range), in block order, with a running max ``m``, sum ``l`` and output ``O``::

    m' = max(m, max_block s);  alpha = round_a(exp(m - m'))   (0 for the first block)
    e_j = round_s(exp(s_j - m'))
    l = round_a(round_a(alpha * l) + sum_block e_j)           # block sum in order
    O = round_a(round_a(alpha * O) + sum_block e_j * v_j)     # per column, in order
    out = round_s(O / l)

``SPLITKV`` (flash-decoding), chunks of ``param`` keys aligned to absolute
positions; each chunk c is reduced on its own and the chunks are combined in
chunk order with log-sum-exp weights::

    m_c = max_chunk s;  e_j = round_s(exp(s_j - m_c));  l_c = sum_chunk e_j (in order)
    O_c = round_a(sum_chunk e_j * v_j / l_c);  lse_c = round_a(m_c + round_a(log(l_c)))
    M = max_c lse_c;  w_c = round_a(exp(lse_c - M));  W = round_a(w_0 + w_1 + ...)
    out = round_s(sum_c round_a(round_a(w_c / W) * O_c))    # sequential over c, in the accumulator

``SPLITCOUNT``: SPLITKV with ``param`` chunks cut by COUNT from the call's key
range ``[span_lo, span_hi)`` (chunk i starts at ``span_lo + i*(span_hi -
span_lo)//param``), as a kernel that picks its number of splits from the launch
does. The boundaries move when the cache grows, so the same key row can be cut
differently in a prefill (span = the whole batch) and in a decode (span = the
cache so far).

``round_s``/``round_a`` round to the storage/accumulator format. Keys ``lo..hi-1``
of a row intersected with each block; empty intersections are skipped.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from numba import types

from kvfast.kernels.bodies import MAC, MUL, body_name, specialise
from kvfast.kernels.indirect import address, through_address
from kvfast.kernels.jit import JIT_OPTIONS as _JIT
from kvfast.kernels.precision import BF16, F32, F64, rnd
from kvfast.kernels.reduce import (
    SEQUENTIAL,
    STACK_DEPTH,
    new_stack,
    ordered_dot,
    ordered_sum,
    sequential_rows_sum,
    sequential_sum,
    weighted_rows_sum,
)

STANDARD = 0
ONLINE = 1
SPLITKV = 2
SPLITCOUNT = 3

ATTENTION_CODES = {"standard": STANDARD, "online": ONLINE, "splitkv": SPLITKV, "splitcount": SPLITCOUNT}
ATTENTION_NAMES = {code: name for name, code in ATTENTION_CODES.items()}

_I, _F = types.int64, types.float64
_A1, _A2, _A3 = (types.Array(types.float64, n, "C") for n in (1, 2, 3))


def _dots_sequential_template(qrow, c0, kbuf, lo, nk, hd, out):
    """``out[j] = ordered_dot(qrow[c0:], kbuf[lo + j, c0:], hd)`` in sequential order for j < nk, products
    and sums rounded to the body's accumulator format (:mod:`kvfast.kernels.bodies`): four keys at a time,
    so four independent sums (each still left to right over the head's columns) are in flight instead of
    one; ``hd`` >= 1. Keys are indexed in place (a row view costs a reference count each)."""
    j = 0
    while j + 4 <= nk:
        r = lo + j
        a = qrow[c0]
        s0, s1, s2, s3 = MUL(a, kbuf[r, c0]), MUL(a, kbuf[r + 1, c0]), MUL(a, kbuf[r + 2, c0]), MUL(a, kbuf[r + 3, c0])
        for c in range(c0 + 1, c0 + hd):
            a = qrow[c]
            s0 = MAC(s0, a, kbuf[r, c])
            s1 = MAC(s1, a, kbuf[r + 1, c])
            s2 = MAC(s2, a, kbuf[r + 2, c])
            s3 = MAC(s3, a, kbuf[r + 3, c])
        out[j], out[j + 1], out[j + 2], out[j + 3] = s0, s1, s2, s3
        j += 4
    while j < nk:
        r = lo + j
        s0 = MUL(qrow[c0], kbuf[r, c0])
        for c in range(c0 + 1, c0 + hd):
            s0 = MAC(s0, qrow[c], kbuf[r, c])
        out[j] = s0
        j += 1


def _dot_kernel(acc: int):
    """The sequential score-dot body of ``acc`` (float64 data), generated (not compiled) on the first request."""
    kernel = globals().get(body_name(_dots_sequential_template, acc, False))
    return kernel if kernel is not None else specialise(_dots_sequential_template, acc, False)


def __getattr__(name: str):
    if name == "DOT_KERNELS":  # the three bodies, in the order of a dot_bodies table (generated on first use)
        return tuple(_dot_kernel(acc) for acc in (F64, F32, BF16))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DOT_BODY = (_A1, _I, _A2, _I, _I, _I, _A1)
"""The signature every ``DOT_KERNELS`` body is compiled for."""

_dots_at = through_address(DOT_BODY)


_DOT_TABLES: dict[int, np.ndarray] = {}

SCORE_DOTS, ORDERED_SUM, ROWS_SUM = 3, 4, 5
"""Slots of a :func:`dot_bodies` table after the three score-dot bodies: :func:`score_dots`,
:func:`kvfast.kernels.reduce.ordered_sum`, :func:`kvfast.kernels.reduce.weighted_rows_sum` (what the row
kernels call by address)."""


def dot_bodies(acc: int) -> np.ndarray:
    """What the row kernels call by address for accumulator ``acc`` (compiled, or loaded from the cache, on
    first use), an int64 array of 6, one per format and process (do not write it): the sequential score-dot
    body of ``acc`` in its slot (0, 1, 2 for F64, F32, BF16), 0 in the others' (:func:`score_dots` never calls
    them with this ``acc``), then the reductions of every format (slots ``SCORE_DOTS``, ``ORDERED_SUM``,
    ``ROWS_SUM``: run-time formats; called by address, each is compiled once, not again inside
    :func:`attend_row` and :func:`attend_row_blocked`)."""
    table = _DOT_TABLES.get(acc)
    if table is None:
        if acc not in (F64, F32, BF16):
            raise ValueError(f"acc: {acc!r} is not allowed; allowed: {F64}, {F32}, {BF16}")
        bodies = [address(_dot_kernel(i), DOT_BODY) if i == acc else 0 for i in range(3)]
        shared = [address(score_dots, SCORE), address(ordered_sum, SUM), address(weighted_rows_sum, ROWS)]
        table = np.array(bodies + shared, np.int64)
        _DOT_TABLES[acc] = table
    return table


@nb.njit(**_JIT)
def score_dots(qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, out, dots):
    """``out[j] = ordered_dot(qrow, c0, kbuf[lo + j], c0, hd, acc, order, sstack)`` for j < nk.

    ``dots``: :func:`dot_bodies` of ``acc``; the sequential order runs that format's body, called through
    its address (each format's body compiled once, on first use, and not again in every row kernel)."""
    if order == SEQUENTIAL and hd > 0:
        _dots_at(dots[acc], qrow, c0, kbuf, lo, nk, hd, out)  # the one body of acc (F64, F32, BF16: 0, 1, 2)
    else:
        for j in range(nk):
            out[j] = ordered_dot(qrow, c0, kbuf[lo + j], c0, hd, acc, order, sstack)


_DOTS = types.Array(types.int64, 1, "C")
SCORE = (_A1, _I, _A2, _I, _I, _I, _I, _I, _A1, _A1, _DOTS)
"""The argument types :func:`score_dots` is compiled for, and called with by address (the row kernels)."""
SUM = (_A1, _I, _I, _I, _I, _A1)
"""``ordered_sum(t, lo, n, acc, order, stack)`` as the row kernels call it by address."""
ROWS = (_A1, _I, _A2, _I, _I, _I, _I, _I, _I, _A1, _A2)
"""``weighted_rows_sum(coef, c0, rows, r0, n, col0, m, acc, order, out, stack)`` as the row kernels call it."""

_score_at = through_address(SCORE)
_sum_at = through_address(SUM, types.float64)
_rows_sum_at = through_address(ROWS)


@nb.njit(**_JIT)
def _row_views(q, qr, out, outr, n_head, lo, hi, scratch):
    """What a row's attention works in: the head width, the number of keys ``lo..hi-1``, the scores and the
    exponentials (the two halves of ``scratch``), the query row and the output row."""
    hd = q.shape[1] // n_head
    nk = hi - lo
    return hd, nk, scratch[:nk], scratch[nk : 2 * nk], q[qr], out[outr]


@nb.njit(**_JIT)
def _max_of(x, a0, n):
    """``max(x[a0:a0+n])`` by a left-to-right scan from ``-inf`` (``-inf`` when ``n == 0``)."""
    m = -np.inf
    for j in range(a0, a0 + n):
        if x[j] > m:
            m = x[j]
    return m


@nb.njit(**_JIT)
def attend_row(
    q, qr, kbuf, vbuf, lo, hi, n_head, scale, storage, acc, order, out, outr, probs, pr, scratch, sstack, vstack, dots
):
    """Attention of ``q[qr]`` over keys ``lo..hi-1``; writes ``out[outr]``.

    ``probs`` (H, rows, keys) receives the probabilities at ``probs[h, pr, j]``
    when it has rows (for the backward pass); ``scratch`` holds >= 2*(hi-lo)
    floats; ``sstack`` is (STACK_DEPTH,) and ``vstack`` (STACK_DEPTH, >= head_dim)
    scratch for pairwise sums; ``dots``: :func:`dot_bodies` of ``acc``.
    """
    hd, nk, scores, expd, qrow, orow = _row_views(q, qr, out, outr, n_head, lo, hi, scratch)
    linked = order == SEQUENTIAL and nk > 0  # the sequential sums, linked; else each sum called by address
    for h in range(n_head):
        c0 = h * hd
        smax = -np.inf
        if linked and hd > 0:  # s_j = q_h . k_jh: the accumulator's own sequential body
            _dots_at(dots[acc], qrow, c0, kbuf, lo, nk, hd, scores)
        else:
            _score_at(dots[SCORE_DOTS], qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, scores, dots)
        for j in range(nk):
            s = rnd(scores[j] * scale, storage)
            scores[j] = s
            if s > smax:
                smax = s
        for j in range(nk):
            expd[j] = rnd(math.exp(scores[j] - smax), storage)
        if linked:  # z = sum_j e_j
            z = sequential_sum(expd, np.int64(0), nk, acc)
        else:
            z = _sum_at(dots[ORDERED_SUM], expd, np.int64(0), nk, acc, order, sstack)
        for j in range(nk):
            expd[j] = rnd(expd[j] / z, storage)
        if probs.shape[0] > 0:
            for j in range(nk):
                probs[h, pr, lo + j] = expd[j]
        if linked:  # out_h = sum_j p_j v_jh
            sequential_rows_sum(expd, np.int64(0), vbuf, lo, nk, c0, hd, acc, orow, c0)
        else:
            _rows_sum_at(dots[ROWS_SUM], expd, np.int64(0), vbuf, lo, nk, c0, hd, acc, order, orow[c0 : c0 + hd],
                                          vstack)  # fmt: skip
        for c in range(c0, c0 + hd):
            orow[c] = rnd(orow[c], storage)


@nb.njit(**_JIT)
def block_edges(lo, hi, span_lo, span_hi, mode, param):
    """Start positions of the blocks that cut keys ``lo..hi-1``, then ``hi`` (an int64 array).

    ONLINE/SPLITKV: multiples of ``param`` (absolute positions); SPLITCOUNT:
    ``span_lo + i*(span_hi - span_lo)//param`` for ``i = 0..param``. Empty
    blocks are dropped; the first edge is ``lo``.
    """
    cap = hi - lo + 2
    edges = np.empty(cap, dtype=np.int64)
    n = 0
    edges[n] = lo
    n += 1
    if mode == SPLITCOUNT:
        length = span_hi - span_lo
        for i in range(1, param):
            b = span_lo + (i * length) // param
            if b > edges[n - 1] and b < hi:
                edges[n] = b
                n += 1
    else:
        b = (lo // param + 1) * param
        while b < hi:
            edges[n] = b
            n += 1
            b += param
    edges[n] = hi
    n += 1
    return edges[:n]


@nb.njit(**_JIT)
def attend_row_blocked(
    q, qr, kbuf, vbuf, lo, hi, span_lo, span_hi, n_head, scale, storage, acc, order, mode, param,
    out, outr, scratch, sstack, vstack, dots,
):  # fmt: skip
    """:func:`attend_row` in a real kernel's order (ONLINE, SPLITKV or SPLITCOUNT; see the module doc).

    ``span_lo, span_hi``: the key range of the whole call (used by SPLITCOUNT
    only). Scores are computed as in :func:`attend_row`; ``scratch`` holds
    >= 2*(hi-lo) floats. No probabilities are kept (no backward in these modes).
    """
    hd, nk, scores, expd, qrow, orow = _row_views(q, qr, out, outr, n_head, lo, hi, scratch)
    edges = block_edges(lo, hi, span_lo, span_hi, mode, param)
    nb_ = edges.shape[0] - 1
    tmp = np.empty(hd)
    acc_o = np.empty(hd)
    part_o = np.empty((max(nb_, 1), hd))
    part_lse = np.empty(max(nb_, 1))
    for h in range(n_head):
        c0 = h * hd
        _score_at(dots[SCORE_DOTS], qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, scores, dots)
        for j in range(nk):
            scores[j] = rnd(scores[j] * scale, storage)
        if mode == ONLINE:
            m = -np.inf
            lsum = 0.0
            for c in range(hd):
                acc_o[c] = 0.0
            for b in range(nb_):
                a0 = edges[b] - lo
                n = edges[b + 1] - edges[b]
                mb = _max_of(scores, a0, n)
                mnew = m if m > mb else mb
                alpha = rnd(math.exp(m - mnew), acc)
                for j in range(a0, a0 + n):
                    expd[j] = rnd(math.exp(scores[j] - mnew), storage)
                bsum = _sum_at(dots[ORDERED_SUM], expd, a0, n, acc, order, sstack)
                lsum = rnd(rnd(alpha * lsum, acc) + bsum, acc)
                _rows_sum_at(dots[ROWS_SUM], expd, a0, vbuf, lo + a0, n, c0, hd, acc, order, tmp, vstack)
                for c in range(hd):
                    acc_o[c] = rnd(rnd(alpha * acc_o[c], acc) + tmp[c], acc)
                m = mnew
            for c in range(hd):
                orow[c0 + c] = rnd(acc_o[c] / lsum, storage)
        else:
            big = -np.inf
            for b in range(nb_):
                a0 = edges[b] - lo
                n = edges[b + 1] - edges[b]
                mb = _max_of(scores, a0, n)
                for j in range(a0, a0 + n):
                    expd[j] = rnd(math.exp(scores[j] - mb), storage)
                lb = _sum_at(dots[ORDERED_SUM], expd, a0, n, acc, order, sstack)
                _rows_sum_at(dots[ROWS_SUM], expd, a0, vbuf, lo + a0, n, c0, hd, acc, order, tmp, vstack)
                for c in range(hd):
                    part_o[b, c] = rnd(tmp[c] / lb, acc)
                lse = rnd(mb + rnd(math.log(lb), acc), acc)
                part_lse[b] = lse
                if lse > big:
                    big = lse
            wsum = 0.0
            for b in range(nb_):
                wb = rnd(math.exp(part_lse[b] - big), acc)
                part_lse[b] = wb
                wsum = wb if b == 0 else rnd(wsum + wb, acc)
            for b in range(nb_):
                wb = rnd(part_lse[b] / wsum, acc)
                for c in range(hd):
                    t = rnd(wb * part_o[b, c], acc)
                    acc_o[c] = t if b == 0 else rnd(acc_o[c] + t, acc)
            for c in range(hd):
                orow[c0 + c] = rnd(acc_o[c], storage)


ROW = (_A2, _I, _A2, _A2, _I, _I, _I, _F, _I, _I, _I, _A2, _I, _A3, _I, _A1, _A1, _A2, _DOTS)
"""The argument types :func:`attend_row` is compiled for, and called with by address (the forward and the decode)."""
BLOCKED = (_A2, _I, _A2, _A2, _I, _I, _I, _I, _I, _F, _I, _I, _I, _I, _I, _A2, _I, _A1, _A1, _A2, _DOTS)
"""The argument types :func:`attend_row_blocked` is compiled for, and called with by address."""

ATTENTION = (_A2, _A2, _A2, _I, _I, types.boolean, _I, _F, _I, _I, _I, _A2, _A3, _I, _I, _I, _I, _DOTS)
"""The argument types :func:`attention_with` is called with by address (the compiled forward)."""

_row_at = through_address(ROW)
_blocked_at = through_address(BLOCKED)


def row_kernels(mode: int) -> tuple[int, int]:
    """``(row, blocked)``: the address of :func:`attend_row` for the standard ``mode``, else of
    :func:`attend_row_blocked` (compiled or loaded on first use); 0 for the one ``mode`` never runs."""
    if mode == STANDARD:
        return address(attend_row, ROW), 0
    return 0, address(attend_row_blocked, BLOCKED)


@nb.njit(**_JIT)
def attention_with(
    q,
    kbuf,
    vbuf,
    pos0,
    n_keys,
    causal,
    n_head,
    scale,
    storage,
    acc,
    order,
    out,
    probs,
    mode,
    param,
    row,
    blocked,
    dots,
):
    """:func:`attention_into` given the row kernels' addresses ``row``, ``blocked`` (:func:`row_kernels` of
    ``mode``) and the score-dot bodies' ``dots`` (:func:`dot_bodies` of ``acc``): the form jitted code calls
    (small, so linking it costs little; the row kernels are not linked)."""
    T = q.shape[0]
    d = q.shape[1]
    scratch = np.empty(2 * max(n_keys, 1))
    sstack = np.empty(STACK_DEPTH)
    vstack = new_stack(d // n_head)
    first = np.int64(0)
    for t in range(T):
        hi = pos0 + t + 1 if causal else n_keys
        if mode == STANDARD:
            _row_at(
                row, q, t, kbuf, vbuf, first, hi, n_head, scale, storage, acc, order, out, t, probs, t, scratch, sstack,
                vstack, dots,
            )  # fmt: skip
        else:
            _blocked_at(
                blocked, q, t, kbuf, vbuf, first, hi, first, n_keys, n_head, scale, storage, acc, order, mode, param,
                out, t, scratch, sstack, vstack, dots,
            )  # fmt: skip


def _c_array(a, name: str, ndim: int, written: bool) -> np.ndarray:
    """``a`` as a C-contiguous float64 array of ``ndim`` dimensions (inputs are copied if need be; an output
    must be one already, since it is written in place)."""
    arr = np.asarray(a)
    unwritable = written and not (arr.flags.c_contiguous and arr.flags.writeable)
    if arr.ndim != ndim or arr.dtype != np.float64 or unwritable:
        kind = "a writable C-contiguous" if written else "a"
        raise ValueError(f"{name}: {arr.dtype} array of {arr.ndim} dimensions is not allowed; allowed: {kind} "
                         f"float64 array of {ndim}")  # fmt: skip
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def attention_into(
    q, kbuf, vbuf, pos0, n_keys, causal, n_head, scale, storage, acc, order, out, probs, mode=0, param=0
) -> None:
    """Attention of every row of ``q`` (T, d) over the first ``n_keys`` buffer rows.

    Row t sits at absolute position ``pos0 + t``; under the causal mask it sees
    keys ``0 .. pos0+t``, otherwise all ``n_keys``. ``mode``/``param`` select a
    real kernel's order (module doc; default: the standard order); for
    SPLITCOUNT the call's key range is ``0 .. n_keys-1``. ``probs`` is filled in
    the standard mode only. ``out`` and ``probs`` (H, T, keys), or (0, 0, 0)
    for none, are written in place: C-contiguous float64 arrays. The row kernel
    runs through its address (:func:`attention_with`, :func:`row_kernels`).
    """
    attention_with(
        _c_array(q, "q", 2, False), _c_array(kbuf, "kbuf", 2, False), _c_array(vbuf, "vbuf", 2, False), int(pos0),
        int(n_keys), bool(causal), int(n_head), float(scale), int(storage), int(acc), int(order),
        _c_array(out, "out", 2, True), _c_array(probs, "probs", 3, True), int(mode), int(param), *row_kernels(mode),
        dot_bodies(int(acc)),
    )  # fmt: skip
