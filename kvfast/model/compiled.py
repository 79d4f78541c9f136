"""The compiled forward over all layers: one compiled entry for every number format.

:func:`forward_kernel` is :func:`kvfast.model.transformer.forward_prepared`
without a tape in one compiled call: the block of :mod:`kvfast.model.block`
(the same functions the layer-by-layer forward and the decode call) with the
forward's K/V store and attention between its halves, so every bit is the
same; it saves one trip through Python per kernel per layer.

**One entry for every format.** The storage and accumulator formats reach the
forward and the decode (:func:`kvfast.model.generation.decode_kernel`) as run-time
integers (:class:`~kvfast.kernels.precision.Formats`), as they reach the layer
functions called from Python, so one compiled forward and one decode serve every
format a process runs, and the kernels below them (the product bodies, attention,
the norms, and the block's three functions) are compiled once, with the signature
the layer-by-layer forward and the training use too, and called through their
addresses (:mod:`kvfast.kernels.indirect`): their machine code is not emitted again
inside the forward and the decode. The hot loops still carry no format branch:
``matmul_with`` and the attention's score dots pick a body compiled for one format
(the format a constant there) at the top of each call. Numba's compile time grows
with every specialisation *and* with every level that links one in (each level
optimises and emits the machine code of all it calls once more), so per-format
entries, each with its own copy of every kernel below it, cost several times more
for the three presets and the nine storage/accumulator pairs of ``kvfast
reproduce`` (``benchmarks/compile_profile.py``; docs/development.md, "Numba's
compile cache").

**The table of kernels.** What the forward and the decode call by address is one
record, :class:`Kernels` (read by name: ``kern.matmul``, ``kern.products.f64``),
made by :func:`kernels` from the list :data:`KERNELS` (name, kernel, signature) and
the kernels layer's own tables (:func:`~kvfast.kernels.matmul.product_bodies`,
:func:`~kvfast.kernels.attention.attention_kernels`). Python passes it, and the
weights, as plain tuples (:func:`plain`): Numba types a plain tuple argument in its
fast path and a named one in a slow one (about 2 us a call); the entries name
them again at once (:func:`named`); so are the formats.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from typing import NamedTuple

import numba as nb
import numpy as np
from numba import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from kvfast.kernels.attention import ATTENTION, AttentionKernels, Blocks, Heads, attention_kernels, attention_with
from kvfast.kernels.indirect import Kernel, one_compile_at_a_time, table, through_address
from kvfast.kernels.jit import BORROWING, JIT_OPTIONS
from kvfast.kernels.matmul import LARGE_MIN_ROWS, MATMUL, PRODUCTS, Products, matmul_with, product_bodies, size_class
from kvfast.kernels.precision import FORMATS
from kvfast.kernels.rowops import RMSNORM, embed_into, rmsnorm_into
from kvfast.model.block import (
    Activations,
    StackedWeights,
    activations,
    attention_input_into,
    block_output_into,
    head_into,
)
from kvfast.model.config import ModelConfig, param_shapes


def _numba_blas_probe_without_importing_scipy() -> None:
    """Let Numba's CPU target start without importing ``scipy.linalg`` (0.13-0.15 s of a warm start).

    When its CPU target starts, Numba imports ``numba.np.arraymath``, which
    probes for a BLAS by importing ``scipy.linalg.cython_blas`` (its
    ``_HAVE_BLAS``, used only to pick how ``np.correlate``-style inner products
    are compiled). No kvfast kernel calls a BLAS. Here, before the target
    starts, that module is imported with the probe answering whether scipy
    is installed (``importlib.util.find_spec``, no import); the real probe is
    put back at once, so any later use of a BLAS in jitted code (``np.dot``)
    still imports scipy and checks it when that code is compiled. Nothing
    happens if the target started already or Numba's layout differs. Written
    for Numba 0.60-0.68 (``numba.np.linalg.ensure_blas``); where a release moves
    it, tests/kernels/test_cold_start.py fails.
    """
    if "numba.np.arraymath" in sys.modules:
        return
    try:
        from numba.np import linalg
    except ImportError:  # pragma: no cover - another Numba layout
        return
    probe = getattr(linalg, "ensure_blas", None)
    if probe is None:  # pragma: no cover
        return

    def scipy_is_installed() -> None:
        if importlib.util.find_spec("scipy") is None:
            raise ImportError("scipy 0.16+ is required for linear algebra")

    linalg.ensure_blas = scipy_is_installed
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        linalg.ensure_blas = probe


_numba_blas_probe_without_importing_scipy()


# --- the table of kernels the compiled forward and decode call by address ---------------------------------


class Kernels(NamedTuple):
    """What the compiled forward and decode call by address (:func:`kernels`): the kernels layer's two tables and
    the addresses of six kernels, 0 for one a call never reaches."""

    products: Products  # the product bodies matmul_with calls (kvfast.kernels.matmul.product_bodies)
    attention: AttentionKernels  # what attention calls (kvfast.kernels.attention.attention_kernels)
    matmul: int  # matmul_with: y = x @ w
    rmsnorm: int  # rmsnorm_into: h = x / sqrt(mean(x^2) + eps) * g
    attention_rows: int  # attention_with: y = attention(q, k, v) of every row of a forward
    block_input: int  # attention_input_into: h = rmsnorm(x) * g1; q, k, v = h @ wq, h @ wk, h @ wv
    block_output: int  # block_output_into: x_mid = x + y @ wo; ...; x_out = x_mid + silu(h2 @ w1) @ w2
    head: int  # head_into: logits = (rmsnorm(x) * gf) @ w_out


_I, _F = types.int64, types.float64
_A1, _A2 = (types.Array(types.float64, n, "C") for n in (1, 2))


def _weights_type() -> types.NamedTuple:
    """The Numba type of :class:`StackedWeights`: C-contiguous float64 arrays with the axes of each parameter,
    plus the layer axis of a per-layer one (the prepared weights' type)."""
    shapes = param_shapes(ModelConfig(1, 1, 1, 1, 1, 1))
    ndim = {name.rsplit(".", 1)[-1]: len(shape) + name.startswith("h0.") for name, shape in shapes.items()}
    return types.NamedTuple([types.Array(types.float64, ndim[f], "C") for f in StackedWeights._fields], StackedWeights)


KERNELS = types.NamedTuple(
    (PRODUCTS, types.NamedUniTuple(_I, len(AttentionKernels._fields), AttentionKernels), *[_I] * 6), Kernels
)
WEIGHTS = _weights_type()
ACTIVATIONS = types.NamedTuple([types.Array(types.float64, 1 if f.startswith("inv") else 2, "C")
                                for f in Activations._fields], Activations)  # fmt: skip
"""The Numba types of the records the block's functions take."""

BLOCK_INPUT = (KERNELS, WEIGHTS, _I, _F, FORMATS, ACTIVATIONS)
"""``attention_input_into(kern, w, layer, eps, fmt, acts)`` as the forward and the decode call it."""
BLOCK_OUTPUT = BLOCK_INPUT
"""``block_output_into(kern, w, layer, eps, fmt, acts)``: the same types."""
HEAD = (KERNELS, WEIGHTS, _F, FORMATS, _A2, _A2, _A1, _A2)
"""``head_into(kern, w, eps, fmt, x, hf, invf, logits)``."""

KERNEL_LIST = (
    Kernel("matmul", matmul_with, MATMUL, twin=False),  # called from Python too (matmul_into)
    Kernel("rmsnorm", rmsnorm_into, RMSNORM, twin=False),  # called from Python too (the layer-by-layer forward)
    Kernel("attention_rows", attention_with, ATTENTION, twin=False),  # called from Python too (attention_into)
    Kernel("block_input", attention_input_into, BLOCK_INPUT),
    Kernel("block_output", block_output_into, BLOCK_OUTPUT),
    Kernel("head", head_into, HEAD),
)
"""The model's own kernels in :class:`Kernels`, by name: each compiled on its own (``twin``: a copy for calls by
address only, :func:`kvfast.kernels.indirect.address`)."""

_TABLES: dict[tuple, tuple] = {}


def model_size_class(config, acc: int) -> bool:
    """The product size class (:func:`kvfast.kernels.matmul.size_class`) of the model ``config`` (a
    :class:`~kvfast.model.config.ModelConfig`) in accumulator ``acc``: its largest product's (``d_model`` by the
    widest of ``d_model``, ``d_ff``, ``vocab``) in a batch of rows. Every call of the model runs all its products
    in that class, a one-row decode step too: the class never changes a bit; per model, not per call, a process
    compiles one form of the product bodies per model, and a model of the large class runs its one-row steps on
    the unrolled bodies, faster there too (the shape ``(1, 32, 64)`` of ``benchmarks/kernels_size_class.py``)."""
    d = config.d_model
    return size_class(LARGE_MIN_ROWS, d, max(d, config.d_ff, config.vocab), acc)


def kernels(acc: int, attn: int, large: bool = False) -> tuple:
    """The table of the compiled forward and decode in accumulator ``acc`` with attention kind ``attn`` (a code)
    and product size class ``large`` (:func:`model_size_class`): a :class:`Kernels` record in plain tuples
    (:func:`plain`: as the entries take it), each kernel compiled, or loaded from the cache, on first use (the
    product bodies of ``acc`` only, the row kernel of ``attn``'s kind only). One table per key and process."""
    key = (acc, attn == 0, bool(large))
    found = _TABLES.get(key)
    if found is None:
        own = table(KERNEL_LIST, [k.name for k in KERNEL_LIST])
        found = _TABLES[key] = plain(Kernels(product_bodies(acc, large), attention_kernels(acc, attn), **own))
    return found


def leading_args(config, stacked, numerics) -> tuple:
    """``(kern, w, n_head, eps, fmt, attn, attn_block)``: the arguments :func:`forward_kernel` and the decode kernel
    (:func:`kvfast.model.generation.decode_kernel`) start with, for the model ``config`` on the weights ``stacked``
    (:class:`~kvfast.model.block.StackedWeights`) in ``numerics``: the table of kernels (:func:`kernels`), the
    records as plain tuples (:func:`plain`) and the attention codes."""
    fmt = numerics.codes
    attn, attn_block = numerics.attention_codes
    kern = kernels(fmt.acc, attn, model_size_class(config, fmt.acc))
    return kern, plain(stacked), config.n_head, config.eps, plain(fmt), attn, attn_block


def plain(record: tuple) -> tuple:
    """A record (:class:`Kernels`, :class:`StackedWeights`, :class:`~kvfast.kernels.precision.Formats`) as Python
    passes it to a compiled entry: the same values in plain tuples (Numba types them in its fast path), named
    again there (:func:`named`)."""
    return tuple(plain(v) if isinstance(v, tuple) else v for v in record)


def _plain_type(t):
    """The Numba type of a record of Numba type ``t`` in the plain tuples :func:`plain` makes (literals as their
    types)."""
    if isinstance(t, types.BaseTuple):
        return types.Tuple(tuple(_plain_type(m) for m in t.types))  # a UniTuple where the members' types agree
    return types.unliteral(t)


_RECORDS = types.Tuple((KERNELS, WEIGHTS, FORMATS))


@intrinsic
def named(typingctx, kern, w, fmt):
    """The table of kernels, the weights and the formats as a compiled entry receives them from Python (plain
    tuples: :func:`plain`), named again: :class:`Kernels`, :class:`StackedWeights`,
    :class:`~kvfast.kernels.precision.Formats`. The same values (a named tuple's data is laid out as the plain
    tuple's): no copy member by member, which Numba compiles as one copy of every array (a reference count)
    per member and level."""
    if _plain_type(types.Tuple((kern, w, fmt))) != _plain_type(_RECORDS):
        return None

    def codegen(context, builder, sig, args):
        out = context.make_tuple(builder, sig.return_type, args)
        return impl_ret_borrowed(context, builder, sig.return_type, out)

    return _RECORDS(kern, w, fmt), codegen


block_input_at = through_address(BLOCK_INPUT)
block_output_at = through_address(BLOCK_OUTPUT)
head_at = through_address(HEAD)
attention_at = through_address(ATTENTION)
"""Jitted calls of the block's functions and of the forward's attention through their addresses in the table
(their arguments' types exactly those of the signature each is compiled for: a typing error names them otherwise)."""


@nb.njit(**BORROWING)
def _store_rows(buf, start, rows):
    """``buf[start : start + T] = rows`` (T, d), element by element (an array assignment would compile
    a shape-mismatch error path with string formatting, about 1.5 s of a cold start)."""
    for t in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            buf[start + t, j] = rows[t, j]


@one_compile_at_a_time
@nb.njit(**JIT_OPTIONS)
def forward_kernel(kern, w, n_head, eps, fmt, attn, attn_block, tokens, lengths, pos0, kc, vc, causal, logits, resid):
    """The forward of ``tokens[:T]`` at positions ``pos0 ..`` over all layers for each ``T`` of ``lengths``, in
    turn; writes their logits one after the other into ``logits`` (``sum(lengths)``, vocab).

    One length (the tokens' own) is the forward of ``tokens``; several are the recomputes of prefixes of one
    sequence in one call (causal, no cache: ``pos0`` = 0), each computed exactly as it would be alone (a
    prefix's rows attend only keys it stored itself).

    ``kern``: :func:`kernels` (the kernels it calls by address); ``w``: the
    :class:`~kvfast.model.block.StackedWeights` and ``fmt``, its
    :class:`~kvfast.kernels.precision.Formats` (as plain tuples: :func:`named`); ``attn``/``attn_block``:
    ``Numerics.attention_codes``; ``kc``, ``vc`` (n_layer, S, d): the key/value
    buffers, rows ``pos0 .. pos0+T-1`` of each layer are written here and attention
    reads rows ``0 ..`` (a cache's buffers, or fresh (n_layer, T, d) ones without a
    cache, pos0 = 0; the longest prefix's). ``resid``: (n_layer+1, T, d) receives the residual stream after
    the embedding and after each layer, or has no rows. Every step is the one of
    ``forward_prepared``.
    """
    kern, w, fmt = named(kern, w, fmt)
    d = w.wte.shape[1]
    heads = Heads(n_head, 1.0 / math.sqrt(d // n_head))
    no_att = np.empty((0, 0, 0))
    keep = resid.shape[0] > 0
    first = np.int64(0)  # not the literal 0: _store_rows is compiled once, for int64 rows
    done = 0  # the logits' rows written so far
    for T in lengths:
        positions = np.empty(T, dtype=np.int64)  # (T,) pos0, pos0 + 1, ... (a loop: np.arange compiles more)
        for t in range(T):
            positions[t] = pos0 + t
        n_keys = pos0 + T if causal else kc.shape[1]
        blocks = Blocks(attn, attn_block, first, n_keys)  # a real kernel's split count cuts keys 0 .. n_keys - 1
        acts = activations(T, d, w.w1.shape[2])  # acts.x: the residual stream, updated in place by each layer
        embed_into(w.wte, w.wpe, tokens[:T], positions, fmt.storage, acts.x)  # x = wte[tokens] + wpe[positions]
        if keep:
            _store_rows(resid[0], first, acts.x)
        for layer in range(w.g1.shape[0]):
            block_input_at(kern.block_input, kern, w, layer, eps, fmt, acts)  # h = rmsnorm(x) * g1; q, k, v
            _store_rows(kc[layer], pos0, acts.k)
            _store_rows(vc[layer], pos0, acts.v)
            # y = attention(q, k, v): row t over keys 0 .. pos0 + t (or every key of the buffer, not causal)
            attention_at(kern.attention_rows, acts.q, kc[layer], vc[layer], acts.y, no_att, pos0, causal, heads,
                         fmt, blocks, kern.attention)  # fmt: skip
            block_output_at(kern.block_output, kern, w, layer, eps, fmt, acts)  # x = x_mid + silu(h2 @ w1) @ w2
            if keep:
                _store_rows(resid[layer + 1], first, acts.x)
        hf = np.empty((T, d))
        # logits = (rmsnorm(x) * gf) @ w_out
        head_at(kern.head, kern, w, eps, fmt, acts.x, hf, acts.inv1, logits[done : done + T])
        done += T
