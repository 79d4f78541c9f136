"""Row-wise kernels: RMSNorm, SiLU, residual add, embedding lookup.

Each materialised value is rounded to the storage format; the RMSNorm mean is
an ordered sum in the accumulator format.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from numba import types

from kvfast.kernels.jit import BORROWING
from kvfast.kernels.jit import JIT_OPTIONS as _JIT
from kvfast.kernels.precision import elementwise, rnd
from kvfast.kernels.reduce import SEQUENTIAL, STACK_DEPTH, ordered_dot


@nb.njit(**_JIT, inline="always")
def rmsnorm_row(x, xr, g, eps, storage, acc, order, out, outr, stack):
    """``out[outr] = round_s(x[xr] * inv * g)`` with ``inv = round_s(1/sqrt(mean(x^2) + eps))``.

    Returns ``inv``. ``mean(x^2)`` is an ordered sum of squares in the
    accumulator format, divided by d and rounded to the accumulator format.
    Inlined into :func:`rmsnorm_into` in Numba IR (not compiled, optimised and emitted once more on its
    own there); called from Python it compiles as usual.
    """
    d = x.shape[1]
    row = x[xr]
    zero = np.int64(0)  # not the literal 0, which would compile ordered_dot once more
    mean_sq = rnd(ordered_dot(row, zero, row, zero, d, acc, order, stack) / d, acc)
    inv = rnd(1.0 / math.sqrt(mean_sq + eps), storage)
    orow = out[outr]
    for i in range(d):
        orow[i] = rnd(row[i] * inv * g[i], storage)
    return inv


@nb.njit(**_JIT)
def rmsnorm_into(x, g, eps, storage, acc, order, out, inv):
    """RMSNorm of every row of ``x`` (T, d) into ``out``; ``inv`` (T,) gets each row's scale."""
    # the pairwise mean's scratch; the sequential order reads none, so it gets an array at hand (no allocation:
    # this runs five times a decode step)
    stack = inv if order == SEQUENTIAL else np.empty(STACK_DEPTH)
    for t in range(x.shape[0]):
        inv[t] = rmsnorm_row(x, t, g, eps, storage, acc, order, out, t, stack)


_A1, _A2 = (types.Array(types.float64, n, "C") for n in (1, 2))
RMSNORM = (_A2, _A1, types.float64, types.int64, types.int64, types.int64, _A2, _A1)
"""``rmsnorm_into(x, g, eps, storage, acc, order, out, inv)`` as jitted code calls it by address."""


@nb.njit(**_JIT)
def silu(u: float) -> float:
    """``u * sigmoid(u)``, computed in float64 as ``u / (1 + exp(-u))``."""
    return u / (1.0 + math.exp(-u))


@nb.njit(**BORROWING)
def silu_into(u, storage, out):
    """``out = round_s(silu(u))`` elementwise (2-D arrays)."""
    for t in range(u.shape[0]):
        for j in range(u.shape[1]):
            out[t, j] = rnd(silu(u[t, j]), storage)


@nb.njit(**BORROWING)
def add_into(x, y, storage, out):
    """``out = round_s(x + y)`` elementwise (2-D arrays); the residual add. ``out`` may be ``x`` or ``y`` (each
    element is read before it is written)."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[t, j] = rnd(x[t, j] + y[t, j], storage)


@nb.njit(**BORROWING)
def embed_into(wte, wpe, tokens, positions, storage, out):
    """``out[t] = round_s(wte[tokens[t]] + wpe[positions[t]])``."""
    for t in range(tokens.shape[0]):
        for j in range(wte.shape[1]):
            out[t, j] = rnd(wte[tokens[t], j] + wpe[positions[t], j], storage)


@nb.njit(**_JIT)
def _exp_or_log_flat(flat: np.ndarray, log: bool, out: np.ndarray) -> None:
    """``out[i] = math.log(flat[i])`` if ``log`` else ``math.exp(flat[i])`` (1-D float64 arrays): one
    compiled kernel for :func:`exp_array` and :func:`log_array`, every shape."""
    if log:
        for i in range(flat.size):
            out[i] = math.log(flat[i])
    else:
        for i in range(flat.size):
            out[i] = math.exp(flat[i])


def exp_array(x: np.ndarray) -> np.ndarray:
    """The kernels' own ``exp`` (the C library's) elementwise, for references (``np.exp`` depends on the CPU's
    SIMD features, like ``np.log``: see :func:`log_array`); float64 out, the shape of ``x``."""
    return elementwise(_exp_or_log_flat, x, False)


def log_array(x: np.ndarray) -> np.ndarray:
    """The kernels' own ``log`` (the C library's) elementwise, for references: NumPy's ``np.log`` picks its
    code by the CPU's SIMD features (AVX-512 or not), so its last bits depend on the machine; float64 out,
    the shape of ``x``."""
    return elementwise(_exp_or_log_flat, x, True)
