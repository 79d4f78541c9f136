"""bfloat16 by software, float64 -> bfloat16 in one rounding, and the format grid of ``rnd``.

Every claim here is exact: results are compared by bit pattern.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvref import bf16_exact, bf16_fast, bf16_through_f32_exact, f32_exact

from kvfast import to_bfloat16
from kvfast.kernels.precision import BF16, F32, F64, rnd, round_array

U32 = np.uint32


def ml_bits(x32: np.ndarray) -> np.ndarray:
    """ml_dtypes' bfloat16 bit patterns (uint16) of float32 ``x32``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return x32.astype(ml_dtypes.bfloat16).view(np.uint16)


def assert_same_as_ml_dtypes(x32: np.ndarray) -> None:
    ours = to_bfloat16(x32)
    assert ours.dtype == np.float32 and ours.shape == x32.shape
    bits = ours.view(U32)
    assert np.all((bits & U32(0xFFFF)) == 0), "result is not a bfloat16 held in float32"
    ml = ml_bits(x32)
    bad = np.flatnonzero((bits >> U32(16)).astype(np.uint16) != ml)
    assert bad.size == 0, [(hex(int(x32.view(U32)[i])), hex(int(bits[i] >> U32(16))), hex(int(ml[i]))) for i in bad[:5]]


def special_float32_bits() -> np.ndarray:
    """Every special class: zeros, infinities, NaNs of both signs with many payloads,
    subnormals (incl. ties), the largest finite values and ties around them, and ties
    to even with both parities of the kept bit in every exponent."""
    fi = np.finfo(np.float32)
    inf = np.array(np.inf, dtype=np.float32).view(U32)
    max_finite = np.array(fi.max, dtype=np.float32).view(U32)
    min_sub = np.array(fi.smallest_subnormal, dtype=np.float32).view(U32)
    min_normal = np.array(fi.smallest_normal, dtype=np.float32).view(U32)
    frac_mask = (1 << 23) - 1  # the 23 fraction bits
    low = 0xFFFF  # the 16 bits a bfloat16 drops
    half = 0x8000  # a tie in the dropped bits
    out = [0, int(inf), int(max_finite), int(min_sub), int(min_normal), int(min_normal) - 1]
    # NaNs: quiet, signalling, every single payload bit, all-ones payload
    out += [int(inf) | (1 << b) for b in range(23)]
    out += [int(inf) | frac_mask, int(inf) | 1, int(inf) | (1 << 22) | 1, int(inf) | low, int(inf) | half]
    # subnormals: all around the ties of the bfloat16 subnormal grid
    for kept in range(0, 1 << 7, 5):
        base = kept << 16
        out += [base | d for d in (0, 1, half - 1, half, half + 1, low)]
    # largest finite and around the overflow threshold
    top = int(max_finite) & ~low
    out += [top | d for d in (0, 1, half - 1, half, half + 1, low)]
    out += [(top - (1 << 16)) | d for d in (half - 1, half, half + 1)]
    # ties to even, both parities of the last kept bit, in every exponent
    for e in range(256):
        for kept in (0, 1, 2, 3, 0x7E, 0x7F):
            base = (e << 23) | (kept << 16)
            out += [base | half, base | (half - 1), base | (half + 1)]
    pos = np.array(out, dtype=np.uint64).astype(U32)
    return np.concatenate([pos, pos | U32(0x80000000)])


def test_special_classes_equal_ml_dtypes():
    bits = special_float32_bits()
    x = bits.view(np.float32)
    # the set really holds every class
    assert np.isnan(x).any() and np.isinf(x).any() and (x == 0).any()
    assert (np.signbit(x) & np.isnan(x)).any() and (~np.signbit(x) & np.isnan(x)).any()
    tiny = np.finfo(np.float32).smallest_normal
    assert ((np.abs(x) < tiny) & (x != 0)).any()
    assert (x == np.finfo(np.float32).max).any()
    assert_same_as_ml_dtypes(x)


def test_nan_keeps_sign_and_is_quiet():
    inf_bits = int(np.array(np.inf, dtype=np.float32).view(U32))
    payloads = np.array([inf_bits | (1 << b) for b in range(23)], dtype=np.uint64).astype(U32)
    for sign in (U32(0), U32(0x80000000)):
        out = to_bfloat16((payloads | sign).view(np.float32))
        assert np.isnan(out).all()
        assert (np.signbit(out) == bool(sign)).all()
        # quiet: the top fraction bit is set
        assert ((out.view(U32) >> U32(22)) & U32(1) == 1).all()


def test_dense_spread_of_2_22_patterns_over_every_exponent():
    rng = np.random.default_rng(20261129)
    per = 1 << 13  # patterns per (sign, exponent): 2 * 256 * 2^13 = 2^22
    sign = np.repeat(np.arange(2, dtype=U32), 256 * per) << U32(31)
    expo = np.tile(np.repeat(np.arange(256, dtype=U32), per), 2) << U32(23)
    frac = rng.integers(0, 1 << 23, size=1 << 22, dtype=np.uint64).astype(U32)
    # a quarter of them put the dropped 16 bits at or right next to a tie
    near = rng.integers(0, 4, size=frac.size) == 0
    delta = rng.integers(-2, 3, size=frac.size)
    tied = (frac & U32(0x7F0000)) | (U32(0x8000) + delta).astype(U32)
    frac = np.where(near, tied, frac)
    bits = sign | expo | frac
    assert bits.size >= 1 << 22
    assert np.unique(bits >> U32(23)).size == 512  # every exponent, both signs
    assert_same_as_ml_dtypes(bits.view(np.float32))


def test_f32_exhaustive_chunk_sample():
    """Two complete 2^24 chunks (one around 1.0, one in the negative subnormals)."""
    for start in (0x3F000000, 0x80000000):
        bits = np.arange(start, start + (1 << 24), dtype=np.uint64).astype(U32)
        assert_same_as_ml_dtypes(bits.view(np.float32))


@pytest.mark.slow
def test_f32_all_2_32_patterns():
    """Every float32 bit pattern, in 256 chunks of 2^24 (opt-in: pytest -m slow -s)."""
    t0 = time.perf_counter()
    chunk = np.arange(1 << 24, dtype=np.uint64).astype(U32)
    for hi in range(256):
        assert_same_as_ml_dtypes((chunk | U32(hi << 24)).view(np.float32))
    wall = time.perf_counter() - t0
    print(f"\nbfloat16 rounding == ml_dtypes on all 2^32 float32 patterns; wall time {wall:.1f} s")


# --- float64 -> bfloat16 in one rounding ----------------------------------------------------


def f64_values_next_to_midpoints(n: int, seed: int) -> np.ndarray:
    """float64 values at, and at many distances from, bfloat16 rounding midpoints,
    across the normal, subnormal and overflow ranges, both signs. Includes the
    double-rounding trap: a value within half a float32 ulp of a midpoint."""
    rng = np.random.default_rng(seed)
    # random bfloat16 values b over the whole exponent range (float32 bits, low 16 zero)
    hi = rng.integers(0, 0x7F80, size=n, dtype=np.uint64).astype(U32)
    b = (hi << U32(16)).view(np.float32).astype(np.float64)
    # ulp of b on the bfloat16 grid (subnormal grid below 2^-126)
    expo = np.maximum(np.floor(np.log2(np.where(b > 0, b, 1.0))), -126)
    expo = np.where(b > 0, expo, -126)
    ulp = np.exp2(expo - 7)
    mid = b + ulp / 2  # exact in float64
    k = rng.integers(9, 60, size=n)
    step = np.exp2(expo - 7 - k)
    sign = np.where(rng.integers(0, 2, size=n) == 0, 1.0, -1.0)
    out = [mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf), mid + step, mid - step]
    # within half a float32 ulp above the midpoint: float32 rounds onto the midpoint first
    f32_ulp = np.exp2(np.maximum(expo, -126) - 23)
    out.append(mid + f32_ulp * rng.uniform(0.01, 0.49, size=n))
    out.append(mid - f32_ulp * rng.uniform(0.01, 0.49, size=n))
    vals = np.concatenate(out) * np.tile(sign, len(out))
    return vals[np.isfinite(vals)]


def f64_specials() -> np.ndarray:
    fi32 = np.finfo(np.float32)
    bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    bf16_ulp_top = bf16_max - float(np.nextafter(ml_dtypes.bfloat16(bf16_max), ml_dtypes.bfloat16(0)))
    threshold = bf16_max + bf16_ulp_top / 2  # the overflow tie
    vals = [
        0.0,
        np.inf,
        np.nan,
        5e-324,
        np.finfo(np.float64).max,
        float(fi32.max) * 2,  # past float32, finite in float64
        float(fi32.smallest_subnormal) / 3,  # below every float32
        threshold,
        np.nextafter(threshold, 0.0),
        np.nextafter(threshold, np.inf),
        bf16_max,
        float(fi32.smallest_normal),
        1.0 + 2.0**-8 + 2.0**-30,  # rounds to 1 + 2^-7 directly, to 1.0 through float32
    ]
    arr = np.array(vals)
    return np.concatenate([arr, -arr])


def test_exact_references_agree():
    """The two independent test references (exact rationals, frexp) agree."""
    vals = np.concatenate([f64_values_next_to_midpoints(2000, 7), f64_specials()])
    for v in vals:
        e, f = bf16_exact(float(v)), bf16_fast(float(v))
        assert (math.isnan(e) and math.isnan(f)) or np.array(e).view(np.uint64) == np.array(f).view(np.uint64)


def _bits64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).view(np.uint64)


def test_f64_direct_rounding_equals_exact_rational_rounding():
    vals = np.concatenate([f64_values_next_to_midpoints(5000, 1), f64_specials()])
    ours = to_bfloat16(vals)
    assert ours.dtype == np.float64
    exact = np.array([bf16_exact(float(v)) for v in vals])
    nan = np.isnan(exact)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(np.signbit(ours[nan]), np.signbit(vals[nan]))
    bad = np.flatnonzero(_bits64(ours[~nan]) != _bits64(exact[~nan]))
    assert bad.size == 0, [(repr(vals[~nan][i]), ours[~nan][i], exact[~nan][i]) for i in bad[:5]]


@given(st.floats(allow_nan=False, allow_infinity=True, allow_subnormal=True))
def test_f64_direct_rounding_property(x):
    got = to_bfloat16(np.array([x]))[0]
    assert _bits64(got) == _bits64(bf16_exact(x))


def test_one_plus_2m8_plus_2m30_rounds_up_directly_and_down_through_float32():
    x = 1.0 + 2.0**-8 + 2.0**-30
    exact = Fraction(x)
    # exactly representable check of the construction, then the two roundings
    assert exact == 1 + Fraction(1, 2**8) + Fraction(1, 2**30)
    assert to_bfloat16(np.array([x]))[0] == 1.0 + 2.0**-7 == bf16_exact(x)
    assert f32_exact(x) == 1.0 + 2.0**-8  # the tie that the first rounding makes
    assert to_bfloat16(np.array([x]), through_f32=True)[0] == 1.0 == bf16_through_f32_exact(x)


def _assert_same_bf16(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, NaNs compared by class and sign (their payloads are the format's canonical NaN)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))
    bad = np.flatnonzero(_bits64(got[~nan]) != _bits64(want[~nan]))
    assert bad.size == 0, [(repr(float(got[~nan][i])), repr(float(want[~nan][i]))) for i in bad[:5]]


def test_through_f32_option_equals_two_roundings_by_exact_rationals():
    """``through_f32=True`` is float64 -> float32 -> bfloat16, each one correct rounding: compared with
    the rational reference of the tests (not with ml_dtypes, whose float64 rounding changed in 0.7)."""
    vals = np.concatenate([f64_values_next_to_midpoints(5000, 2), f64_specials()])
    ours = to_bfloat16(vals, through_f32=True)
    _assert_same_bf16(ours, np.array([bf16_through_f32_exact(float(v)) for v in vals]))
    # and the direct rounding really differs from it near midpoints (double rounding is sometimes wrong)
    direct = to_bfloat16(vals)
    differ = (_bits64(direct) != _bits64(ours)) & ~np.isnan(vals)
    assert differ.sum() > 0
    exact = np.array([bf16_exact(float(v)) for v in vals[differ]])
    assert np.array_equal(_bits64(direct[differ]), _bits64(exact))


# ml_dtypes' own float64 -> bfloat16 cast, by release (measured here, both sides of the change):
# through float32 (two roundings) before 0.7, one correct rounding from 0.7 on.
ML_DTYPES_F64_ROUNDING = ((0, 7), "through_f32", "direct")


def ml_dtypes_cast(vals: np.ndarray) -> np.ndarray:
    """The installed ml_dtypes' float64 -> bfloat16 cast, back in float64."""
    with np.errstate(invalid="ignore", over="ignore"):
        return vals.astype(ml_dtypes.bfloat16).astype(np.float64)


def f64_rounding_of(cast, vals: np.ndarray) -> str:
    """Which of kvfast's two float64 roundings ``cast`` is on ``vals``: ``"direct"``, ``"through_f32"``
    or ``"neither"``."""
    got = cast(vals)
    nan = np.isnan(got)
    for name, ours in (("direct", to_bfloat16(vals)), ("through_f32", to_bfloat16(vals, through_f32=True))):
        if np.array_equal(np.isnan(ours), nan) and np.array_equal(_bits64(ours[~nan]), _bits64(got[~nan])):
            return name
    return "neither"


def test_installed_ml_dtypes_float64_cast_is_one_of_the_two_documented_roundings():
    """Records what the installed ml_dtypes does with float64 (docs/precision.md has the table): it is
    exactly one of kvfast's two roundings, the one documented for its release. kvfast's own results never
    depend on it: ``to_bfloat16`` is checked against the rational references above."""
    vals = np.concatenate([f64_values_next_to_midpoints(5000, 3), f64_specials()])
    version = tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2])
    got = f64_rounding_of(ml_dtypes_cast, vals)
    first_direct, before, after = ML_DTYPES_F64_ROUNDING
    print(f"\nml_dtypes {ml_dtypes.__version__}: float64 -> bfloat16 is {got}")
    assert got == (before if version < first_direct else after), (ml_dtypes.__version__, got)


def test_the_ml_dtypes_record_can_fail():
    """The record tells the two roundings apart, and a third rounding (toward zero) is neither."""
    vals = np.concatenate([f64_values_next_to_midpoints(500, 4), f64_specials()])
    assert f64_rounding_of(to_bfloat16, vals) == "direct"
    assert f64_rounding_of(lambda v: to_bfloat16(v, through_f32=True), vals) == "through_f32"

    def truncate(v: np.ndarray) -> np.ndarray:  # bfloat16 by dropping float32's low 16 bits
        with np.errstate(over="ignore"):
            bits = v.astype(np.float32).view(U32) & U32(0xFFFF0000)
        return bits.view(np.float32).astype(np.float64)

    assert f64_rounding_of(truncate, vals) == "neither"


def test_to_bfloat16_rejects_other_dtypes():
    with pytest.raises(ValueError, match=r"^x: dtype int64"):
        to_bfloat16(np.arange(3))


# --- rnd / round_array: the grids of the three formats ---------------------------------------


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1, max_size=20))
def test_round_array_grids(xs):
    x = np.array(xs, dtype=np.float64)
    with np.errstate(over="ignore"):
        f32 = x.astype(np.float32).astype(np.float64)
    got64 = round_array(x, F64)
    got32 = round_array(x, F32)
    got16 = round_array(x, BF16)
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got64), nan) and np.array_equal(np.isnan(got16), nan)
    assert np.array_equal(_bits64(got64[~nan]), _bits64(x[~nan]))
    assert np.array_equal(_bits64(got32[~nan]), _bits64(f32[~nan]))
    assert np.array_equal(_bits64(got16[~nan]), _bits64(to_bfloat16(x)[~nan]))
    for v in x[~nan]:
        assert _bits64(rnd(float(v), BF16)) == _bits64(bf16_exact(float(v)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_to_bfloat16_keeps_shape_and_dtype(dtype):
    x = np.arange(1, 13, dtype=dtype).reshape(3, 4) / 7
    for arr in (x, x[:, ::2], x[1, 2], np.asarray(x[1, 2]), x[:0], x.T):
        got = to_bfloat16(arr)
        flat = np.asarray(arr).ravel()
        if dtype == np.float32:
            want = flat.astype(ml_dtypes.bfloat16).astype(dtype)
        else:
            want = np.array([bf16_exact(float(v)) for v in flat])
        assert got.shape == np.shape(arr) and got.dtype == dtype
        assert np.array_equal(got.ravel(), want)


def test_matmul_branch_free_bf16_round_equals_round_bf16_f64():
    """matmul's vectorising bf16 rounding (``_rbf``) is the same function as ``round_bf16_f64``,
    bit for bit: random float64 bit patterns, values next to bf16 midpoints, subnormals, overflow,
    signed zeros, infinities and NaNs of both signs."""
    import numba as nb

    from kvfast.kernels.precision import _rbf, round_bf16_f64

    @nb.njit
    def both(xs):
        a = np.empty_like(xs)
        b = np.empty_like(xs)
        for i in range(xs.size):
            a[i] = _rbf(xs[i])
            b[i] = round_bf16_f64(xs[i])
        return a, b

    rng = np.random.default_rng(11)
    random_bits = rng.integers(0, 2**64, size=1 << 20, dtype=np.uint64).view(np.float64)
    tiny = rng.uniform(-1, 1, size=1 << 16) * 2.0 ** rng.integers(-140, -120, size=1 << 16)
    near_max = rng.uniform(0.99, 1.01, size=1 << 12) * 2.0**128
    nans = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0])
    nans = np.concatenate([nans, (np.uint64(0x7FF0000000000001) + np.arange(8, dtype=np.uint64)).view(np.float64)])
    xs = np.concatenate([random_bits, f64_values_next_to_midpoints(20000, 3), f64_specials(), tiny, near_max, nans])
    a, b = both(xs)
    assert (_bits64(a) == _bits64(b)).all()
