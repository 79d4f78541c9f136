"""Matrix product with an explicit summation order.

``y[t, j] = round_storage( sum_k x[t, k] * w[k, j] )`` where the sum over k runs
in the chosen order with products and adds in the accumulator format (see
:mod:`kvfast.kernels.reduce`). Every output element is its own ordered sum,
so row ``t`` of a product of T rows is bit-identical to the product of that
one row alone: the batch shape never changes a value.

Speed (none of it changes any element's order of addition or its rounding):

- the i-k-j loop form: a row of outputs is updated for each k, so the
  innermost loop runs across output columns and vectorises, while every
  element still receives its terms in k order; the pairwise order keeps one
  partial row per tree level (a binary counter over blocks of eight k, each
  block's tree summed in registers), so it vectorises across columns too;
- four rows per pass over ``w`` (each loaded ``w`` vector serves four rows);
- several k per pass over a row (``y + a0*w0 + a1*w1 + ...`` is evaluated
  left to right, exactly the sequential order, but ``y`` is loaded and stored
  once per pass instead of once per k);
- float32 lanes where they give the same bits: when every input is a float32
  (f32 accumulator, and at least ``NARROW_MIN_ROWS`` rows) or a finite bfloat16
  (bf16 accumulator), the product runs on float32 copies, twice the lanes of
  float64. Native float32 ``*`` and ``+``
  equal the float64 operation rounded once to float32 (the product of two
  float32s is exact in float64, and float64 carries more than 2*24+2 bits, so
  rounding a sum twice is harmless). For the bf16 accumulator the product of two
  bfloat16s is exact in float32 wherever a bfloat16 rounding could tell (below
  2**-134 both round to zero), and a float32 rounding of the sum of two
  bfloat16s never lands on a bfloat16 midpoint unless the exact sum is one, so
  rounding through float32 equals the one rounding from float64; the bfloat16
  rounding itself is integer arithmetic on the float32 bits
  (:func:`kvfast.kernels.precision.bf16_round_f32`; a product of finite
  inputs is never NaN, so its rounding skips the NaN select);
- one compiled body per accumulator format and data type, chosen once per
  call: the body is written once (``_product_template``) and written out for
  each format and data type with its rounding in place of every product and
  sum (:mod:`kvfast.kernels.bodies`), so the inner loops carry no format
  branch, and Numba types and lowers plain arithmetic (not a jitted helper
  call per operation, nor helpers inlined in Numba IR: a shorter cold start).
  Each body is compiled on its own when a process first runs its format and
  is called through its address (:mod:`kvfast.kernels.indirect`), so its
  machine code is generated once, not again in every function that calls
  ``matmul``;
- two forms of the f64 and f32 bodies, by the product's size class
  (:func:`size_class`, per accumulator): the unrolled form above for large
  products, a plain one (one row, one k per pass: ``_product_plain_template``,
  the same order, so the same bits) for small ones, where the unrolling gains
  little and its cold compile (about four times the plain form's) is not worth
  paying; a process compiles the form its products use, on first use.

Each sequential sum starts from ``-0.0``: ``-0.0 + p == p`` for every p
(including ``+0.0`` and ``-0.0``) and rounding is idempotent, so the first step
``rnd(-0.0 + rnd(p))`` is exactly the reference's first term ``rnd(p)``. NaN
results stay NaN, but which NaN operand's sign survives an add is up to the
compiler (IEEE 754 leaves it unspecified). No kernel uses fastmath; without it
LLVM neither reassociates nor contracts ``a*b + c`` into an FMA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba as nb
import numpy as np
from numba import types

from kvfast.kernels.bodies import ADD, EMPTY, MAC, MUL, specialise
from kvfast.kernels.indirect import Kernel, table, through_address
from kvfast.kernels.jit import BORROWING
from kvfast.kernels.jit import JIT_OPTIONS as _JIT
from kvfast.kernels.precision import BF16, F32, F64, f32_as_u32, rnd
from kvfast.kernels.reduce import SEQUENTIAL

# --- the product, one body per accumulator format and data type -----------------------------------
#
# ``_product_template`` is never compiled itself: kvfast.kernels.bodies writes its MUL/ADD/MAC out for
# each format and data type (``x``, ``w``, ``y``: float64 arrays, or float32 arrays for an F32 or BF16
# accumulator: see matmul_into), so each body's loops carry its own rounding and no format branch.


def _product_template(x, w, order, y):
    """``y = x @ w`` in ``order``, products and sums rounded to the body's accumulator format, without
    the storage rounding; ``x`` has >= 1 column.

    Sequential: four rows at a time (each ``w`` load serves four rows) and four k per pass over a row
    (``y + a0*w0 + a1*w1 + ...`` left to right, ``y`` loaded and stored once per pass), then one row at a
    time. Pairwise, four rows at a time: the order of :mod:`kvfast.kernels.reduce` (``PAIRWISE``) with
    n = 8q + r: the q aligned blocks of eight k are each summed as a tree in registers and merged by a
    binary counter (``stack[level, row]`` holds one partial row per level), which builds every larger
    aligned block from its halves; the r < 8 last terms go through the same counter one at a time, which
    forms the aligned blocks of 4, 2 and 1 that the binary decomposition of n gives; the blocks are then
    added left to right.
    """
    T, n = x.shape
    m = w.shape[1]
    if order == SEQUENTIAL:
        whole = T - T % 4
        for t in range(0, whole, 4):  # y[t:t+4] = x[t:t+4] @ w
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
                    y[t, j] = MAC(MAC(MAC(MAC(y[t, j], a00, w0), a01, w1), a02, w2), a03, w3)
                    y[t + 1, j] = MAC(MAC(MAC(MAC(y[t + 1, j], a10, w0), a11, w1), a12, w2), a13, w3)
                    y[t + 2, j] = MAC(MAC(MAC(MAC(y[t + 2, j], a20, w0), a21, w1), a22, w2), a23, w3)
                    y[t + 3, j] = MAC(MAC(MAC(MAC(y[t + 3, j], a30, w0), a31, w1), a32, w2), a33, w3)
                k += 4
            while k < n:
                a00, a10, a20, a30 = x[t, k], x[t + 1, k], x[t + 2, k], x[t + 3, k]
                for j in range(m):
                    w0 = w[k, j]
                    y[t, j] = MAC(y[t, j], a00, w0)
                    y[t + 1, j] = MAC(y[t + 1, j], a10, w0)
                    y[t + 2, j] = MAC(y[t + 2, j], a20, w0)
                    y[t + 3, j] = MAC(y[t + 3, j], a30, w0)
                k += 1
        for t in range(whole, T):  # y[t] = x[t] @ w
            for j in range(m):
                y[t, j] = -0.0
            k = 0
            while k + 4 <= n:
                a0, a1, a2, a3 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3]
                for j in range(m):
                    w0, w1, w2, w3 = w[k, j], w[k + 1, j], w[k + 2, j], w[k + 3, j]
                    y[t, j] = MAC(MAC(MAC(MAC(y[t, j], a0, w0), a1, w1), a2, w2), a3, w3)
                k += 4
            while k < n:
                a0 = x[t, k]
                for j in range(m):
                    y[t, j] = MAC(y[t, j], a0, w[k, j])
                k += 1
    else:
        levels = 3
        while (8 << (levels - 3)) <= n:
            levels += 1
        stack = EMPTY((levels, min(T, 4), m))  # (>= bit_length(q) + 3, rows, m)
        for t in range(0, T, 4):  # y[t:t+rows] = x[t:t+rows] @ w
            rows = min(T - t, 4)
            sp = 0
            for b in range(n // 8):
                k = 8 * b
                for r in range(rows):
                    a0, a1, a2, a3 = x[t + r, k], x[t + r, k + 1], x[t + r, k + 2], x[t + r, k + 3]
                    a4, a5, a6, a7 = x[t + r, k + 4], x[t + r, k + 5], x[t + r, k + 6], x[t + r, k + 7]
                    for j in range(m):
                        s01 = ADD(MUL(a0, w[k, j]), MUL(a1, w[k + 1, j]))
                        s23 = ADD(MUL(a2, w[k + 2, j]), MUL(a3, w[k + 3, j]))
                        s45 = ADD(MUL(a4, w[k + 4, j]), MUL(a5, w[k + 5, j]))
                        s67 = ADD(MUL(a6, w[k + 6, j]), MUL(a7, w[k + 7, j]))
                        stack[sp, r, j] = ADD(ADD(s01, s23), ADD(s45, s67))
                count = b + 1
                while (count & 1) == 0:  # merge equal blocks, as a binary counter carries
                    for r in range(rows):
                        for j in range(m):
                            stack[sp - 1, r, j] = ADD(stack[sp - 1, r, j], stack[sp, r, j])
                    sp -= 1
                    count >>= 1
                sp += 1
            k0 = n - n % 8
            for i in range(n % 8):  # the last terms, one by one: the same counter, restarted at k0 (a
                k = k0 + i  # multiple of 8, so aligned for every block size below 8), builds their blocks of 4, 2, 1
                for r in range(rows):
                    a0 = x[t + r, k]
                    for j in range(m):
                        stack[sp, r, j] = MUL(a0, w[k, j])
                count = i + 1
                while (count & 1) == 0:
                    for r in range(rows):
                        for j in range(m):
                            stack[sp - 1, r, j] = ADD(stack[sp - 1, r, j], stack[sp, r, j])
                    sp -= 1
                    count >>= 1
                sp += 1
            for r in range(rows):
                for j in range(m):
                    y[t + r, j] = stack[0, r, j]
                for level in range(1, sp):
                    for j in range(m):
                        y[t + r, j] = ADD(y[t + r, j], stack[level, r, j])


def _product_plain_template(x, w, order, y):
    """:func:`_product_template` without its unrolling, for the bf16 accumulator: one row and one k per
    pass, each element's terms in k order; pairwise, each row's terms go through the binary counter one at
    a time (the order of :mod:`kvfast.kernels.reduce`, ``PAIRWISE``: every aligned block of 2**k terms the
    sum of its halves, the blocks of the binary decomposition of n added left to right); ``x`` has >= 1
    column.

    Why plain: the bf16 rounding is most of the work of a bf16 product, so the unrolled form is no faster
    (on float32 lanes it was 10-15% slower, on float64 data no faster: ``benchmarks/README.md``, "Issue
    30, fourth pass") and it cost four to six times the compile time (about 3.5 s a body against 0.6-0.9).
    The f64 and f32 products run it too where they are small (:func:`size_class`): the same order, so the
    same bits as :func:`_product_template`'s bodies, at a fifth of their cold compile.
    """
    T, n = x.shape
    m = w.shape[1]
    if order == SEQUENTIAL:
        for t in range(T):
            for j in range(m):
                y[t, j] = -0.0
            for k in range(n):
                a0 = x[t, k]
                for j in range(m):
                    y[t, j] = MAC(y[t, j], a0, w[k, j])
    else:
        levels = 3
        while (8 << (levels - 3)) <= n:
            levels += 1
        stack = EMPTY((levels, m))  # at most bit_length(n) blocks, one partial row each
        for t in range(T):
            sp = 0
            for k in range(n):
                a0 = x[t, k]
                for j in range(m):
                    stack[sp, j] = MUL(a0, w[k, j])
                count = k + 1
                while (count & 1) == 0:  # merge equal blocks, as a binary counter carries
                    for j in range(m):
                        stack[sp - 1, j] = ADD(stack[sp - 1, j], stack[sp, j])
                    sp -= 1
                    count >>= 1
                sp += 1
            for j in range(m):
                y[t, j] = stack[0, j]
            for level in range(1, sp):
                for j in range(m):
                    y[t, j] = ADD(y[t, j], stack[level, j])


_PRODUCT_SPECS = {
    "_product_f64": (_product_template, F64, False),
    "_product_f32_on_f32": (_product_template, F32, True),
    "_product_f32": (_product_template, F32, False),
    "_product_bf16_on_f32": (_product_plain_template, BF16, True),
    "_product_bf16": (_product_plain_template, BF16, False),
    "_product_plain_f64": (_product_plain_template, F64, False),
    "_product_plain_f32_on_f32": (_product_plain_template, F32, True),
    "_product_plain_f32": (_product_plain_template, F32, False),
}
"""The eight bodies, each written out on first use: a module attribute of that name (``matmul._product_f64``)
generates it (a few ms of import each, saved where a process never runs the format). The first five (names
as in :data:`PRODUCT_KERNELS`' order) are the large size class's, the last three the plain f64 and f32
bodies of the small class (:data:`PLAIN_PRODUCT_KERNELS`; the bf16 bodies are plain in both)."""

_LARGE_NAMES = tuple(_PRODUCT_SPECS)[:5]
_SMALL_NAMES = ("_product_plain_f64", "_product_plain_f32_on_f32", "_product_plain_f32", *_LARGE_NAMES[3:])


def _product_kernel(name: str):
    """The body ``name`` of :data:`_PRODUCT_SPECS`, generated (not compiled) on the first request."""
    kernel = globals().get(name)
    if kernel is None:
        template, acc, data32 = _PRODUCT_SPECS[name]
        kernel = specialise(template, acc, data32, base=name.removesuffix("_on_f32").rsplit("_", 1)[0])
    return kernel


def __getattr__(name: str):
    if name in _PRODUCT_SPECS:
        return _product_kernel(name)
    if name == "PRODUCT_KERNELS":
        return tuple(_product_kernel(n) for n in _LARGE_NAMES)
    if name == "PLAIN_PRODUCT_KERNELS":
        return tuple(_product_kernel(n) for n in _SMALL_NAMES[:3])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BF16_LOW = np.uint32(0xFFFF)


@nb.njit(**_JIT)
def _as_f32(a: np.ndarray, out: np.ndarray, bf16: bool) -> bool:
    """Copy float64 ``a`` into float32 ``out``; False (copy unfinished) if a value is not a
    float32 (NaN counts as one), or, when ``bf16``, not a finite bfloat16. Checked row by row,
    without branches inside a row, so the copy vectorises."""
    low = _BF16_LOW if bf16 else np.uint32(0)
    for i in range(a.shape[0]):
        off = 0
        for j in range(a.shape[1]):
            v = a[i, j]
            f = np.float32(v)
            out[i, j] = f
            off += (np.float64(f) != v and v == v) or (f32_as_u32(f) & low) != 0 or (bf16 and v - v != 0.0)
        if off:
            return False
    return True


NARROW_MIN_ROWS = 4
"""Fewest rows for which the f32 accumulator runs on float32 copies (copying ``w`` costs about as
much as a one-row product); the bf16 accumulator always does, when its inputs allow."""


# --- the product bodies, called by address ---------------------------------------------------------
#
# Each body (``_product_template`` for one format and data type) is compiled on its own, once, when a
# process first multiplies in its format, and called through its address (kvfast.kernels.indirect).
# Linked, its code was optimised and emitted again in every function above it (the format dispatch,
# matmul_into, the compiled forward, the decode).

_F64_2D = types.Array(types.float64, 2, "C")
_F32_2D = types.Array(types.float32, 2, "C")


class Products(NamedTuple):
    """Where :func:`matmul_with` finds the product bodies it calls (:func:`product_bodies`): their addresses, 0 for
    those its accumulator never runs."""

    f64: int  # y = x @ w in the f64 accumulator (float64 data)
    f32_on_f32: int  # in the f32 accumulator, on float32 copies (native float32 operations)
    f32: int  # in the f32 accumulator, on float64 data (each operation rounded to float32)
    bf16_on_f32: int  # in the bf16 accumulator, on float32 copies
    bf16: int  # in the bf16 accumulator, on float64 data
    narrowed: int  # _narrowed: the f32 or bf16 product on float32 copies where every input allows, else on float64


BODY = (_F64_2D, _F64_2D, types.int64, _F64_2D)
"""A product body's signature, ``(x, w, order, y)``, on float64 data (``BODY_ON_F32``: on float32 copies)."""
BODY_ON_F32 = (_F32_2D, _F32_2D, types.int64, _F32_2D)
_NARROWED = (_F64_2D, _F64_2D, types.int64, _F64_2D, types.int64, types.int64, types.boolean)
"""The signature of :func:`_narrowed` (f32 and bf16: one compiled function, the format a run-time flag: it only
copies and checks, its loops are not the product's)."""
PRODUCTS = types.NamedUniTuple(types.int64, len(Products._fields), Products)
"""The Numba type of a :class:`Products` table (an argument of every caller of :func:`matmul_with`)."""

_REACHED = {F64: ("f64",), F32: ("f32_on_f32", "f32", "narrowed"), BF16: ("bf16_on_f32", "bf16", "narrowed")}
"""The bodies each accumulator runs."""

_call_on_f64 = through_address(BODY)  # f64, f32 and bf16 on float64 data: one signature
_call_on_f32 = through_address(BODY_ON_F32)  # f32 and bf16 on float32 copies


LARGE_MIN_ROWS = 4
LARGE_MIN_SIZE = 2048
LARGE_ONE_ROW_SIZE = 4096
"""The f64 products' size classes (:func:`size_class`): where the unrolled bodies start to beat the plain ones
(``benchmarks/kernels_size_class.py``)."""
F32_LARGE_MIN_SIZE = 65536
"""The f32 products' large class (:func:`size_class`): at least ``LARGE_MIN_ROWS`` rows by a matrix of at least
this many elements (256 x 256)."""


def size_class(T: int, n: int, m: int, acc: int = F64) -> bool:
    """The size class of a product of ``T`` rows by an ``(n, m)`` matrix in accumulator ``acc``: True (large)
    where the product runs the unrolled bodies (``PRODUCT_KERNELS``, :func:`_product_template`), False (small)
    where it runs the plain ones (:data:`PLAIN_PRODUCT_KERNELS`).

    - f64: at least ``LARGE_MIN_ROWS`` rows and ``n * m >= LARGE_MIN_SIZE``, or ``n * m >= LARGE_ONE_ROW_SIZE``;
    - f32: at least ``LARGE_MIN_ROWS`` rows and ``n * m >= F32_LARGE_MIN_SIZE``;
    - bf16: never (its bodies are plain in both classes: the rounding is most of the work).

    Both forms add in the same order with the same roundings, so the class never changes a bit: it picks
    which bodies a process compiles (on first use) and runs. An unrolled body costs about four times a plain
    one's cold compile (3.8-5.1 s against 0.9-1.1 on a 2-core machine); in the large class it was 1.0-2.8x
    faster, in the small one (a few rows by a small matrix: the call costs about as much as the arithmetic)
    0.95-1.9x, at most about 2 us a call (``benchmarks/kernels_size_class.py``; benchmarks/README.md, "Issue 30, fifth
    pass"). The model picks one class for all its products, one-row decode steps included
    (:func:`kvfast.model.compiled.model_size_class`): a model of d_model 16 (matrices under 2048 elements) is
    all small, and its process compiles no unrolled body.

    Why f32 unrolls only from 256 x 256: the float64 products are the exactness grid's (the per-run speed of
    ``benchmarks/numpy_loop.py``), the f32 ones only the precision grid's few runs on its wide models (d_model
    64, d_ff 256: 1.5-2x faster unrolled, some milliseconds a run), against two unrolled bodies' cold compile
    (float32 lanes and float64 data: about 8 s of the cold start of ``kvfast reproduce``,
    ``benchmarks/compile_profile.py --reproduce``); from 256 x 256 a product takes milliseconds and the
    unrolling pays for its compile."""
    size = n * m
    if acc == F64:
        return (T >= LARGE_MIN_ROWS and size >= LARGE_MIN_SIZE) or size >= LARGE_ONE_ROW_SIZE
    return acc == F32 and T >= LARGE_MIN_ROWS and size >= F32_LARGE_MIN_SIZE


_PRODUCT_TABLES: dict[tuple[int, bool], Products] = {}


def product_bodies(acc: int, large: bool = False) -> Products:
    """The product bodies accumulator ``acc`` runs in size class ``large`` (:func:`size_class`), compiled (or loaded
    from the cache) on first use: the unrolled ``PRODUCT_KERNELS`` if ``large``, else the plain
    ``PLAIN_PRODUCT_KERNELS`` (bf16: plain in both), and :func:`_narrowed` for f32 and bf16; 0 for the other
    formats' (which ``matmul_with`` never calls with this ``acc``). One table per format, class and process."""
    large = bool(large) and acc != BF16  # the bf16 bodies are plain in both classes: one table
    found = _PRODUCT_TABLES.get((acc, large))
    if found is None:
        reached = _REACHED.get(acc)
        if reached is None:
            raise ValueError(f"acc: {acc!r} is not allowed; allowed: {F64}, {F32}, {BF16}")
        names = _LARGE_NAMES if large else _SMALL_NAMES
        signatures = (BODY, BODY_ON_F32, BODY, BODY_ON_F32, BODY)
        entries = [
            *(Kernel(field, functools.partial(_product_kernel, name), signature)
              for field, name, signature in zip(Products._fields, names, signatures, strict=False)),
            Kernel("narrowed", _narrowed, _NARROWED),
        ]  # fmt: skip
        found = _PRODUCT_TABLES[(acc, large)] = Products(**table(entries, reached))
    return found


@nb.njit(**_JIT)
def _narrowed(x, w, order, y, narrow_body, wide_body, bf16):
    """The f32 (``bf16`` False) or bf16 (``bf16`` True) product: on float32 copies (at least
    ``NARROW_MIN_ROWS`` rows for f32, any for bf16) when every input allows (:func:`_as_f32`), else on
    the float64 data; ``narrow_body``, ``wide_body``: the two bodies' addresses. ``x`` has >= 1 row
    and >= 1 column."""
    T, n = x.shape
    m = w.shape[1]
    narrow = T >= (0 if bf16 else NARROW_MIN_ROWS)
    if narrow:
        x32 = np.empty((T, n), dtype=np.float32)
        w32 = np.empty((n, m), dtype=np.float32)
        narrow = _as_f32(x, x32, bf16) and _as_f32(w, w32, bf16)
    if narrow:
        y32 = np.empty((T, m), dtype=np.float32)
        _call_on_f32(narrow_body, x32, w32, order, y32)
        for r in range(T):
            for j in range(m):
                y[r, j] = np.float64(y32[r, j])
    else:
        _call_on_f64(wide_body, x, w, order, y)


_call_narrowed = through_address(_NARROWED)

MATMUL = (_F64_2D, _F64_2D, types.int64, types.int64, types.int64, _F64_2D, PRODUCTS)
"""``matmul_with(x, w, storage, acc, order, y, bodies)`` as jitted code calls it by address."""


@nb.njit(**BORROWING)
def matmul_with(x, w, storage, acc, order, y, bodies) -> None:
    """:func:`matmul_into` given the product bodies ``bodies`` (a :class:`Products` table, :func:`product_bodies` of
    ``acc``): the form jitted code calls, by address (:data:`MATMUL`)."""
    T, n = x.shape
    m = w.shape[1]
    if n == 0 or T == 0:
        for r in range(T):
            for j in range(m):
                y[r, j] = 0.0
        return
    # the one format dispatch: each branch runs the bodies compiled for its format (their loops carry
    # no format branch)
    if acc == F64:
        _call_on_f64(bodies.f64, x, w, order, y)
    elif acc == F32:
        _call_narrowed(bodies.narrowed, x, w, order, y, bodies.f32_on_f32, bodies.f32, False)
    else:
        _call_narrowed(bodies.narrowed, x, w, order, y, bodies.bf16_on_f32, bodies.bf16, True)
    if storage != F64:
        for r in range(T):
            for j in range(m):
                y[r, j] = rnd(y[r, j], storage)


def matmul_into(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int, y: np.ndarray) -> None:
    """``y[:] = x @ w`` (x: (T, n), w: (n, m), y: (T, m), float64 C arrays) in ``order``, stored in ``storage``.

    Element ``y[t, j]`` is the sum over k of ``x[t, k] * w[k, j]`` in ``order``
    (:mod:`kvfast.kernels.reduce`), products and adds rounded to ``acc``, the
    result rounded to ``storage``; an empty sum (n = 0) is ``0.0``. ``y`` must
    not overlap ``x`` or ``w``. One branch over the three formats picks the bodies
    compiled for that format (``PRODUCT_KERNELS``), so the loops carry no format
    branch; a process compiles (or loads) the bodies of the formats it runs, on
    first use, the unrolled f64 and f32 bodies only for products of the large size
    class (:func:`size_class`, from the shapes and ``acc``: the same bits either way). Jitted
    code calls :func:`matmul_with` with :func:`product_bodies`.
    """
    T, n = x.shape
    large = size_class(T, n, w.shape[1], acc)
    table = _PRODUCT_TABLES.get((acc, large))  # product_bodies(acc, large), one call less once it is built
    matmul_with(x, w, storage, acc, order, y, product_bodies(acc, large) if table is None else table)


def matmul(x: np.ndarray, w: np.ndarray, storage: int, acc: int, order: int) -> np.ndarray:
    """``x @ w`` as a new (T, m) array; see :func:`matmul_into`. A Python function: a jitted one would
    compile every kernel of matmul_into once more into itself (about 2.5 s of a cold start)."""
    y = np.empty((x.shape[0], w.shape[1]), dtype=np.float64)
    matmul_into(x, w, storage, acc, order, y)
    return y
