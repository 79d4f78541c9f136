"""The kernels the compiled forward and decode call by address, and the slots of the table of their addresses.

The compiled entries (:func:`kvfast.model.compiled.forward_kernel`,
:func:`kvfast.model.decode.decode_kernel`) call the large kernels (the product bodies under
``matmul_with`` itself, ``rmsnorm_into``, the attention's row kernels, the block's three functions:
:mod:`kvfast.model.compiled`) through their addresses
(:mod:`kvfast.kernels.indirect`), so each kernel's machine code is generated once, on its own, and
not again inside each entry. Python passes the addresses in a table
(:func:`kvfast.model.compiled.kernels`: it needs the block's addresses, so it is built above the block), once
per process for what a call needs (the product bodies of
its accumulator only, the attention row kernel of its kind only; the slots it cannot reach are 0).

:func:`call_matmul` and :func:`call_rmsnorm` are what the block (:mod:`kvfast.model.block`) calls: from
jitted code through the table, from Python (the layer-by-layer forward runs the block's source, with
no table) the kernels themselves. Either way the same machine code runs, so the bits are the same.
"""

from __future__ import annotations

from numba import types
from numba.extending import overload

from kvfast.kernels.attention import ATTENTION, BLOCKED, ROW
from kvfast.kernels.indirect import through_address
from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.matmul import matmul_into
from kvfast.kernels.rowops import rmsnorm_into

_I, _F = types.int64, types.float64
_A1, _A2 = (types.Array(types.float64, n, "C") for n in (1, 2))

RMSNORM = (_A2, _A1, _F, _I, _I, _I, _A2, _A1)
"""``rmsnorm_into(x, g, eps, storage, acc, order, out, inv)`` as the block calls it."""
MATMUL = (_A2, _A2, _I, _I, _I, _A2, types.Array(types.int64, 1, "C"))
"""``matmul_with(x, w, storage, acc, order, y, bodies)`` as the block calls it."""

rmsnorm_at = through_address(RMSNORM)
matmul_at = through_address(MATMUL)
row_at = through_address(ROW)
blocked_at = through_address(BLOCKED)
attention_at = through_address(ATTENTION)


PRODUCTS, MATMUL_AT, RMSNORM_AT, ROW_AT, BLOCKED_AT, INPUT_AT, OUTPUT_AT, HEAD_AT, ATTENTION_AT, DOTS = (
    0, 7, 8, 9, 10, 11, 12, 13, 14, 15,
)  # fmt: skip
"""The slots of a :func:`kvfast.model.compiled.kernels` table: the product bodies (7,
:func:`kvfast.kernels.matmul.product_bodies`) from ``PRODUCTS``, then ``matmul_with``, ``rmsnorm_into``,
``attend_row`` (standard attention), ``attend_row_blocked`` (a real kernel's order), the block's
``attention_input_into``, ``block_output_into`` and ``head_into`` (:func:`kvfast.model.compiled.block_addresses`),
``attention_with`` (the compiled forward's attention over its rows), then what the row kernels call by address
(:func:`kvfast.kernels.attention.dot_bodies`) from ``DOTS``; 0: a kernel the call cannot reach."""


def call_matmul(kern, x, w, storage, acc, order, y) -> None:
    """``matmul_into(x, w, storage, acc, order, y)``; jitted, ``matmul_with`` through ``kern``'s address of it with
    ``kern``'s product bodies (called from every layer function, linked it was emitted again in each)."""
    matmul_into(x, w, storage, acc, order, y)


@overload(call_matmul, jit_options=JIT_OPTIONS)
def _call_matmul_jitted(kern, x, w, storage, acc, order, y):
    def impl(kern, x, w, storage, acc, order, y):
        matmul_at(kern[MATMUL_AT], x, w, storage, acc, order, y, kern[PRODUCTS:MATMUL_AT])

    return impl


def call_rmsnorm(kern, x, g, eps, storage, acc, order, out, inv) -> None:
    """``rmsnorm_into(x, g, eps, storage, acc, order, out, inv)``; jitted, through ``kern``'s address of it."""
    rmsnorm_into(x, g, eps, storage, acc, order, out, inv)


@overload(call_rmsnorm, jit_options=JIT_OPTIONS)
def _call_rmsnorm_jitted(kern, x, g, eps, storage, acc, order, out, inv):
    def impl(kern, x, g, eps, storage, acc, order, out, inv):
        rmsnorm_at(kern[RMSNORM_AT], x, g, eps, storage, acc, order, out, inv)

    return impl
