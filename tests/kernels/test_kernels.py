"""The kernels against naive reference twins, bit for bit; the order knob is real; no FMA.

References live in ``tests/kvref.py`` and are written from the documented
definitions (module docstrings of ``kvfast.kernels.reduce`` and
``kvfast.kernels.attention``), never from the kernels. All comparisons are of
bit patterns (``==`` on ``uint64`` views).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kvref
import llvmlite.binding as llvm
import numba as nb
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from shared import TESTS

from kvfast.kernels import attention, matmul, precision, reduce, rowops
from kvfast.kernels.attention import attend_row, attention_into
from kvfast.kernels.bodies import EMPTY, specialise
from kvfast.kernels.indirect import BY_ADDRESS_SUFFIX
from kvfast.kernels.matmul import matmul as kmatmul
from kvfast.kernels.precision import BF16, F32, F64, Formats, round_array
from kvfast.kernels.reduce import (
    PAIRWISE,
    SEQUENTIAL,
    STACK_DEPTH,
    new_stack,
    ordered_dot,
    ordered_sum,
    weighted_rows_sum,
)
from kvfast.kernels.rowops import add_into, embed_into, exp_array, rmsnorm_into, rmsnorm_row, silu_into

FORMATS = (F64, F32, BF16)
ORDERS = (SEQUENTIAL, PAIRWISE)


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float64)).view(np.uint64)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.array_equal(bits(a), bits(b)))


def spread(rng: np.random.Generator, shape, lo: int = -6, hi: int = 6) -> np.ndarray:
    """Normal values scaled by random powers of two: sums that round often."""
    return rng.standard_normal(shape) * np.exp2(rng.integers(lo, hi, size=shape))


def stack1() -> np.ndarray:
    return np.empty(STACK_DEPTH)


finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False)


# --- reductions ------------------------------------------------------------------------------


def test_sequential_f64_dot_equals_cumsum():
    rng = np.random.default_rng(0)
    for n in list(range(1, 40)) + [64, 127, 128, 129, 1000]:
        a, b = spread(rng, n), spread(rng, n)
        got = ordered_dot(a, 0, b, 0, n, F64, SEQUENTIAL, stack1())
        assert bits(got) == bits(np.cumsum(a * b)[-1])


def test_sequential_f32_dot_equals_float32_cumsum():
    rng = np.random.default_rng(1)
    for n in list(range(1, 40)) + [64, 129, 1000]:
        a32, b32 = spread(rng, n).astype(np.float32), spread(rng, n).astype(np.float32)
        want = np.cumsum(a32 * b32, dtype=np.float32)[-1]
        got = ordered_dot(a32.astype(np.float64), 0, b32.astype(np.float64), 0, n, F32, SEQUENTIAL, stack1())
        assert bits(got) == bits(float(want))


def test_np_sum_is_not_a_sequential_reference():
    """Why the references are cumsum and loops: np.dot / np.sum do not sum left to right."""
    rng = np.random.default_rng(2)
    a, b = spread(rng, (200, 256)), spread(rng, (200, 256))
    seq = np.array([ordered_dot(a[i], 0, b[i], 0, 256, F64, SEQUENTIAL, stack1()) for i in range(200)])
    assert np.array_equal(bits(seq), bits(np.cumsum(a * b, axis=1)[:, -1]))
    assert not np.array_equal(bits(seq), bits(np.sum(a * b, axis=1)))


@pytest.mark.parametrize("acc", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
@given(terms=st.lists(finite, max_size=70), lo=st.integers(0, 3))
def test_ordered_sum_equals_reference(acc, order, terms, lo):
    t = np.array([0.0] * lo + terms)
    got = ordered_sum(t, lo, len(terms), acc, order, stack1())
    assert bits(got) == bits(kvref.ref_sum(terms, acc, order))


@pytest.mark.parametrize("acc", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
@given(pairs=st.lists(st.tuples(finite, finite), max_size=70), a0=st.integers(0, 2), b0=st.integers(0, 2))
def test_ordered_dot_equals_reference(acc, order, pairs, a0, b0):
    a = np.array([1.5] * a0 + [p[0] for p in pairs])
    b = np.array([-2.5] * b0 + [p[1] for p in pairs])
    got = ordered_dot(a, a0, b, b0, len(pairs), acc, order, stack1())
    assert bits(got) == bits(kvref.ref_dot(a[a0:], b[b0:], acc, order))


@pytest.mark.parametrize("order", ORDERS)
def test_float32_accumulator_equals_native_float32(order):
    """The f32 accumulator (op in float64, one rounding) is native float32 arithmetic."""
    rng = np.random.default_rng(3)
    sum_order = kvref.ORDER_SUM[order]
    for n in (1, 2, 3, 5, 8, 13, 31, 64, 100):
        for _ in range(20):
            a = spread(rng, n, -20, 20).astype(np.float32).astype(np.float64)
            b = spread(rng, n, -20, 20).astype(np.float32).astype(np.float64)
            native = sum_order([kvref.mul_f32_native(x, y) for x, y in zip(a, b, strict=True)], kvref.add_f32_native)
            assert bits(ordered_dot(a, 0, b, 0, n, F32, order, stack1())) == bits(native)
            native_sum = sum_order(list(a), kvref.add_f32_native)
            assert bits(ordered_sum(a, 0, n, F32, order, stack1())) == bits(native_sum)


def test_pairwise_tree_shape_for_six_terms():
    """The docstring's example, n = 6: ((t0+t1)+(t2+t3)) + (t4+t5), on inputs where that
    tree's float64 result differs from every other plausible tree's."""
    rng = np.random.default_rng(13)
    others = [
        lambda t: ((((t[0] + t[1]) + t[2]) + t[3]) + t[4]) + t[5],
        lambda t: (t[0] + t[1]) + ((t[2] + t[3]) + (t[4] + t[5])),
        lambda t: ((t[0] + t[1]) + t[2]) + ((t[3] + t[4]) + t[5]),
        lambda t: ((t[0] + t[1]) + (t[2] + t[3])) + t[4] + t[5],
        lambda t: (t[0] + ((t[1] + t[2]) + (t[3] + t[4]))) + t[5],
    ]
    found = 0
    for _ in range(2000):
        t = list(spread(rng, 6, -30, 30))
        want = ((t[0] + t[1]) + (t[2] + t[3])) + (t[4] + t[5])
        if all(f(t) != want for f in others):
            found += 1
            assert ordered_sum(np.array(t), 0, 6, F64, PAIRWISE, stack1()) == want
    assert found > 0


def test_ordered_sum_rounds_each_term_to_the_accumulator():
    """A one-term bf16 sum is a bfloat16 (the terms enter the accumulator rounded)."""
    x = 1.0 + 2.0**-8 + 2.0**-30  # not a bfloat16; rounds to 1 + 2^-7
    t = np.array([x, x])
    for order in ORDERS:
        one = ordered_sum(t, 0, 1, BF16, order, stack1())
        assert bits(one) == bits(kvref.bf16_exact(x))
        assert bits(ordered_sum(t, 0, 2, BF16, order, stack1())) == bits(kvref.ref_sum([x, x], BF16, order))


@pytest.mark.parametrize("acc", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
def test_weighted_rows_sum_equals_reference(acc, order):
    rng = np.random.default_rng(4)
    for n, m, c0, r0, col0 in [(0, 3, 0, 0, 0), (1, 5, 1, 2, 1), (6, 4, 0, 1, 2), (17, 7, 2, 0, 0), (33, 3, 0, 3, 4)]:
        coef = spread(rng, c0 + n)
        rows = spread(rng, (r0 + n, col0 + m + 2))
        out = np.full(m, np.nan)
        weighted_rows_sum(coef, c0, rows, r0, n, col0, m, acc, order, out, new_stack(m))
        want = [kvref.ref_dot(coef[c0 : c0 + n], rows[r0 : r0 + n, col0 + j], acc, order) for j in range(m)]
        assert same_bits(out, want)


# --- matmul ----------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", FORMATS)
@pytest.mark.parametrize("acc", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
def test_matmul_equals_per_element_reference(storage, acc, order):
    rng = np.random.default_rng(5)
    for T, n, m in [(1, 1, 1), (1, 9, 5), (4, 8, 3), (5, 13, 7), (9, 6, 4), (3, 0, 2), (17, 33, 19)]:
        x = round_array(spread(rng, (T, n)), storage)
        w = round_array(spread(rng, (n, m)), storage)
        got = kmatmul(x, w, storage, acc, order)
        assert same_bits(got, kvref.ref_matmul(x, w, storage, acc, order)), (T, n, m)


@pytest.mark.parametrize("order", ORDERS)
def test_matmul_row_never_depends_on_the_batch(order):
    """Row t of a T-row product equals the product of that row alone (prefill vs decode shape)."""
    rng = np.random.default_rng(6)
    for storage, acc in [(F64, F64), (F32, F32), (BF16, F32), (BF16, BF16)]:
        x = round_array(spread(rng, (11, 24)), storage)
        w = round_array(spread(rng, (24, 10)), storage)
        full = kmatmul(x, w, storage, acc, order)
        for t in range(x.shape[0]):
            assert same_bits(full[t : t + 1], kmatmul(x[t : t + 1], w, storage, acc, order))
            assert same_bits(full[: t + 1], kmatmul(x[: t + 1], w, storage, acc, order))


def edge_values(rng: np.random.Generator, shape, fmt: int) -> np.ndarray:
    """Values on format ``fmt``'s grid whose products and sums hit the accumulator's hard cases:
    short significands (exact ties at bfloat16 and float32 midpoints), magnitudes near bfloat16's
    overflow and subnormal thresholds, signed zeros, infinities and NaNs."""
    size = int(np.prod(shape))
    short = rng.integers(-255, 256, size=size) * np.exp2(rng.integers(-12, 4, size=size).astype(float))
    big = rng.integers(-255, 256, size=size) * np.exp2(rng.integers(56, 58, size=size).astype(float))
    tiny = rng.integers(-255, 256, size=size) * np.exp2(rng.integers(-80, -60, size=size).astype(float))
    wide = rng.standard_normal(size) * np.exp2(rng.integers(-140, 125, size=size).astype(float))
    v = np.choose(rng.integers(0, 4, size=size), [short, big, tiny, wide])
    special = rng.random(size) < 0.02
    v[special] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan]), size=int(special.sum()))
    return round_array(v.reshape(shape), fmt)


def same_bits_or_nan(a, b) -> bool:
    """Bit-equal, or both NaN (which NaN operand's sign an add keeps is the compiler's choice)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.all((bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("acc", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
def test_matmul_equals_reference_on_edge_values(acc, order):
    """The float32-lane kernels (inputs on the accumulator's grid, T >= 4) and the float64-lane ones
    (T < 4) against the per-element twin: ties, overflow, subnormals, signed zeros, inf, NaN;
    n = 0..19 covers every pairwise tail (blocks of 8, 4, 2, 1)."""
    rng = np.random.default_rng(14)
    for n in range(20):
        for T in (1, 5):
            x, w = edge_values(rng, (T, n), acc), edge_values(rng, (n, 6), acc)
            got = kmatmul(x, w, acc, acc, order)
            assert same_bits_or_nan(got, kvref.ref_matmul(x, w, acc, acc, order)), (n, T)


@nb.njit
def _products_both_lanes(x, w, order, acc_is_bf16):
    """matmul's product in float64 lanes and in float32 lanes on the same inputs."""
    y64 = np.empty((x.shape[0], w.shape[1]))
    y32 = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    if acc_is_bf16:
        matmul._product_bf16(x, w, order, y64)
        matmul._product_bf16_on_f32(x32, w32, order, y32)
    else:
        matmul._product_f32(x, w, order, y64)
        matmul._product_f32_on_f32(x32, w32, order, y32)
    return y64, y32.astype(np.float64)


@pytest.mark.parametrize("acc", [F32, BF16])
@pytest.mark.parametrize("order", ORDERS)
def test_float32_lanes_equal_float64_lanes(acc, order):
    """The float32-lane product (native float32 ops; bf16 rounding of float32 bits) equals the float64
    one (each op in float64, rounded once) on a large sample of edge values on the grid (finite ones
    for bf16, whose float32 lanes take only those; products still overflow to inf)."""
    rng = np.random.default_rng(15)
    for T, n, m in [(9, 67, 130), (4, 300, 64), (33, 16, 257), (1, 1000, 40)]:
        for _ in range(6):
            x, w = edge_values(rng, (T, n), acc), edge_values(rng, (n, m), acc)
            if acc == BF16:  # matmul_into sends NaN and inf inputs down the float64 lanes
                x[~np.isfinite(x)], w[~np.isfinite(w)] = 0.0, -0.0
            y64, y32 = _products_both_lanes(x, w, order, acc == BF16)
            assert same_bits_or_nan(y64, y32), (T, n, m)


# --- the product size classes: plain and unrolled bodies ------------------------------------------

# (template form, accumulator, float32 data): the f64 and f32 bodies come in both forms
_BOTH_FORMS = [
    ("_product_plain_f64", "_product_f64", F64, False),
    ("_product_plain_f32", "_product_f32", F32, False),
    ("_product_plain_f32_on_f32", "_product_f32_on_f32", F32, True),
]
# shapes through every path of both templates: the 4-row blocks and the rows left over, the 4-k passes and the
# k left over, every pairwise tail (n mod 8) and several merges of the binary counter
_SHAPES = [(1, 1, 1), (1, 7, 3), (3, 9, 5), (4, 8, 3), (5, 13, 7), (8, 16, 9), (9, 33, 2), (13, 70, 11)]


@pytest.mark.parametrize("plain, unrolled, acc, data32", _BOTH_FORMS)
@pytest.mark.parametrize("order", ORDERS)
def test_plain_and_unrolled_bodies_equal_the_reference(plain, unrolled, acc, data32, order):
    """Both forms of the f64 and f32 product bodies (the small and the large size class,
    ``matmul.size_class``) against the per-element naive twin, bit for bit, on the edge values of
    ``edge_values`` (ties, overflow, subnormals, signed zeros, inf, NaN; finite ones on float32 data)."""
    rng = np.random.default_rng(16)
    dt = np.float32 if data32 else np.float64
    for T, n, m in _SHAPES:
        x, w = edge_values(rng, (T, n), acc), edge_values(rng, (n, m), acc)
        if data32:  # _narrowed sends only float32 values down the float32 lanes
            x[~np.isfinite(x)], w[~np.isfinite(w)] = 0.0, -0.0
        want = kvref.ref_matmul(x, w, F64, acc, order)  # no storage rounding: the body's own result
        for name in (plain, unrolled):
            y = np.full((T, m), np.nan, dtype=dt)
            getattr(matmul, name)(x.astype(dt), w.astype(dt), order, y)
            assert same_bits_or_nan(y.astype(np.float64), want), (name, T, n, m)


@pytest.mark.parametrize("acc", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
def test_the_size_class_never_changes_a_value(acc, order):
    """``matmul_with`` with the small class's bodies and with the large class's (``product_bodies(acc,
    large)``), float64 and float32 lanes, every storage format: the same bits, and the per-element twin's;
    ``matmul_into`` picks the class from the shape (``size_class``) and gives them too."""
    rng = np.random.default_rng(17)
    assert not matmul.size_class(3, 32, 64) and matmul.size_class(4, 32, 64) and matmul.size_class(1, 64, 64)
    assert not matmul.size_class(1, 32, 64) and not matmul.size_class(64, 16, 32)
    # f32 unrolls only from 4 rows by 256 x 256 (the precision grid's wide models stay plain), bf16 never
    assert matmul.size_class(4, 256, 256, F32) and not matmul.size_class(3, 256, 256, F32)
    assert not matmul.size_class(32, 64, 256, F32) and not matmul.size_class(1, 256, 1024, F32)
    assert matmul.size_class(32, 64, 256, F64) and not matmul.size_class(256, 256, 256, BF16)
    for T, n, m in [(1, 9, 5), (3, 40, 17), (4, 64, 64), (6, 33, 70), (17, 16, 130)]:
        for storage in FORMATS:
            x = round_array(spread(rng, (T, n)), storage)
            w = round_array(spread(rng, (n, m)), storage)
            want = kvref.ref_matmul(x, w, storage, acc, order)
            for large in (False, True):
                y = np.full((T, m), np.nan)
                matmul.matmul_with(x, w, storage, acc, order, y, matmul.product_bodies(acc, large))
                assert same_bits(y, want), (T, n, m, storage, large)
            assert same_bits(kmatmul(x, w, storage, acc, order), want), (T, n, m, storage)


def test_the_small_class_compiles_no_unrolled_body():
    """``product_bodies(acc)`` (the small class) holds the plain bodies' addresses, the large class the
    unrolled ones' (the bf16 bodies are plain in both: one table)."""
    from kvfast.kernels.indirect import address

    def addr(name):
        return address(getattr(matmul, name), matmul.BODY_ON_F32 if name.endswith("_on_f32") else matmul.BODY)

    assert matmul.product_bodies(F64).f64 == addr("_product_plain_f64")
    assert matmul.product_bodies(F64, True).f64 == addr("_product_f64")
    small, large = matmul.product_bodies(F32), matmul.product_bodies(F32, True)
    assert (small.f32_on_f32, small.f32) == (addr("_product_plain_f32_on_f32"), addr("_product_plain_f32"))
    assert (large.f32_on_f32, large.f32) == (addr("_product_f32_on_f32"), addr("_product_f32"))
    assert small.f64 == 0 and small.narrowed != 0  # the f64 body is never reached in the f32 accumulator
    assert matmul.product_bodies(BF16, True) is matmul.product_bodies(BF16)


def test_bf16_round_f32_equals_ml_dtypes_and_the_scalar_rounding():
    """The branch-free 32-bit bfloat16 rounding is ml_dtypes' rounding of float32, bit for bit
    (random patterns, every bf16 midpoint +- 1 float32 ulp, overflow, subnormals, NaNs); so is the
    variant without the NaN select, on everything but NaN."""
    import ml_dtypes

    @nb.njit
    def both(xs):
        a = np.empty_like(xs)
        b = np.empty(xs.size, dtype=np.uint32)
        for i in range(xs.size):
            a[i] = precision.bf16_round_f32(xs[i])
            b[i] = precision.bf16_bits_from_f32_bits(precision.f32_as_u32(xs[i]))
        return a, b

    @nb.njit
    def not_nan(xs):
        out = np.empty_like(xs)
        for i in range(xs.size):
            out[i] = precision.bf16_round_f32_not_nan(xs[i])
        return out

    rng = np.random.default_rng(16)
    pattern = rng.integers(0, 2**32, size=1 << 21, dtype=np.uint64).astype(np.uint32)
    mids = (np.arange(0, 1 << 16, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    near = np.concatenate([mids - np.uint32(1), mids, mids + np.uint32(1)])
    nan_inf = np.array([0x7F800000, 0xFF800000, 0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0x7F7FFFFF], dtype=np.uint32)
    xs = np.concatenate([pattern, near, nan_inf]).view(np.float32)
    a, b = both(xs)
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = xs.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(a.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(a.view(np.uint32), b)
    not_nan_xs = xs[~np.isnan(xs)]  # every pattern but NaN: the same bits without the NaN select
    assert np.array_equal(not_nan(not_nan_xs).view(np.uint32), want[~np.isnan(xs)].view(np.uint32))


# --- attention ----------------------------------------------------------------------------------


COMBOS = [(F64, F64), (F32, F32), (BF16, F32), (BF16, BF16), (F64, BF16), (F32, F64)]


@pytest.mark.parametrize(("storage", "acc"), COMBOS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_rows_equal_reference(storage, acc, order, causal):
    rng = np.random.default_rng(7)
    for T, d, H in [(1, 4, 1), (5, 8, 2), (9, 12, 3)]:
        q = round_array(spread(rng, (T, d), -2, 2), storage)
        k = round_array(spread(rng, (T, d), -2, 2), storage)
        v = round_array(spread(rng, (T, d), -2, 2), storage)
        scale = 1.0 / math.sqrt(d // H)
        out = np.empty((T, d))
        attention_into(q, k, v, 0, T, causal, H, scale, storage, acc, order, out, np.empty((0, 0, 0)))
        for t in range(T):
            hi = t + 1 if causal else T
            want = kvref.ref_attend_row(q[t], k, v, 0, hi, H, scale, storage, acc, order, exp_array)
            assert same_bits(out[t], want), (T, d, H, t)


@pytest.mark.parametrize("order", ORDERS)
def test_attend_row_over_a_window_equals_reference(order):
    rng = np.random.default_rng(8)
    d, H, S = 8, 2, 12
    for storage, acc in COMBOS:
        q = round_array(spread(rng, (1, d), -2, 2), storage)
        kb = round_array(spread(rng, (S, d), -2, 2), storage)
        vb = round_array(spread(rng, (S, d), -2, 2), storage)
        for lo, hi in [(0, 1), (3, 9), (5, 12)]:
            out = np.empty((1, d))
            probs = np.zeros((H, 1, S))
            attend_row(
                q, out, probs, 0, attention.Keys(kb, vb, lo, hi), attention.Heads(H, 0.5), Formats(storage, acc, order),
                attention.new_scratch(S, d // H), attention.attention_kernels(acc),
            )  # fmt: skip
            want = kvref.ref_attend_row(q[0], kb, vb, lo, hi, H, 0.5, storage, acc, order, exp_array)
            assert same_bits(out[0], want)
            assert np.all(probs[:, :, :lo] == 0.0) and np.all(probs[:, :, hi:] == 0.0)


# --- row ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("storage", "acc"), COMBOS)
@pytest.mark.parametrize("order", ORDERS)
def test_rmsnorm_equals_reference(storage, acc, order):
    rng = np.random.default_rng(9)
    for T, d in [(1, 1), (3, 8), (4, 13)]:
        x = round_array(spread(rng, (T, d)), storage)
        g = round_array(1.0 + 0.1 * rng.standard_normal(d), storage)
        out, inv = np.empty((T, d)), np.empty(T)
        rmsnorm_into(x, g, 1e-5, storage, acc, order, out, inv)
        for t in range(T):
            want, want_inv = kvref.ref_rmsnorm_row(x[t], g, 1e-5, storage, acc, order)
            assert same_bits(out[t], want) and bits(inv[t]) == bits(want_inv)


@pytest.mark.parametrize("storage", FORMATS)
def test_elementwise_rowops_equal_reference(storage):
    rng = np.random.default_rng(10)
    r = kvref.ROUND[storage]
    u = spread(rng, (3, 7), -3, 4)
    out = np.empty_like(u)
    silu_into(u, storage, out)
    e = exp_array(-u)
    assert same_bits(out, [[r(u[i, j] / (1.0 + e[i, j])) for j in range(7)] for i in range(3)])
    y = spread(rng, (3, 7))
    add_into(u, y, storage, out)
    assert same_bits(out, [[r(u[i, j] + y[i, j]) for j in range(7)] for i in range(3)])
    wte, wpe = spread(rng, (5, 4)), spread(rng, (6, 4))
    tokens, positions = np.array([4, 0, 4]), np.array([2, 3, 5])
    emb = np.empty((3, 4))
    embed_into(wte, wpe, tokens, positions, storage, emb)
    pairs = zip(tokens, positions, strict=True)
    assert same_bits(emb, [[r(wte[tk, j] + wpe[p, j]) for j in range(4)] for tk, p in pairs])


# --- the order knob is real ---------------------------------------------------------------------


@pytest.mark.parametrize("acc", FORMATS)
def test_orders_give_different_bits(acc):
    """For each format, each order-taking kernel gives different bits in the two orders on
    some inputs (and the reference twins agree that they should)."""
    rng = np.random.default_rng(11)
    n = 37
    found = {"sum": 0, "dot": 0, "rows": 0, "matmul": 0, "attention": 0, "rmsnorm": 0}
    for _ in range(40):
        a, b = round_array(spread(rng, n), acc), round_array(spread(rng, n), acc)
        s = [ordered_sum(a, 0, n, acc, o, stack1()) for o in ORDERS]
        found["sum"] += bits(s[0]) != bits(s[1])
        dt = [ordered_dot(a, 0, b, 0, n, acc, o, stack1()) for o in ORDERS]
        found["dot"] += bits(dt[0]) != bits(dt[1])
        rows = round_array(spread(rng, (n, 3)), acc)
        outs = [np.empty(3), np.empty(3)]
        for o in ORDERS:
            weighted_rows_sum(a, 0, rows, 0, n, 0, 3, acc, o, outs[o], new_stack(3))
        found["rows"] += not same_bits(outs[0], outs[1])
        x = round_array(spread(rng, (5, n)), acc)  # 5 rows: the float32-lane kernels for f32 too
        mm = [kmatmul(x, rows, acc, acc, o) for o in ORDERS]
        found["matmul"] += not same_bits(mm[0], mm[1])
        q, kv = round_array(spread(rng, (1, 12), -1, 2), acc), round_array(spread(rng, (n, 12), -1, 2), acc)
        att = [np.empty((1, 12)), np.empty((1, 12))]
        for o in ORDERS:
            attention_into(q, kv, kv, n - 1, n, True, 1, 0.3, acc, acc, o, att[o], np.empty((0, 0, 0)))
        found["attention"] += not same_bits(att[0], att[1])
        rms = [np.empty((1, n)), np.empty((1, n))]
        for o in ORDERS:
            rmsnorm_row(x, 0, np.ones(n), 1e-5, acc, acc, o, rms[o], 0, stack1())
        found["rmsnorm"] += not same_bits(rms[0], rms[1])
    assert all(v > 0 for v in found.values()), found


def test_orders_differ_on_a_constructed_input():
    """1 + three halves of an ulp: sequential loses each one, pairwise adds two first."""
    half_ulp = np.finfo(np.float64).eps / 2
    t = np.array([1.0, half_ulp, half_ulp, half_ulp])
    seq = ordered_sum(t, 0, 4, F64, SEQUENTIAL, stack1())
    pair = ordered_sum(t, 0, 4, F64, PAIRWISE, stack1())
    assert seq == 1.0 and pair == 1.0 + 2 * half_ulp and seq != pair


# --- no fastmath, no FMA --------------------------------------------------------------------------
#
# The machine code that actually runs is checked: a subprocess records the object code of every
# library Numba loads from its cache (or compiles) while the model's kernels are called, and
# objdump disassembles it. (A kernel loaded from Numba's cache cannot be inspected in-process.)

PRODUCT_BODY_NAMES = tuple(k.__name__ for k in (*matmul.PRODUCT_KERNELS, *matmul.PLAIN_PRODUCT_KERNELS))  # here
DOT_BODY_NAMES = tuple(k.__name__ for k in attention.DOT_KERNELS)
FMA_ASM = re.compile(r"\bv?f(?:n)?m(?:add|sub|addsub|subadd)\d*\w*", re.IGNORECASE)
ORDER_SENSITIVE = (
    "ordered_sum", "ordered_dot", "weighted_rows_sum", "matmul_with", *PRODUCT_BODY_NAMES, "_all_products",
    "score_dots", *DOT_BODY_NAMES,
    "attend_row", "attend_row_blocked", "attention_with", "rmsnorm_row", "rmsnorm_into", "silu_into", "rnd",
    "_round_flat", "forward_kernel", "decode_kernel",
)  # fmt: skip
# forward_kernel / decode_kernel: the model's compiled entries (kvfast/model/compiled.py, generation.py), into
# which the block is inlined; matmul_with / _product_*: the format dispatch and the product bodies it calls by
# address (one per format and data type, written out from one template: kvfast.kernels.bodies)

PROBE = r"""
import json, os, sys
from numba.core import codegen

captured = []
_set = codegen.CodeLibrary._set_compiled_object


def _record_loaded(self, value):  # object code loaded from Numba's cache
    captured.append((self.name, value))
    return _set(self, value)


_hook = codegen.CPUCodeLibrary._object_compiled_hook.__func__


def _record_compiled(cls, ll_module, buf):  # object code compiled now (cold cache)
    lib = getattr(ll_module, "_CPUCodeLibrary__library", None)
    captured.append((getattr(lib, "name", "?"), buf))
    return _hook(cls, ll_module, buf)


codegen.CodeLibrary._set_compiled_object = _record_loaded
codegen.CPUCodeLibrary._object_compiled_hook = classmethod(_record_compiled)

import numba as nb
import numpy as np

sys.path[:0] = sys.argv[1].split(os.pathsep)  # this folder and tests/ (kvref)
import test_kernels

test_kernels._representative_calls()


def control(fastmath):
    f = nb.njit(fastmath=fastmath)(test_kernels._dot)
    f(np.ones(4), np.ones(4))
    lib = f.overloads[f.signatures[0]].library
    return lib._codegen._tm.emit_object(lib._final_module)


captured += [("control_plain", control(False)), ("control_fast", control(True)),
             ("control_contract", control({"contract"}))]
out = []
for i, (name, buf) in enumerate(captured):
    path = os.path.join(sys.argv[2], f"{i}.o")
    with open(path, "wb") as fh:
        fh.write(buf)
    out.append((name, path))
print(json.dumps(out))
"""


def _dot(a, b):
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@nb.njit(fastmath=False)
def _all_products(x, w, y, x32, w32, y32):
    """matmul's product bodies (``_product_template`` written out for each format and data type) in every
    accumulator format, data type and order, linked into one library."""
    for order in (SEQUENTIAL, PAIRWISE):
        for rows in (4, 1):
            matmul._product_f64(x[:rows], w, order, y[:rows])
            matmul._product_f32(x[:rows], w, order, y[:rows])
            matmul._product_bf16(x[:rows], w, order, y[:rows])
            matmul._product_f32_on_f32(x32[:rows], w32, order, y32[:rows])
            matmul._product_bf16_on_f32(x32[:rows], w32, order, y32[:rows])


def _representative_calls():
    """Call every order-sensitive kernel with the argument types the model uses."""
    rng = np.random.default_rng(12)
    v = rng.standard_normal(8)
    m2 = rng.standard_normal((8, 8))
    st_ = np.empty(STACK_DEPTH)
    ordered_sum(v, 0, 8, F64, SEQUENTIAL, st_)
    ordered_dot(v, 0, v, 0, 8, F64, SEQUENTIAL, st_)
    out = np.empty(8)
    weighted_rows_sum(v, 0, m2, 0, 8, 0, 8, F64, SEQUENTIAL, out, new_stack(8))
    y = np.empty((8, 8))
    matmul.matmul_into(m2, m2, F64, F64, SEQUENTIAL, y)
    kmatmul(m2, m2, F64, F64, SEQUENTIAL)
    for fmt in FORMATS:  # every rounding each product kernel is compiled with, in both data types
        for order in ORDERS:
            kmatmul(round_array(m2, fmt), round_array(m2, fmt), fmt, fmt, order)  # float32 copies (bf16: any T)
            kmatmul(m2[:1], m2, fmt, fmt, order)  # float64 data (f32: fewer than 4 rows)
            kmatmul(m2, m2, F64, fmt, order)  # float64 data (values off the accumulator's grid)
            big = rng.standard_normal((4, 64))  # the large size class: the unrolled bodies, through matmul
            kmatmul(round_array(big, fmt), round_array(big.T @ big, fmt), fmt, fmt, order)
            kmatmul(big, big.T @ big, F64, fmt, order)
    for fmt in FORMATS:
        attention.score_dots(v, 0, m2, 0, 8, 8, fmt, SEQUENTIAL, st_, out, attention.attention_kernels(fmt))
    m32 = m2.astype(np.float32)
    _all_products(m2, m2, y, m32, m32, np.empty((8, 8), dtype=np.float32))
    attention_into(m2, m2, m2, 0, 8, True, 2, 0.5, F64, F64, SEQUENTIAL, y, np.empty((0, 0, 0)))
    keys, heads, work = attention.Keys(m2, m2, 0, 8), attention.Heads(2, 0.5), attention.new_scratch(8, 4)
    fmt64 = Formats(F64, F64, SEQUENTIAL)
    attend_row(m2, y, np.empty((0, 0, 0)), 0, keys, heads, fmt64, work, attention.attention_kernels(F64))
    for mode in (attention.ONLINE, attention.SPLITKV):
        attention_into(m2, m2, m2, 0, 8, True, 2, 0.5, F64, F64, SEQUENTIAL, y, np.empty((0, 0, 0)), mode, 4)
        attention.attend_row_blocked(m2, y, 0, keys, heads, fmt64, attention.Blocks(mode, 3, 0, 8), work,
                                     attention.attention_kernels(F64, mode))  # fmt: skip
    rmsnorm_into(m2, v, 1e-5, F64, F64, SEQUENTIAL, y, np.empty(8))
    rmsnorm_row(m2, 0, v, 1e-5, F64, F64, SEQUENTIAL, y, 0, st_)
    silu_into(m2, F64, y)
    precision.rnd(1.0, BF16)
    round_array(m2, BF16)

    from kvfast import ModelConfig, decode_step, forward, init_params
    from kvfast.model.cache import KVCache
    from kvfast.numerics import Numerics

    cfg = ModelConfig(vocab=5, d_model=4, n_head=2, n_layer=1, d_ff=4, max_pos=4)
    p = init_params(cfg, 0)
    for preset in ("f64", "f32", "bf16"):  # the per-format entries of every preset
        nx = Numerics.preset(preset)
        cache = KVCache.empty(cfg, nx, 4)
        forward(cfg, p, [1, 2], nx, cache)
        decode_step(cfg, p, cache, 3, 2, nx)


@pytest.fixture(scope="module")
def machine_code(tmp_path_factory):
    """Disassembly of every Numba library the model's kernels run, by library name."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump is not installed")
    tmp = tmp_path_factory.mktemp("objects")
    run = subprocess.run(
        [sys.executable, "-c", PROBE, os.pathsep.join([str(Path(__file__).parent), str(TESTS)]), str(tmp)],
        capture_output=True, text=True, check=True, env=os.environ.copy(),
    )  # fmt: skip
    found: dict[str, list[str]] = {}
    for name, path in json.loads(run.stdout.strip().splitlines()[-1]):
        asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", path], capture_output=True, text=True, check=True)
        # a closure's name without its scope, a kernel's twin for calls by address under the kernel's name
        found.setdefault(name.rsplit(".", 1)[-1].removesuffix(BY_ADDRESS_SUFFIX), []).append(asm.stdout)
    return found


def test_no_kernel_is_compiled_with_fastmath():
    from kvfast.model.compiled import forward_kernel
    from kvfast.model.generation import decode_kernel

    kernels = [getattr(mod, name) for mod in (reduce, matmul, attention, rowops, precision) for name in dir(mod)]
    kernels = [k for k in kernels if isinstance(k, nb.core.registry.CPUDispatcher)] + [decode_kernel, _all_products]
    kernels += [forward_kernel]
    assert {k.__name__ for k in kernels} >= set(ORDER_SENSITIVE)
    for k in kernels:
        assert k.targetoptions.get("fastmath", False) is False, k.__name__


@pytest.mark.subprocess
def test_no_fused_multiply_add_in_the_machine_code(machine_code):
    for name in ORDER_SENSITIVE:
        assert name in machine_code, f"{name}: no machine code recorded"
        for asm in machine_code[name]:
            assert "ret" in asm  # real code was disassembled
            fused = sorted(set(FMA_ASM.findall(asm)))
            assert not fused, (name, fused[:5])
    # the multiplying kernels really multiply (in scalar or vector form); the compiled forward and decode
    # call them by address (kvfast.model.compiled.Kernels), so their own code need not
    for name in ("ordered_dot", "_all_products", "_dots_sequential_f64", "attend_row", "attend_row_blocked",
                 "rmsnorm_row", *PRODUCT_BODY_NAMES):  # fmt: skip
        precision = "[sd]" if name.endswith("_on_f32") else "d"  # float32 data multiplies in single precision
        assert any(re.search(rf"\bvmul[sp]{precision}\b", asm) for asm in machine_code[name]), name
    # matmul runs float32 lanes (f32 and bf16 accumulators) with the bf16 rounding in integer lanes
    for names in (["_all_products"], ["_product_f32_on_f32", "_product_bf16_on_f32"]):
        asm = "".join("".join(machine_code[name]) for name in names)
        assert re.search(r"\bvmulps\b", asm) and re.search(r"\bvpaddd\b", asm), names


@pytest.mark.subprocess
@pytest.mark.skipif(not llvm.get_host_cpu_features().get("fma", False), reason="this CPU has no FMA")
def test_fma_detector_can_fail(machine_code):
    """Control: the same disassembly check finds the FMA that fastmath, or contraction alone, produces."""
    assert not FMA_ASM.findall(machine_code["control_plain"][0])
    assert FMA_ASM.findall(machine_code["control_fast"][0])
    assert FMA_ASM.findall(machine_code["control_contract"][0])


def _empty_template(n):
    return EMPTY((n, 2))


def test_the_empty_macro_allocates_the_bodys_data_type():
    """A template's ``EMPTY(shape)`` is ``np.empty(shape)`` in a body on float64 data (the form the other
    kernels allocate with: ``np.empty`` compiled once for all) and float32 in a body on float32 data."""
    wide = specialise(_empty_template, F64, False, base="_test_empty")
    narrow = specialise(_empty_template, F32, True, base="_test_empty")
    assert wide(3).dtype == np.float64 and wide(3).shape == (3, 2)
    assert narrow(3).dtype == np.float32 and narrow(3).shape == (3, 2)
    with pytest.raises(NotImplementedError):
        _empty_template(1)  # never meaningful unwritten
