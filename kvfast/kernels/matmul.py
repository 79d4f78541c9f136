"""Matrix product with an explicit summation order.

``y[t, j] = round_storage( sum_k x[t, k] * w[k, j] )`` where the sum over k runs
in the chosen order with products and adds in the accumulator format (see
:mod:`kvfast.kernels.reduce`). Every output element is its own ordered sum,
so row ``t`` of a product of T rows is bit-identical to the product of that
one row alone: the batch shape never changes a value.

Speed (none of it changes any element's order of addition or its rounding):

- the i-k-j loop form: a row of outputs is updated for each k, so the
  innermost loop runs across output columns and vectorises, while every
  element still receives its terms in k order;
- four rows per pass over ``w`` (each loaded ``w`` vector serves four rows);
- several k per pass over a row (``y + a0*w0 + a1*w1 + ...`` is evaluated
  left to right, exactly the sequential order, but ``y`` is loaded and stored
  once per pass instead of once per k);
- one kernel per accumulator format, chosen once per call, so the inner
  loops carry no format branch and the f64 one is plain ``y + a*w``; the
  bf16 rounding is a branch-free twin of ``round_bf16_f64`` that vectorises.

Each sequential sum starts from ``-0.0``: ``-0.0 + p == p`` for every p
(including ``+0.0`` and ``-0.0``) and rounding is idempotent, so the first step
``rnd(-0.0 + rnd(p))`` is exactly the reference's first term ``rnd(p)``. NaN
results stay NaN, but which NaN operand's sign survives an add is up to the
compiler (IEEE 754 leaves it unspecified). No kernel uses fastmath; without it
LLVM neither reassociates nor contracts ``a*b + c`` into an FMA.

The per-format kernels below are written out in full (one line per output
row, generated mechanically); they differ only in the rounding applied, so
edit them by pattern and keep them in step.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic

from kvfast.kernels.jit import JIT_OPTIONS as _JIT
from kvfast.kernels.precision import F32, F64, rnd
from kvfast.kernels.reduce import SEQUENTIAL, new_stack, weighted_rows_sum


@nb.njit(**_JIT)
def _r32(v: float) -> float:
    """``rnd(v, F32)`` without the format branch."""
    return np.float64(np.float32(v))


@intrinsic
def _f64_bits(typingctx, x):
    """Reinterpret a float64's bits as uint64."""
    if not isinstance(x, types.Float) or x.bitwidth != 64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint64))

    return types.uint64(x), codegen


@intrinsic
def _bits_f64(typingctx, x):
    """The float64 whose bits are the 64-bit integer ``x``."""
    if not isinstance(x, types.Integer) or x.bitwidth != 64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(x), codegen


_SIGN = np.uint64(0x8000_0000_0000_0000)
_MAGNITUDE = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
_HALF_LESS_ONE = np.uint64((1 << 44) - 1)  # half a bfloat16 ulp, less one, in float64 mantissa units
_KEEP = np.uint64(0xFFFF_E000_0000_0000)  # sign, exponent and the top 7 mantissa bits
_ONE = np.uint64(1)
_DROPPED = np.uint64(45)  # float64 mantissa bits that bfloat16 drops
_INF = np.uint64(0x7FF0_0000_0000_0000)
_QNAN = np.uint64(0x7FF8_0000_0000_0000)
_OVERFLOW = np.uint64((1023 + 128) << 52)  # 2**128: the first magnitude past bfloat16's range
_MIN_NORMAL = 2.0**-126
_SUBNORMAL_SHIFT = 1.5 * 2.0**-81  # |v| + this lies in [2**-81, 2**-80), whose ulp is 2**-133


@nb.njit(**_JIT)
def _rbf(v: float) -> float:
    """``rnd(v, BF16)`` without the format branch, and without branches, so loops over it vectorise.

    One rounding of float64 to the nearest bfloat16, ties to even, exactly as
    :func:`kvfast.kernels.precision.round_bf16_f64` (both are correctly rounded;
    checked equal bit for bit on 4e7 random bit patterns and on every bfloat16
    value and midpoint, offset by one float64 ulp either way): round the float64
    bits at the 45th bit for normal results; past the largest bfloat16 (2**128
    after rounding) give inf; below 2**-126 round to a multiple of 2**-133, the
    bfloat16 subnormal step, by adding and subtracting a constant; the sign is
    put back last (so -0.0 and tiny negatives stay negative); NaN becomes the
    quiet NaN with its sign, as the float32 route gives.
    """
    b = _f64_bits(v)
    a = b & _MAGNITUDE
    r = (a + _HALF_LESS_ONE + ((a >> _DROPPED) & _ONE)) & _KEEP
    r = _INF if r >= _OVERFLOW else r
    mag = abs(v)
    sub = _f64_bits((mag + _SUBNORMAL_SHIFT) - _SUBNORMAL_SHIFT)
    r = sub if mag < _MIN_NORMAL else r
    r = _QNAN if a > _INF else r
    return _bits_f64(r | (b & _SIGN))


# --- sequential kernels, one per accumulator format -------------------------------------------
#
# ``_rows4_<fmt>(x, w, t, y)`` writes rows t..t+3 of ``x @ w`` and ``_rows1_<fmt>`` row t, before the
# storage rounding; x has at least one column. Each term is ``rnd(x[t, k] * w[k, j])`` and each
# add ``rnd(y + term)`` in the accumulator format, for k = 0, 1, ... in order.


@nb.njit(**_JIT)
def _rows4_f64(x, w, t, y):
    """``y[t:t+4] = x[t:t+4] @ w`` with a f64 accumulator, each element summed over k left to right."""
    n = x.shape[1]
    m = w.shape[1]
    for j in range(m):
        y[t, j] = -0.0
        y[t + 1, j] = -0.0
        y[t + 2, j] = -0.0
        y[t + 3, j] = -0.0
    k = 0
    while k + 4 <= n:
        a00, a01, a02, a03 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3]
        a10, a11, a12, a13 = x[t + 1, k], x[t + 1, k + 1], x[t + 1, k + 2], x[t + 1, k + 3]
        a20, a21, a22, a23 = x[t + 2, k], x[t + 2, k + 1], x[t + 2, k + 2], x[t + 2, k + 3]
        a30, a31, a32, a33 = x[t + 3, k], x[t + 3, k + 1], x[t + 3, k + 2], x[t + 3, k + 3]
        for j in range(m):
            w0, w1, w2, w3 = w[k, j], w[k + 1, j], w[k + 2, j], w[k + 3, j]
            y[t, j] = y[t, j] + a00 * w0 + a01 * w1 + a02 * w2 + a03 * w3
            y[t + 1, j] = y[t + 1, j] + a10 * w0 + a11 * w1 + a12 * w2 + a13 * w3
            y[t + 2, j] = y[t + 2, j] + a20 * w0 + a21 * w1 + a22 * w2 + a23 * w3
            y[t + 3, j] = y[t + 3, j] + a30 * w0 + a31 * w1 + a32 * w2 + a33 * w3
        k += 4
    while k < n:
        a00 = x[t, k]
        a10 = x[t + 1, k]
        a20 = x[t + 2, k]
        a30 = x[t + 3, k]
        for j in range(m):
            w0 = w[k, j]
            y[t, j] = y[t, j] + a00 * w0
            y[t + 1, j] = y[t + 1, j] + a10 * w0
            y[t + 2, j] = y[t + 2, j] + a20 * w0
            y[t + 3, j] = y[t + 3, j] + a30 * w0
        k += 1


@nb.njit(**_JIT)
def _rows1_f64(x, w, t, y):
    """``y[t] = x[t] @ w`` with a f64 accumulator, each element summed over k left to right."""
    n = x.shape[1]
    m = w.shape[1]
    for j in range(m):
        y[t, j] = -0.0
    k = 0
    while k + 4 <= n:
        a00, a01, a02, a03 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3]
        for j in range(m):
            w0, w1, w2, w3 = w[k, j], w[k + 1, j], w[k + 2, j], w[k + 3, j]
            y[t, j] = y[t, j] + a00 * w0 + a01 * w1 + a02 * w2 + a03 * w3
        k += 4
    while k < n:
        a00 = x[t, k]
        for j in range(m):
            w0 = w[k, j]
            y[t, j] = y[t, j] + a00 * w0
        k += 1


@nb.njit(**_JIT)
def _rows4_f32(x, w, t, y):
    """``y[t:t+4] = x[t:t+4] @ w`` with a f32 accumulator, each element summed over k left to right."""
    n = x.shape[1]
    m = w.shape[1]
    for j in range(m):
        y[t, j] = -0.0
        y[t + 1, j] = -0.0
        y[t + 2, j] = -0.0
        y[t + 3, j] = -0.0
    k = 0
    while k + 4 <= n:
        a00, a01, a02, a03 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3]
        a10, a11, a12, a13 = x[t + 1, k], x[t + 1, k + 1], x[t + 1, k + 2], x[t + 1, k + 3]
        a20, a21, a22, a23 = x[t + 2, k], x[t + 2, k + 1], x[t + 2, k + 2], x[t + 2, k + 3]
        a30, a31, a32, a33 = x[t + 3, k], x[t + 3, k + 1], x[t + 3, k + 2], x[t + 3, k + 3]
        for j in range(m):
            w0, w1, w2, w3 = w[k, j], w[k + 1, j], w[k + 2, j], w[k + 3, j]
            y[t, j] = _r32(
                _r32(_r32(_r32(y[t, j] + _r32(a00 * w0)) + _r32(a01 * w1)) + _r32(a02 * w2)) + _r32(a03 * w3)
            )
            y[t + 1, j] = _r32(
                _r32(_r32(_r32(y[t + 1, j] + _r32(a10 * w0)) + _r32(a11 * w1)) + _r32(a12 * w2)) + _r32(a13 * w3)
            )
            y[t + 2, j] = _r32(
                _r32(_r32(_r32(y[t + 2, j] + _r32(a20 * w0)) + _r32(a21 * w1)) + _r32(a22 * w2)) + _r32(a23 * w3)
            )
            y[t + 3, j] = _r32(
                _r32(_r32(_r32(y[t + 3, j] + _r32(a30 * w0)) + _r32(a31 * w1)) + _r32(a32 * w2)) + _r32(a33 * w3)
            )
        k += 4
    while k < n:
        a00 = x[t, k]
        a10 = x[t + 1, k]
        a20 = x[t + 2, k]
        a30 = x[t + 3, k]
        for j in range(m):
            w0 = w[k, j]
            y[t, j] = _r32(y[t, j] + _r32(a00 * w0))
            y[t + 1, j] = _r32(y[t + 1, j] + _r32(a10 * w0))
            y[t + 2, j] = _r32(y[t + 2, j] + _r32(a20 * w0))
            y[t + 3, j] = _r32(y[t + 3, j] + _r32(a30 * w0))
        k += 1


@nb.njit(**_JIT)
def _rows1_f32(x, w, t, y):
    """``y[t] = x[t] @ w`` with a f32 accumulator, each element summed over k left to right."""
    n = x.shape[1]
    m = w.shape[1]
    for j in range(m):
        y[t, j] = -0.0
    k = 0
    while k + 2 <= n:
        a00, a01 = x[t, k], x[t, k + 1]
        for j in range(m):
            w0, w1 = w[k, j], w[k + 1, j]
            y[t, j] = _r32(_r32(y[t, j] + _r32(a00 * w0)) + _r32(a01 * w1))
        k += 2
    while k < n:
        a00 = x[t, k]
        for j in range(m):
            w0 = w[k, j]
            y[t, j] = _r32(y[t, j] + _r32(a00 * w0))
        k += 1


@nb.njit(**_JIT)
def _rows4_bf16(x, w, t, y):
    """``y[t:t+4] = x[t:t+4] @ w`` with a bf16 accumulator, each element summed over k left to right."""
    n = x.shape[1]
    m = w.shape[1]
    for j in range(m):
        y[t, j] = -0.0
        y[t + 1, j] = -0.0
        y[t + 2, j] = -0.0
        y[t + 3, j] = -0.0
    k = 0
    while k < n:
        a00 = x[t, k]
        a10 = x[t + 1, k]
        a20 = x[t + 2, k]
        a30 = x[t + 3, k]
        for j in range(m):
            w0 = w[k, j]
            y[t, j] = _rbf(y[t, j] + _rbf(a00 * w0))
            y[t + 1, j] = _rbf(y[t + 1, j] + _rbf(a10 * w0))
            y[t + 2, j] = _rbf(y[t + 2, j] + _rbf(a20 * w0))
            y[t + 3, j] = _rbf(y[t + 3, j] + _rbf(a30 * w0))
        k += 1


@nb.njit(**_JIT)
def _rows1_bf16(x, w, t, y):
    """``y[t] = x[t] @ w`` with a bf16 accumulator, each element summed over k left to right."""
    n = x.shape[1]
    m = w.shape[1]
    for j in range(m):
        y[t, j] = -0.0
    k = 0
    while k < n:
        a00 = x[t, k]
        for j in range(m):
            w0 = w[k, j]
            y[t, j] = _rbf(y[t, j] + _rbf(a00 * w0))
        k += 1


@nb.njit(**_JIT)
def _four_rows_sequential(x: np.ndarray, w: np.ndarray, t: int, y: np.ndarray, acc: int) -> None:
    """``y[t:t+4] = x[t:t+4] @ w`` in sequential order with accumulator ``acc`` (no storage rounding).

    Requires ``x.shape[0] >= t + 4`` and ``x.shape[1] >= 1``. :func:`matmul_into` makes the same
    choice once per call rather than calling this per block (each call level adds compile time).
    """
    if acc == F64:
        _rows4_f64(x, w, t, y)
    elif acc == F32:
        _rows4_f32(x, w, t, y)
    else:
        _rows4_bf16(x, w, t, y)


@nb.njit(**_JIT)
def matmul_into(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int, y: np.ndarray) -> None:
    """``y[:] = x @ w`` (x: (T, n), w: (n, m), y: (T, m)) in ``order``, stored in ``storage``.

    Element ``y[t, j]`` is the sum over k of ``x[t, k] * w[k, j]`` in ``order``
    (:mod:`kvfast.kernels.reduce`), products and adds rounded to ``acc``, the
    result rounded to ``storage``; an empty sum (n = 0) is ``0.0``. ``y`` must
    not overlap ``x`` or ``w``.
    """
    T, n = x.shape
    m = w.shape[1]
    if n == 0:
        for r in range(T):
            for j in range(m):
                y[r, j] = 0.0
    elif order == SEQUENTIAL:
        t = 0
        if acc == F64:
            while t + 4 <= T:
                _rows4_f64(x, w, t, y)
                t += 4
            while t < T:
                _rows1_f64(x, w, t, y)
                t += 1
        elif acc == F32:
            while t + 4 <= T:
                _rows4_f32(x, w, t, y)
                t += 4
            while t < T:
                _rows1_f32(x, w, t, y)
                t += 1
        else:
            while t + 4 <= T:
                _rows4_bf16(x, w, t, y)
                t += 4
            while t < T:
                _rows1_bf16(x, w, t, y)
                t += 1
    else:
        stack = new_stack(m)
        for r in range(T):
            weighted_rows_sum(x[r], 0, w, 0, n, 0, m, acc, order, y[r], stack)
    if storage != F64:
        for r in range(T):
            for j in range(m):
                y[r, j] = rnd(y[r, j], storage)


@nb.njit(**_JIT)
def matmul(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int) -> np.ndarray:
    """``x @ w`` as a new (T, m) array; see :func:`matmul_into`."""
    y = np.empty((x.shape[0], w.shape[1]), dtype=np.float64)
    matmul_into(x, w, storage, acc, order, y)
    return y
