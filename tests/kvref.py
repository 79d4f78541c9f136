"""Naive reference twins for the kernels, written from the documented definitions.

Nothing here calls a kvfast kernel except ``exp_array`` (the kernels' own ``exp``,
the C library's: NumPy's ``exp`` may round differently in the last bit, and the
references are compared bit for bit). Pure Python floats are IEEE float64;
float32 arithmetic is native ``np.float32``; bfloat16 rounding is written twice
(exact rationals with ``fractions.Fraction``, and a fast ``frexp`` version that
the tests check against the exact one).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import reduce

import numpy as np

# bfloat16: 8 significand bits (7 stored), exponent range of float32.
BF16_P = 8
BF16_EMIN = -126
BF16_EMAX = 127
F32_P = 24  # float32: the same exponent range, 24 significand bits
F32_EMIN = -126
F32_EMAX = 127


def round_fraction_to_binary(x: Fraction, p: int, emin: int, emax: int) -> Fraction | None:
    """Exact round-to-nearest-even of rational ``x`` onto a binary format with ``p``
    significand bits, minimum normal exponent ``emin`` (gradual underflow) and
    maximum exponent ``emax``. Returns None on overflow (the caller makes inf)."""
    if x == 0:
        return Fraction(0)
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    # now 2^e <= a < 2^(e+1) after at most one correction
    if Fraction(2) ** e > a:
        e -= 1
    assert Fraction(2) ** e <= a < Fraction(2) ** (e + 1)
    quantum = Fraction(2) ** (max(e, emin) - p + 1)
    n = round(a / quantum)  # Fraction.__round__: nearest, ties to even
    r = n * quantum
    if r >= Fraction(2) ** (emax + 1):
        return None
    return r if x > 0 else -r


def round_exact(x: float, p: int, emin: int, emax: int) -> float:
    """The value of a binary format (``p`` significand bits, exponents ``emin``..``emax``) nearest to
    float64 ``x``, round to nearest even, by exact rationals; overflow is a signed infinity."""
    if math.isnan(x) or math.isinf(x):
        return x
    r = round_fraction_to_binary(Fraction(x), p, emin, emax)
    if r is None:
        return math.copysign(math.inf, x)
    return math.copysign(float(r), x)


def bf16_exact(x: float) -> float:
    """The bfloat16 nearest to float64 ``x`` in one rounding, by exact rationals."""
    return round_exact(x, BF16_P, BF16_EMIN, BF16_EMAX)


def f32_exact(x: float) -> float:
    """The float32 nearest to float64 ``x`` (round to nearest even), by exact rationals."""
    return round_exact(x, F32_P, F32_EMIN, F32_EMAX)


def bf16_through_f32_exact(x: float) -> float:
    """float64 -> float32 -> bfloat16, each step one correct rounding (two roundings in all)."""
    return bf16_exact(f32_exact(x))


def bf16_fast(x: float) -> float:
    """The same rounding as :func:`bf16_exact`, with frexp/ldexp (exact operations)."""
    if math.isnan(x) or math.isinf(x) or x == 0.0:
        return x
    _, e = math.frexp(x)  # |x| = m * 2^e, 0.5 <= m < 1, so the leading bit is 2^(e-1)
    if e - 1 > BF16_EMAX:
        return math.copysign(math.inf, x)
    q = max(e - 1, BF16_EMIN) - BF16_P + 1
    n = round(math.ldexp(x, -q))  # exact scaling; round() on a float: nearest, ties to even
    r = math.ldexp(float(n), q)
    if abs(r) >= 2.0 ** (BF16_EMAX + 1):
        return math.copysign(math.inf, x)
    return math.copysign(r, x)


def f32(x: float) -> float:
    return float(np.float32(x))


# --- accumulator arithmetic: op in float64, rounded to the accumulator format -------------


def round_f64(x: float) -> float:
    return x


ROUND = {0: round_f64, 1: f32, 2: bf16_fast}  # format code (F64, F32, BF16) -> rounding


def arith(fmt: int):
    """``(round, add, mul)`` of a format: the operation in float64, then one rounding."""
    r = ROUND[fmt]
    return r, (lambda a, b: r(a + b)), (lambda a, b: r(a * b))


# native float32 arithmetic, for float32 inputs (the emulation claim)
def add_f32_native(a: float, b: float) -> float:
    return float(np.float32(a) + np.float32(b))


def mul_f32_native(a: float, b: float) -> float:
    return float(np.float32(a) * np.float32(b))


# --- summation orders, from the docstring of kvfast.kernels.reduce --------------------------


def sequential_sum(terms: list[float], add) -> float:
    """``((t0 + t1) + t2) + ...``; an empty sum is 0.0."""
    if not terms:
        return 0.0
    return reduce(add, terms)


def _block_sum(terms: list[float], add) -> float:
    if len(terms) == 1:
        return terms[0]
    half = len(terms) // 2
    return add(_block_sum(terms[:half], add), _block_sum(terms[half:], add))


def pairwise_sum(terms: list[float], add) -> float:
    """Maximal aligned blocks of the binary decomposition of n, each summed as a
    binary tree of its halves, then added left to right."""
    n = len(terms)
    if n == 0:
        return 0.0
    blocks = []
    start = 0
    for k in reversed(range(n.bit_length())):
        if (n >> k) & 1:
            size = 1 << k
            blocks.append(_block_sum(terms[start : start + size], add))
            start += size
    return reduce(add, blocks)


ORDER_SUM = {0: sequential_sum, 1: pairwise_sum}


def ref_sum(terms, acc: int, order: int) -> float:
    """Sum of ``terms``, each rounded to ``acc`` as it enters, adds rounded to ``acc``."""
    rnd, add, _ = arith(acc)
    return ORDER_SUM[order]([rnd(float(t)) for t in terms], add)


def ref_dot(a, b, acc: int, order: int) -> float:
    """``sum_i a_i * b_i``: each product and each add rounded to ``acc``."""
    _, add, mul = arith(acc)
    return ORDER_SUM[order]([mul(float(x), float(y)) for x, y in zip(a, b, strict=True)], add)


def ref_matmul(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int) -> np.ndarray:
    """Per element: the ordered dot of a row of x and a column of w, rounded to storage."""
    rs = ROUND[storage]
    T, m = x.shape[0], w.shape[1]
    y = np.empty((T, m))
    for t in range(T):
        for j in range(m):
            y[t, j] = rs(ref_dot(x[t], w[:, j], acc, order))
    return y


def ref_attend_row(q, kbuf, vbuf, lo, hi, n_head, scale, storage, acc, order, exp_fn) -> np.ndarray:
    """One query row over keys lo..hi-1, per head, as documented in kvfast.kernels.attention."""
    rs = ROUND[storage]
    d = q.shape[0]
    hd = d // n_head
    out = np.empty(d)
    for h in range(n_head):
        cols = slice(h * hd, (h + 1) * hd)
        scores = [rs(ref_dot(q[cols], kbuf[j, cols], acc, order) * scale) for j in range(lo, hi)]
        smax = max(scores)
        e = exp_fn(np.array([s - smax for s in scores]))
        e = [rs(float(v)) for v in e]
        z = ref_sum(e, acc, order)
        p = [rs(v / z) for v in e]
        for c in range(h * hd, (h + 1) * hd):
            out[c] = rs(ref_dot(p, vbuf[lo:hi, c], acc, order))
    return out


def ref_rmsnorm_row(x, g, eps, storage, acc, order) -> tuple[np.ndarray, float]:
    """``out = round_s(x * inv * g)``, ``inv = round_s(1 / sqrt(round_a(sumsq / d) + eps))``."""
    rs = ROUND[storage]
    ra = ROUND[acc]
    d = x.shape[0]
    mean_sq = ra(ref_dot(x, x, acc, order) / d)
    inv = rs(1.0 / math.sqrt(mean_sq + eps))
    return np.array([rs(float(x[i]) * inv * float(g[i])) for i in range(d)]), inv
