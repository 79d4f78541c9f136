"""Matrix product with an explicit summation order.

``y[t, j] = round_storage( sum_k x[t, k] * w[k, j] )`` where the sum over k runs
in the chosen order with products and adds in the accumulator format (see
:mod:`kvfast.kernels.reduce`). Every output element is its own ordered sum,
so row ``t`` of a product of T rows is bit-identical to the product of that
one row alone: the batch shape never changes a value.

Speed comes from the i-k-j loop form (a row of outputs is updated for each k,
vectorised across output columns) and from updating four rows per pass over
``w``; neither changes any element's order of addition.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvfast.kernels.precision import rnd
from kvfast.kernels.reduce import SEQUENTIAL, new_stack, weighted_rows_sum

_JIT = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy"}


@nb.njit(**_JIT)
def _four_rows_sequential(x, w, t, y, acc):
    # y[t:t+4] = x[t:t+4] @ w, each element summed over k left to right.
    n = x.shape[1]
    m = w.shape[1]
    a0 = x[t, 0]
    a1 = x[t + 1, 0]
    a2 = x[t + 2, 0]
    a3 = x[t + 3, 0]
    for j in range(m):
        wk = w[0, j]
        y[t, j] = rnd(a0 * wk, acc)
        y[t + 1, j] = rnd(a1 * wk, acc)
        y[t + 2, j] = rnd(a2 * wk, acc)
        y[t + 3, j] = rnd(a3 * wk, acc)
    for k in range(1, n):
        a0 = x[t, k]
        a1 = x[t + 1, k]
        a2 = x[t + 2, k]
        a3 = x[t + 3, k]
        for j in range(m):
            wk = w[k, j]
            y[t, j] = rnd(y[t, j] + rnd(a0 * wk, acc), acc)
            y[t + 1, j] = rnd(y[t + 1, j] + rnd(a1 * wk, acc), acc)
            y[t + 2, j] = rnd(y[t + 2, j] + rnd(a2 * wk, acc), acc)
            y[t + 3, j] = rnd(y[t + 3, j] + rnd(a3 * wk, acc), acc)


@nb.njit(**_JIT)
def matmul_into(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int, y: np.ndarray) -> None:
    """``y[:] = x @ w`` (x: (T, n), w: (n, m), y: (T, m)) in ``order``, stored in ``storage``."""
    T, n = x.shape
    m = w.shape[1]
    t = 0
    if order == SEQUENTIAL and n > 0:
        while t + 4 <= T:
            _four_rows_sequential(x, w, t, y, acc)
            t += 4
    stack = new_stack(m)
    for r in range(t, T):
        weighted_rows_sum(x[r], 0, w, 0, n, 0, m, acc, order, y[r], stack)
    for r in range(T):
        for j in range(m):
            y[r, j] = rnd(y[r, j], storage)


@nb.njit(**_JIT)
def matmul(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int) -> np.ndarray:
    """``x @ w`` as a new (T, m) array; see :func:`matmul_into`."""
    y = np.empty((x.shape[0], w.shape[1]), dtype=np.float64)
    matmul_into(x, w, storage, acc, order, y)
    return y
