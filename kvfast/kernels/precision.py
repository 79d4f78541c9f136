"""Number formats by software rounding.

Every value kvfast computes is held in a float64 array; a *format* says which
grid that value has been rounded onto. ``F64`` is the identity, ``F32`` rounds to
the nearest float32, ``BF16`` to the nearest bfloat16. All roundings are round
to nearest, ties to even, with overflow to +-inf and gradual underflow
(subnormals are rounded, never flushed).

The kernels pass the format as a small integer so that one compiled signature
serves every combination; LLVM hoists the branch out of inner loops.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kvfast.kernels.indirect import one_compile_at_a_time
from kvfast.kernels.jit import JIT_OPTIONS as _JIT

F64 = 0
F32 = 1
BF16 = 2

FORMAT_CODES = {"f64": F64, "f32": F32, "bf16": BF16}
FORMAT_NAMES = {code: name for name, code in FORMAT_CODES.items()}


class Formats(NamedTuple):
    """What a kernel computes in, as codes (:attr:`kvfast.numerics.Numerics.codes`): the format every stored value
    is rounded to, the format running sums are held in (this module's codes) and the summation order
    (:mod:`kvfast.kernels.reduce`'s)."""

    storage: int
    acc: int
    order: int


FORMATS = types.NamedUniTuple(types.int64, 3, Formats)
"""The Numba type of a :class:`Formats` record."""


def _bitcast(kind: type[types.Number], bits: int, target: types.Number, doc: str):
    """An intrinsic that reinterprets the bits of a ``bits``-wide number of ``kind`` (``types.Float`` or
    ``types.Integer``) as ``target`` of the same width: no allocation, no conversion (``doc``: its doc)."""

    def reinterpret(typingctx, x):
        if not isinstance(x, kind) or x.bitwidth != bits:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))

        return target(x), codegen

    reinterpret.__doc__ = doc
    return intrinsic(reinterpret)


f32_as_u32 = _bitcast(types.Float, 32, types.uint32, "Reinterpret a float32's bits as uint32.")


@intrinsic
def u32_as_f32(typingctx, x):
    """The float32 whose bits are the low 32 bits of integer ``x``.

    Numba widens uint32 arithmetic to 64 bits, so wider integers are accepted
    and truncated."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if signature.args[0].bitwidth > 32:
            value = builder.trunc(value, context.get_value_type(types.uint32))
        return builder.bitcast(value, context.get_value_type(types.float32))

    return types.float32(x), codegen


def _bf16_round_f32_codegen(with_nan: bool):
    """LLVM IR of the float32 -> bfloat16 rounding, in 32-bit integer operations."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lsb)
        rounded = builder.and_(rounded, ir.Constant(i32, 0xFFFF0000))
        if with_nan:
            quiet_nan = builder.or_(builder.and_(bits, ir.Constant(i32, 0x80000000)), ir.Constant(i32, 0x7FC00000))
            is_nan = builder.fcmp_unordered("uno", args[0], args[0])
            rounded = builder.select(is_nan, quiet_nan, rounded)
        return builder.bitcast(rounded, ir.FloatType())

    return codegen


@intrinsic
def bf16_round_f32(typingctx, x):
    """The bfloat16 nearest to the float32 ``x``, as a float32, in 32-bit integer operations.

    :func:`bf16_bits_from_f32_bits` without branches and without Numba's
    widening of uint32 arithmetic to 64 bits, so that a loop over it
    vectorises with as many lanes as float32 has: round to nearest even on the
    low 16 bits (a carry out of the mantissa bumps the exponent, which gives
    inf exactly when a correct rounding overflows), and NaN becomes the quiet
    NaN with its sign (a select, not a branch).
    """
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None
    return types.float32(x), _bf16_round_f32_codegen(with_nan=True)


@intrinsic
def bf16_round_f32_not_nan(typingctx, x):
    """:func:`bf16_round_f32` for an ``x`` that is not NaN (finite or +-inf), two operations
    shorter: without the NaN select. On a NaN the result is wrong."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None
    return types.float32(x), _bf16_round_f32_codegen(with_nan=False)


@nb.njit(**_JIT)
def bf16_bits_from_f32_bits(bits: np.uint32) -> np.uint32:
    """The float32 bit pattern of the bfloat16 nearest to the float32 ``bits``.

    Round to nearest even on the low 16 bits; a carry out of the mantissa bumps
    the exponent, which turns the largest finite values into inf exactly when a
    correct rounding would. NaN keeps its sign and becomes the quiet NaN.
    """
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (bits & np.uint32(0x80000000)) | np.uint32(0x7FC00000)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = np.uint32(bits + np.uint32(0x7FFF) + lsb)
    return rounded & np.uint32(0xFFFF0000)


@nb.njit(**_JIT)
def round_bf16_f32_array(x: np.ndarray) -> np.ndarray:
    """Round a float32 array to bfloat16, returned as float32 (same shape)."""
    bits = x.ravel().view(np.uint32)
    out = np.empty(bits.size, dtype=np.uint32)
    for i in range(bits.size):
        out[i] = bf16_bits_from_f32_bits(bits[i])
    return out.view(np.float32).reshape(x.shape)


@nb.njit(**_JIT)
def f32_round_to_odd(x: float) -> np.float32:
    """float64 -> float32 rounded toward zero, with the last bit forced to 1
    when inexact ("round to odd"). Rounding that to any format with at least
    two fewer significand bits gives the correctly rounded result."""
    f = np.float32(x)
    back = np.float64(f)
    if back == x or x != x:
        return f
    bits = f32_as_u32(f)
    if abs(back) > abs(x):
        # np.float32() rounded away from zero (possibly to inf): step back one ulp.
        bits = np.uint32(bits - np.uint32(1))
    bits = bits | np.uint32(1)
    return u32_as_f32(bits)


@nb.njit(**_JIT)
def round_bf16_f64(x: float) -> float:
    """float64 -> nearest bfloat16 in ONE rounding (returned as float64)."""
    f = f32_round_to_odd(x)
    bits = f32_as_u32(f)
    out = bf16_bits_from_f32_bits(bits)
    return np.float64(u32_as_f32(out))


@nb.njit(**_JIT)
def round_bf16_f64_via_f32(x: float) -> float:
    """float64 -> float32 -> bfloat16: two roundings (ml_dtypes' float64 cast before 0.7)."""
    bits = f32_as_u32(np.float32(x))
    out = bf16_bits_from_f32_bits(bits)
    return np.float64(u32_as_f32(out))


_f64_bits = _bitcast(types.Float, 64, types.uint64, "Reinterpret a float64's bits as uint64.")
_bits_f64 = _bitcast(types.Integer, 64, types.float64, "The float64 whose bits are the 64-bit integer ``x``.")


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
    """float64 -> nearest bfloat16 (as float64) without branches, so loops over it vectorise.

    One rounding of float64 to the nearest bfloat16, ties to even, exactly as
    :func:`round_bf16_f64` (both are correctly rounded;
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


@nb.njit(**_JIT)
def rnd(x: float, fmt: int) -> float:
    """Round a float64 value onto the grid of format ``fmt``."""
    if fmt == F64:
        return x
    if fmt == F32:
        return np.float64(np.float32(x))
    return _rbf(x)  # round_bf16_f64 without branches (equal bit for bit; tests/kernels/test_precision.py)


@one_compile_at_a_time
@nb.njit(**_JIT)
def _round_flat(flat: np.ndarray, fmt: int, out: np.ndarray) -> None:
    """``out[i] = rnd(flat[i], fmt)`` for the 1-D float64 arrays of :func:`round_array`."""
    for i in range(flat.size):
        out[i] = rnd(flat[i], fmt)


def elementwise(kernel, x: np.ndarray, arg) -> np.ndarray:
    """``kernel(flat, arg, out)`` over ``x`` (an array of any shape, converted to float64): a new float64 array of
    ``x``'s shape. ``kernel`` is jitted for 1-D writable C-contiguous float64 arrays only, one compile for every
    shape (a jitted function of ``x`` compiled a specialisation per number of dimensions, about 1 s each, and
    another per read-only input)."""
    arr = np.asarray(x, dtype=np.float64)
    flat = np.ascontiguousarray(arr).reshape(-1)
    if not flat.flags.writeable:  # the same array type as a writable one: one compile
        flat = flat.copy()
    out = np.empty(flat.size)
    kernel(flat, arg, out)
    return out.reshape(arr.shape)


def round_array(x: np.ndarray, fmt: int) -> np.ndarray:
    """A float64 copy of ``x`` (an array of any shape, converted to float64) rounded onto format ``fmt``
    (:func:`_round_flat`, through :func:`elementwise`)."""
    return elementwise(_round_flat, x, int(fmt))


@nb.njit(**_JIT)
def _round_bf16_f64_flat(flat: np.ndarray, through_f32: bool, out: np.ndarray) -> None:
    """``out[i]`` = ``flat[i]`` rounded to bfloat16, directly or via float32 (1-D float64 arrays)."""
    for i in range(flat.size):
        out[i] = round_bf16_f64_via_f32(flat[i]) if through_f32 else round_bf16_f64(flat[i])


def to_bfloat16(x: np.ndarray, *, through_f32: bool = False) -> np.ndarray:
    """Round float32 or float64 values to bfloat16.

    float32 input gives float32 output; float64 input gives float64 output,
    rounded directly (one correct rounding) unless ``through_f32=True``, which
    rounds to float32 first (two roundings; what ``x.astype(ml_dtypes.bfloat16)``
    does with float64 before ml_dtypes 0.7, which rounds directly).
    """
    arr = np.asarray(x)
    # np.ascontiguousarray makes a 0-d input 1-d: give the result the input's shape back
    if arr.dtype == np.float32:
        return round_bf16_f32_array(np.ascontiguousarray(arr)).reshape(arr.shape)
    if arr.dtype == np.float64:
        return elementwise(_round_bf16_f64_flat, arr, bool(through_f32))
    raise ValueError(f"x: dtype {arr.dtype} is not supported; allowed: float32, float64")
