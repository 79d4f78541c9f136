"""The kernels the compiled forward and decode call by address, and the table of their addresses.

The compiled entries (:func:`kvfast.model.compiled.forward_kernel`,
:func:`kvfast.model.decode.decode_kernel`) call the large kernels (the product bodies under
``matmul_with`` itself, ``rmsnorm_into``, the attention's row kernels) through their addresses
(:mod:`kvfast.kernels.indirect`), so each kernel's machine code is generated once, on its own, and
not again inside each entry. Python passes the addresses in a :class:`Kernels` table, built once per
process for what a call needs (:func:`kernels`: the product bodies of
its accumulator only, the attention row kernel of its kind only; the slots it cannot reach are 0).

:func:`call_matmul` and :func:`call_rmsnorm` are what the block (:mod:`kvfast.model.block`) calls: from
jitted code through the table, from Python (the layer-by-layer forward runs the block's source, with
no table) the kernels themselves. Either way the same machine code runs, so the bits are the same.
"""

from __future__ import annotations

from typing import NamedTuple

from numba import types
from numba.extending import overload

from kvfast.kernels.attention import BLOCKED, ROW, dot_bodies, row_kernels
from kvfast.kernels.indirect import address, through_address
from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.matmul import matmul_into, matmul_with, product_bodies
from kvfast.kernels.rowops import rmsnorm_into

_I, _F = types.int64, types.float64
_A1, _A2 = (types.Array(types.float64, n, "C") for n in (1, 2))

RMSNORM = (_A2, _A1, _F, _I, _I, _I, _A2, _A1)
"""``rmsnorm_into(x, g, eps, storage, acc, order, out, inv)`` as the block calls it."""
MATMUL = (_A2, _A2, _I, _I, _I, _A2, types.UniTuple(_I, 7))
"""``matmul_with(x, w, storage, acc, order, y, bodies)`` as the block calls it."""

rmsnorm_at = through_address(RMSNORM)
matmul_at = through_address(MATMUL)
row_at = through_address(ROW)
blocked_at = through_address(BLOCKED)


class Kernels(NamedTuple):
    """Addresses of the kernels a compiled entry calls (0: a kernel this call cannot reach)."""

    products: tuple[int, ...]  # kvfast.kernels.matmul.product_bodies (7)
    matmul: int  # matmul_with (the format dispatch over the product bodies)
    rmsnorm: int  # rmsnorm_into
    row: int  # attend_row (standard attention)
    blocked: int  # attend_row_blocked (a real kernel's order)
    dots: tuple[int, int, int]  # kvfast.kernels.attention.dot_bodies (the row kernels' score dots)


_TABLES: dict[tuple, Kernels] = {}


def kernels(acc: int, attn: int) -> Kernels:
    """The table of the compiled forward and decode in accumulator ``acc`` with attention kind ``attn`` (a
    code): the kernels compiled, or loaded from the cache, on first use."""
    key = (acc, attn == 0)
    table = _TABLES.get(key)
    if table is None:
        table = Kernels(
            product_bodies(acc),
            address(matmul_with, MATMUL),
            address(rmsnorm_into, RMSNORM),
            *row_kernels(attn),
            dot_bodies(acc),
        )
        _TABLES[key] = table
    return table


def call_matmul(kern, x, w, storage, acc, order, y) -> None:
    """``matmul_into(x, w, storage, acc, order, y)``; jitted, ``matmul_with`` through ``kern.matmul`` with
    ``kern``'s product bodies (called from every layer function, linked it was emitted again in each)."""
    matmul_into(x, w, storage, acc, order, y)


@overload(call_matmul, jit_options=JIT_OPTIONS)
def _call_matmul_jitted(kern, x, w, storage, acc, order, y):
    def impl(kern, x, w, storage, acc, order, y):
        matmul_at(kern.matmul, (x, w, storage, acc, order, y, kern.products))

    return impl


def call_rmsnorm(kern, x, g, eps, storage, acc, order, out, inv) -> None:
    """``rmsnorm_into(x, g, eps, storage, acc, order, out, inv)``; jitted, through ``kern.rmsnorm``."""
    rmsnorm_into(x, g, eps, storage, acc, order, out, inv)


@overload(call_rmsnorm, jit_options=JIT_OPTIONS)
def _call_rmsnorm_jitted(kern, x, g, eps, storage, acc, order, out, inv):
    def impl(kern, x, g, eps, storage, acc, order, out, inv):
        rmsnorm_at(kern.rmsnorm, (x, g, eps, storage, acc, order, out, inv))

    return impl
