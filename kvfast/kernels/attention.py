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
(inlined or linked, it was generated again in each caller); the row kernels
call the sequential score-dot body of their accumulator format by address too,
compiled on the first use of that format (the bodies are written once, as a
template, and written out per format: :mod:`kvfast.kernels.bodies`), and
:func:`score_dots` and the reductions (:func:`kvfast.kernels.reduce.ordered_sum`,
:func:`kvfast.kernels.reduce.weighted_rows_sum`) of the pairwise order by
address, so these are not optimised again inside both row kernels. What they
call is one table, :func:`attention_kernels` (:class:`AttentionKernels`, read
by name); their arguments come in records (:class:`Keys`, :class:`Heads`,
:class:`Blocks`, :class:`Scratch`, :class:`~kvfast.kernels.precision.Formats`).

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

import functools
import math
from typing import NamedTuple

import numba as nb
import numpy as np
from numba import types

from kvfast.kernels.bodies import MAC, MUL, body_name, specialise
from kvfast.kernels.indirect import Kernel, table, through_address
from kvfast.kernels.jit import BORROWING
from kvfast.kernels.jit import JIT_OPTIONS as _JIT
from kvfast.kernels.precision import BF16, F32, F64, FORMATS, Formats, rnd
from kvfast.kernels.reduce import (
    SEQUENTIAL,
    STACK_DEPTH,
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
    if name == "DOT_KERNELS":  # the three bodies, f64, f32, bf16 (generated on first use)
        return tuple(_dot_kernel(acc) for acc in (F64, F32, BF16))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DOT_BODY = (_A1, _I, _A2, _I, _I, _I, _A1)
"""The signature every ``DOT_KERNELS`` body is compiled for."""

_dots_at = through_address(DOT_BODY)


class AttentionKernels(NamedTuple):
    """What attention calls by address (:func:`attention_kernels`): their addresses, 0 for those a call never
    reaches (another accumulator's score-dot body, the other kind of row)."""

    dots: int  # the accumulator's sequential score-dot body: s_j = q_h . k_jh, left to right over the head
    score_dots: int  # score_dots: every s_j of a head, in any order
    ordered_sum: int  # kvfast.kernels.reduce.ordered_sum: z = sum_j e_j
    rows_sum: int  # kvfast.kernels.reduce.weighted_rows_sum: out_h = sum_j p_j v_jh
    row: int  # attend_row: a row in the standard order
    blocked: int  # attend_row_blocked: a row in a real kernel's order


class Heads(NamedTuple):
    """How a row is split: ``n`` heads of width ``d // n``, their scores scaled by ``scale`` (1 / sqrt(d // n))."""

    n: int
    scale: float


class Keys(NamedTuple):
    """The keys a row attends: rows ``lo .. hi - 1`` of the key and value buffers ``k``, ``v`` (S, d)."""

    k: np.ndarray
    v: np.ndarray
    lo: int
    hi: int


class Blocks(NamedTuple):
    """A real kernel's order (module doc): ``mode`` (``ONLINE``, ``SPLITKV``, ``SPLITCOUNT``; ``STANDARD``: none)
    and ``param`` (the block size, or the number of splits); SPLITCOUNT cuts the call's key range
    ``span_lo .. span_hi - 1``."""

    mode: int
    param: int
    span_lo: int
    span_hi: int


class Scratch(NamedTuple):
    """Work arrays of an attention call, reused by every row (:func:`new_scratch`)."""

    scores: np.ndarray  # (>= 2 * keys,) a row's scores s_j, then its exponentials e_j
    sums: np.ndarray  # (STACK_DEPTH,) a pairwise sum's partial sums
    rows: np.ndarray  # (STACK_DEPTH, >= head_dim) a pairwise weighted sum's partial rows


@nb.njit(**_JIT, inline="always")
def new_scratch(n_keys: int, head_dim: int) -> Scratch:
    """The :class:`Scratch` of a call whose rows attend at most ``n_keys`` keys, heads of ``head_dim``: one
    allocation (one per layer of a forward), cut into the scores, the partial sums and the partial rows."""
    scores, width = 2 * max(n_keys, 1), max(head_dim, 1)
    block = np.empty(scores + STACK_DEPTH * (1 + width))
    rows = block[scores + STACK_DEPTH :].reshape((STACK_DEPTH, width))  # as new_stack(head_dim)
    return Scratch(block[:scores], block[scores : scores + STACK_DEPTH], rows)


_AK = types.NamedUniTuple(_I, len(AttentionKernels._fields), AttentionKernels)
HEADS = types.NamedTuple((_I, _F), Heads)
KEYS = types.NamedTuple((_A2, _A2, _I, _I), Keys)
BLOCKS = types.NamedUniTuple(_I, len(Blocks._fields), Blocks)
SCRATCH = types.NamedTuple((_A1, _A1, _A2), Scratch)
"""The Numba types of the records (the signatures below are made of them)."""

SCORE = (_A1, _I, _A2, _I, _I, _I, _I, _I, _A1, _A1, _AK)
"""``score_dots(qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, out, kern)`` as the row kernels call it."""
SUM = (_A1, _I, _I, _I, _I, _A1)
"""``ordered_sum(t, lo, n, acc, order, stack)`` as the row kernels call it by address."""
ROWS = (_A1, _I, _A2, _I, _I, _I, _I, _I, _I, _A1, _A2)
"""``weighted_rows_sum(coef, c0, rows, r0, n, col0, m, acc, order, out, stack)`` as the row kernels call it."""
ROW = (_A2, _A2, _A3, _I, KEYS, HEADS, FORMATS, SCRATCH, _AK)
"""``attend_row(q, out, probs, row, keys, heads, fmt, work, kern)`` as the forward and the decode call it."""
BLOCKED = (_A2, _A2, _I, KEYS, HEADS, FORMATS, BLOCKS, SCRATCH, _AK)
"""``attend_row_blocked(q, out, row, keys, heads, fmt, blocks, work, kern)`` as they call it."""
ATTENTION = (_A2, _A2, _A2, _A2, _A3, _I, types.boolean, HEADS, FORMATS, BLOCKS, _AK)
"""``attention_with(q, k, v, out, probs, pos0, causal, heads, fmt, blocks, kern)`` as the compiled forward calls
it."""

_score_at = through_address(SCORE)
_sum_at = through_address(SUM, types.float64)
_rows_sum_at = through_address(ROWS)
_row_at = through_address(ROW)
_blocked_at = through_address(BLOCKED)

_ATTENTION_TABLES: dict[tuple[int, bool], AttentionKernels] = {}


def attention_kernels(acc: int, mode: int = STANDARD) -> AttentionKernels:
    """What attention of kind ``mode`` in accumulator ``acc`` calls by address, compiled (or loaded from the cache)
    on first use: the accumulator's score-dot body, the reductions (run-time formats: each compiled once, not
    again inside both row kernels) and the row kernel of ``mode``'s kind. One table per format, kind and
    process."""
    key = (acc, mode == STANDARD)
    found = _ATTENTION_TABLES.get(key)
    if found is None:
        if acc not in (F64, F32, BF16):
            raise ValueError(f"acc: {acc!r} is not allowed; allowed: {F64}, {F32}, {BF16}")
        entries = [
            Kernel("dots", functools.partial(_dot_kernel, acc), DOT_BODY),
            Kernel("score_dots", score_dots, SCORE),
            Kernel("ordered_sum", ordered_sum, SUM),
            Kernel("rows_sum", weighted_rows_sum, ROWS),
            Kernel("row", attend_row, ROW),
            Kernel("blocked", attend_row_blocked, BLOCKED),
        ]
        reached = ("dots", "score_dots", "ordered_sum", "rows_sum", "row" if mode == STANDARD else "blocked")
        found = _ATTENTION_TABLES[key] = AttentionKernels(**table(entries, reached))
    return found


@nb.njit(**BORROWING)
def score_dots(qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, out, kern):
    """``out[j] = ordered_dot(qrow, c0, kbuf[lo + j], c0, hd, acc, order, sstack)`` for j < nk.

    ``kern``: :func:`attention_kernels` of ``acc``; the sequential order runs that format's body, called through
    its address (each format's body compiled once, on first use, and not again in every row kernel)."""
    if order == SEQUENTIAL and hd > 0:
        _dots_at(kern.dots, qrow, c0, kbuf, lo, nk, hd, out)
    else:
        for j in range(nk):
            out[j] = ordered_dot(qrow, c0, kbuf[lo + j], c0, hd, acc, order, sstack)


@nb.njit(**BORROWING)
def _max_of(x, a0, n):
    """``max(x[a0:a0+n])`` by a left-to-right scan from ``-inf`` (``-inf`` when ``n == 0``)."""
    m = -np.inf
    for j in range(a0, a0 + n):
        if x[j] > m:
            m = x[j]
    return m


@nb.njit(**BORROWING)
def attend_row(q, out, probs, row, keys, heads, fmt, work, kern):
    """Row ``row`` of ``out`` (T, d): the attention of the same row of ``q`` over ``keys`` (:class:`Keys`), head by
    head, in the standard order (the module doc's formulas); ``probs`` (H, T, S) receives p_j at
    ``[h, row, j]`` when it has rows (the tape's). ``heads``: :class:`Heads`; ``fmt``:
    :class:`~kvfast.kernels.precision.Formats`; ``work``: :class:`Scratch`; ``kern``: :func:`attention_kernels`.
    The sequential sums are inlined (small); the pairwise ones, and the score dots of either order, are called by
    address."""
    storage, acc, order = fmt
    kbuf, vbuf, lo, hi = keys
    hd = q.shape[1] // heads.n
    nk = hi - lo
    scores, expd, sstack, vstack = work.scores[:nk], work.scores[nk : 2 * nk], work.sums, work.rows
    qrow, orow = q[row], out[row]
    linked = order == SEQUENTIAL and nk > 0
    for h in range(heads.n):
        c0 = h * hd
        # s_j = round_s(dot(q_h, k_jh) * scale), m = max_j s_j
        if linked and hd > 0:
            _dots_at(kern.dots, qrow, c0, kbuf, lo, nk, hd, scores)
        else:
            _score_at(kern.score_dots, qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, scores, kern)
        smax = -np.inf
        for j in range(nk):
            s = rnd(scores[j] * heads.scale, storage)
            scores[j] = s
            if s > smax:
                smax = s
        # e_j = round_s(exp(s_j - m)), z = sum_j e_j, p_j = round_s(e_j / z)
        for j in range(nk):
            expd[j] = rnd(math.exp(scores[j] - smax), storage)
        if linked:
            z = sequential_sum(expd, np.int64(0), nk, acc)
        else:
            z = _sum_at(kern.ordered_sum, expd, np.int64(0), nk, acc, order, sstack)
        for j in range(nk):
            expd[j] = rnd(expd[j] / z, storage)
        if probs.shape[0] > 0:
            for j in range(nk):
                probs[h, row, lo + j] = expd[j]
        # out_h = round_s(sum_j p_j v_jh), per column
        if linked:
            sequential_rows_sum(expd, np.int64(0), vbuf, lo, nk, c0, hd, acc, orow, c0)
        else:
            _rows_sum_at(kern.rows_sum, expd, np.int64(0), vbuf, lo, nk, c0, hd, acc, order, orow[c0 : c0 + hd], vstack)
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
def attend_row_blocked(q, out, row, keys, heads, fmt, blocks, work, kern):
    """:func:`attend_row` in a real kernel's order (:class:`Blocks`: ONLINE, SPLITKV or SPLITCOUNT; the module doc).

    Scores are computed as in :func:`attend_row`. No probabilities are kept (no backward in these modes).
    """
    storage, acc, order = fmt
    kbuf, vbuf, lo, hi = keys
    mode = blocks.mode
    hd = q.shape[1] // heads.n
    nk = hi - lo
    scores, expd, sstack, vstack = work.scores[:nk], work.scores[nk : 2 * nk], work.sums, work.rows
    qrow, orow = q[row], out[row]
    edges = block_edges(lo, hi, blocks.span_lo, blocks.span_hi, mode, blocks.param)
    nb_ = edges.shape[0] - 1
    tmp = np.empty(hd)
    acc_o = np.empty(hd)
    part_o = np.empty((max(nb_, 1), hd))
    part_lse = np.empty(max(nb_, 1))
    for h in range(heads.n):
        c0 = h * hd
        _score_at(kern.score_dots, qrow, c0, kbuf, lo, nk, hd, acc, order, sstack, scores, kern)
        for j in range(nk):
            scores[j] = rnd(scores[j] * heads.scale, storage)
        m = -np.inf  # ONLINE: the running max, sum and output
        lsum = 0.0
        for c in range(hd):
            acc_o[c] = 0.0
        big = -np.inf  # SPLITKV, SPLITCOUNT: the largest chunk log-sum-exp
        for b in range(nb_):
            a0 = edges[b] - lo
            n = edges[b + 1] - edges[b]
            mb = _max_of(scores, a0, n)
            if mode == ONLINE:
                mb = m if m > mb else mb  # the running max m'
            for j in range(a0, a0 + n):
                expd[j] = rnd(math.exp(scores[j] - mb), storage)
            bsum = _sum_at(kern.ordered_sum, expd, a0, n, acc, order, sstack)
            _rows_sum_at(kern.rows_sum, expd, a0, vbuf, lo + a0, n, c0, hd, acc, order, tmp, vstack)
            if mode == ONLINE:
                alpha = rnd(math.exp(m - mb), acc)
                lsum = rnd(rnd(alpha * lsum, acc) + bsum, acc)
                for c in range(hd):
                    acc_o[c] = rnd(rnd(alpha * acc_o[c], acc) + tmp[c], acc)
                m = mb
            else:
                for c in range(hd):
                    part_o[b, c] = rnd(tmp[c] / bsum, acc)
                lse = rnd(mb + rnd(math.log(bsum), acc), acc)
                part_lse[b] = lse
                if lse > big:
                    big = lse
        if mode == ONLINE:
            for c in range(hd):
                orow[c0 + c] = rnd(acc_o[c] / lsum, storage)
        else:
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


@nb.njit(**_JIT)
def attention_with(q, k, v, out, probs, pos0, causal, heads, fmt, blocks, kern):
    """:func:`attention_into` given its tables: row ``t`` of ``q`` at position ``pos0 + t`` attends keys
    ``0 .. pos0 + t`` (``causal``) or ``0 .. blocks.span_hi - 1`` (every key of the call); ``blocks``:
    :class:`Blocks` (mode ``STANDARD``: :func:`attend_row`); ``kern``: :func:`attention_kernels`. The form jitted
    code calls, by address; the row kernels are called by address."""
    n_keys = blocks.span_hi
    work = new_scratch(n_keys, q.shape[1] // heads.n)
    first = np.int64(0)
    for t in range(q.shape[0]):
        keys = Keys(k, v, first, pos0 + t + 1 if causal else n_keys)
        if blocks.mode == STANDARD:
            _row_at(kern.row, q, out, probs, t, keys, heads, fmt, work, kern)
        else:
            _blocked_at(kern.blocked, q, out, t, keys, heads, fmt, blocks, work, kern)


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
    runs through its address (:func:`attention_with`, :func:`attention_kernels`).
    """
    attention_with(
        _c_array(q, "q", 2, False), _c_array(kbuf, "kbuf", 2, False), _c_array(vbuf, "vbuf", 2, False),
        _c_array(out, "out", 2, True), _c_array(probs, "probs", 3, True), int(pos0), bool(causal),
        Heads(int(n_head), float(scale)), Formats(int(storage), int(acc), int(order)),
        Blocks(int(mode), int(param), 0, int(n_keys)), attention_kernels(int(acc), int(mode)),
    )  # fmt: skip
