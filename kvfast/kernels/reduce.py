"""Reductions in an explicit summation order, with the accumulator in a chosen format.

Every sum in the model goes through this module, so the order and the
accumulator format of each one are the experiment, not LLVM's choice.

Accumulator semantics (format ``acc``): each product ``a*b`` is computed in
float64 and rounded to ``acc`` (each term of a plain sum is rounded to ``acc``
as it enters); each addition of two partial sums is computed
in float64 and rounded to ``acc``. For f64 this is plain float64 arithmetic; for
f32 it equals native float32 arithmetic (float64 is wide enough that the double
rounding is harmless for + and *); for bf16 every product and every add is
rounded to bfloat16.

Orders:

``SEQUENTIAL``
    left to right with one accumulator: ``((t0 + t1) + t2) + ...``.
``PAIRWISE``
    a fixed binary tree, as a blocked kernel sums a batch: each aligned block
    of ``2^k`` terms is the sum of its two halves, and the whole sum adds the
    maximal aligned blocks of the binary decomposition of ``n`` left to right
    (n = 6: ``((t0+t1)+(t2+t3)) + (t4+t5)``). It is computed with a stack, like
    a binary counter, so it streams.

An empty sum is ``0.0``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvfast.kernels.jit import BORROWING
from kvfast.kernels.jit import JIT_OPTIONS as _JIT
from kvfast.kernels.precision import rnd

SEQUENTIAL = 0
PAIRWISE = 1

ORDER_CODES = {"sequential": SEQUENTIAL, "pairwise": PAIRWISE}

# Depth of the pairwise stack: enough for 2**62 terms.
STACK_DEPTH = 64


@nb.njit(**_JIT)
def new_stack(width: int) -> np.ndarray:
    """Scratch for pairwise vector sums: ``STACK_DEPTH`` partial rows of ``width``."""
    return np.empty((STACK_DEPTH, max(width, 1)))


@nb.njit(**BORROWING)
def _push_pairwise(stack: np.ndarray, sp: int, v: float, i: int, acc: int) -> int:
    """Push term ``i`` (0-based, already in format ``acc``) of a pairwise sum onto ``stack`` (``sp`` entries):
    merge it with the equal blocks on top, as a binary counter carries (each add rounded to ``acc``); the new
    number of entries."""
    count = i + 1
    while (count & 1) == 0:
        sp -= 1
        v = rnd(stack[sp] + v, acc)
        count >>= 1
    stack[sp] = v
    return sp + 1


@nb.njit(**BORROWING)
def _stack_total(stack: np.ndarray, sp: int, acc: int) -> float:
    """The pairwise sum's blocks on ``stack`` (``sp >= 1`` entries), added left to right in format ``acc``."""
    s = stack[0]
    for i in range(1, sp):
        s = rnd(s + stack[i], acc)
    return s


@nb.njit(**_JIT, inline="always")
def sequential_sum(t: np.ndarray, lo: int, n: int, acc: int) -> float:
    """:func:`ordered_sum` in the sequential order (``n >= 1``): ``((t0 + t1) + t2) + ...``, each term rounded to
    ``acc`` as it enters, each add rounded to ``acc``. Small: inlined in its callers' Numba IR (linked, it was
    compiled on its own and optimised again inside each caller)."""
    s = rnd(t[lo], acc)
    for i in range(1, n):
        s = rnd(s + rnd(t[lo + i], acc), acc)
    return s


@nb.njit(**BORROWING)
def ordered_sum(t: np.ndarray, lo: int, n: int, acc: int, order: int, stack: np.ndarray) -> float:
    """Sum ``t[lo:lo+n]`` in ``order``, in format ``acc``.

    Each term is rounded to ``acc`` as it enters the sum (a no-op for values
    already in that format), as each product is in :func:`ordered_dot`.
    ``stack`` is scratch of at least ``STACK_DEPTH`` floats (1-D).
    """
    if n == 0:
        return 0.0
    if order == SEQUENTIAL:
        return sequential_sum(t, lo, n, acc)
    sp = np.int64(0)  # not the literal 0: _push_pairwise and _stack_total compiled once, for int64
    for i in range(n):
        sp = _push_pairwise(stack, sp, rnd(t[lo + i], acc), i, acc)
    return _stack_total(stack, sp, acc)


@nb.njit(**BORROWING)
def ordered_dot(
    a: np.ndarray, a0: int, b: np.ndarray, b0: int, n: int, acc: int, order: int, stack: np.ndarray
) -> float:
    """``sum_i a[a0+i] * b[b0+i]`` for i < n: products and adds in format ``acc``."""
    if n == 0:
        return 0.0
    if order == SEQUENTIAL:
        s = rnd(a[a0] * b[b0], acc)
        for i in range(1, n):
            s = rnd(s + rnd(a[a0 + i] * b[b0 + i], acc), acc)
        return s
    sp = np.int64(0)  # not the literal 0 (as in ordered_sum)
    for i in range(n):
        sp = _push_pairwise(stack, sp, rnd(a[a0 + i] * b[b0 + i], acc), i, acc)
    return _stack_total(stack, sp, acc)


@nb.njit(**_JIT, inline="always")
def sequential_rows_sum(coef, c0, rows, r0, n, col0, m, acc, out, o0) -> None:
    """:func:`weighted_rows_sum` in the sequential order (``n >= 1``), into ``out[o0 : o0 + m]``: each column's
    terms left to right, the loop across columns. Small: inlined in its callers' Numba IR, as
    :func:`sequential_sum`."""
    c = coef[c0]
    for j in range(m):
        out[o0 + j] = rnd(c * rows[r0, col0 + j], acc)
    for i in range(1, n):
        c = coef[c0 + i]
        for j in range(m):
            out[o0 + j] = rnd(out[o0 + j] + rnd(c * rows[r0 + i, col0 + j], acc), acc)


@nb.njit(**BORROWING)
def weighted_rows_sum(
    coef: np.ndarray,
    c0: int,
    rows: np.ndarray,
    r0: int,
    n: int,
    col0: int,
    m: int,
    acc: int,
    order: int,
    out: np.ndarray,
    stack: np.ndarray,
) -> None:
    """``out[j] = sum_i coef[c0+i] * rows[r0+i, col0+j]`` for j < m, i < n.

    Each output element is its own sum over i in ``order`` with products and
    adds in format ``acc``; the loop runs across j so that it vectorises
    without changing any element's order. ``stack`` is ``(STACK_DEPTH, >= m)``.
    """
    if n == 0:
        for j in range(m):
            out[j] = 0.0
        return
    if order == SEQUENTIAL:
        sequential_rows_sum(coef, c0, rows, r0, n, col0, m, acc, out, np.int64(0))
        return
    sp = 0
    for i in range(n):
        c = coef[c0 + i]
        for j in range(m):
            stack[sp, j] = rnd(c * rows[r0 + i, col0 + j], acc)
        count = i + 1
        while (count & 1) == 0:
            for j in range(m):
                stack[sp - 1, j] = rnd(stack[sp - 1, j] + stack[sp, j], acc)
            sp -= 1
            count >>= 1
        sp += 1
    for j in range(m):
        out[j] = stack[0, j]
    for s in range(1, sp):
        for j in range(m):
            out[j] = rnd(out[j] + stack[s, j], acc)
