"""The compiled forward over all layers: one compiled entry for every number format.

:func:`forward_kernel` is :func:`kvfast.model.transformer.forward_prepared`
without a tape in one compiled call: the block of :mod:`kvfast.model.block`
(the same functions the layer-by-layer forward and the decode call) with the
forward's K/V store and attention between its halves, so every bit is the
same; it saves one trip through Python per kernel per layer.

**One entry for every format.** The storage and accumulator formats reach the
forward and the decode (:func:`kvfast.model.decode.decode_kernel`) as run-time
integers, as they reach the layer functions called from Python, so one
compiled forward and one decode serve every format a process runs, and the
kernels below them (the product bodies, attention, the norms, and the block's
three functions, called through :data:`input_at`, :data:`output_at`, :data:`head_at`) are compiled once,
with the signature the layer-by-layer forward and the training use too, and
called through their addresses (:mod:`kvfast.model.addresses`): their machine
code is not emitted again inside the forward and the decode. The
hot loops still carry no format branch: ``matmul_with`` and the attention's
score dots pick a body compiled for one format (the format a constant there)
at the top of each call. Numba's compile time grows with every specialisation
*and* with every level that links one in (each level optimises and emits the
machine code of all it calls once more), so per-format entries, each with its
own copy of every kernel below it, cost several times more for the three
presets and the nine storage/accumulator pairs of ``kvfast reproduce``
(``benchmarks/compile_profile.py``; docs/development.md, "Numba's compile cache").
"""

from __future__ import annotations

import importlib.util
import math
import sys

import numba as nb
import numpy as np
from numba import types

from kvfast.kernels.attention import ATTENTION, attention_with, dot_bodies, row_kernels
from kvfast.kernels.indirect import address, one_compile_at_a_time, through_address
from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.matmul import LARGE_MIN_ROWS, matmul_with, product_bodies, size_class
from kvfast.kernels.rowops import embed_into, rmsnorm_into
from kvfast.model.addresses import (
    ATTENTION_AT,
    BLOCKED_AT,
    DOTS,
    HEAD_AT,
    INPUT_AT,
    MATMUL,
    OUTPUT_AT,
    RMSNORM,
    ROW_AT,
    attention_at,
)
from kvfast.model.block import StackedWeights, attention_input_into, block_output_into, head_into


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
    happens if the target started already or Numba's layout differs.
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


# --- the block's three functions, called by address from the compiled forward and the decode -------------
#
# Linked, each was optimised and its machine code emitted again inside forward_kernel and again inside
# decode_kernel (with every elementwise kernel it links); by address each is compiled once, on its own.

_I, _F = types.int64, types.float64
_A1, _A2 = (types.Array(types.float64, n, "C") for n in (1, 2))
_KERN = types.Array(types.int64, 1, "C")
_STACKED_DIMS = (2, 2, 2, 3, 3, 3, 3, 2, 3, 3, 1, 2)  # StackedWeights' fields, in order


def _block_signatures() -> dict[str, tuple]:
    """The argument types the block's functions are compiled for and called with by address: the compiled
    forward's and the decode's (C-contiguous writable float64 arrays, the prepared weights' type)."""
    w = types.NamedTuple([types.Array(types.float64, n, "C") for n in _STACKED_DIMS], StackedWeights)
    return {
        "input": (_KERN, w, _I, _A2, _F, _I, _I, _I, _A2, _A1, _A2, _A2, _A2),
        "output": (_KERN, w, _I, _A2, _A2, _F, _I, _I, _I, _A2, _A2, _A1, _A2, _A2, _A2),
        "head": (_KERN, w, _A2, _F, _I, _I, _I, _A2, _A1, _A2),
    }


_BLOCK = {"input": attention_input_into, "output": block_output_into, "head": head_into}


def block_addresses() -> list[int]:
    """The addresses of ``attention_input_into``, ``block_output_into``, ``head_into`` (slots ``INPUT_AT``,
    ``OUTPUT_AT``, ``HEAD_AT`` of :func:`kvfast.model.compiled.kernels`), compiled or loaded on first use."""
    signatures = _block_signatures()
    return [address(_BLOCK[name], signatures[name]) for name in ("input", "output", "head")]


_TABLES: dict[tuple, np.ndarray] = {}


def model_size_class(config, acc: int) -> bool:
    """The product size class (:func:`kvfast.kernels.matmul.size_class`) of the model ``config`` (a
    :class:`~kvfast.model.config.ModelConfig`) in accumulator ``acc``: its largest product's (``d_model`` by the
    widest of ``d_model``, ``d_ff``, ``vocab``) in a batch of rows. Every call of the model runs all its products
    in that class, a one-row decode step too: the class never changes a bit; per model, not per call, a process
    compiles one form of the product bodies per model, and a model of the large class runs its one-row steps on
    the unrolled bodies, faster there too (the shape ``(1, 32, 64)`` of ``benchmarks/kernels_size_class.py``)."""
    d = config.d_model
    return size_class(LARGE_MIN_ROWS, d, max(d, config.d_ff, config.vocab), acc)


def kernels(acc: int, attn: int, large: bool = False) -> np.ndarray:
    """The table of the compiled forward and decode in accumulator ``acc`` with attention kind ``attn`` (a
    code) and product size class ``large`` (:func:`model_size_class`): the kernels' addresses (compiled, or
    loaded from the cache, on first use) in an int64 array (an array, not a named tuple: Numba types an array
    argument in its fast path, on every call). One array per table and process: do not write it."""
    key = (acc, attn == 0, bool(large))
    table = _TABLES.get(key)
    if table is None:
        table = np.concatenate(
            [
                product_bodies(acc, large),
                # matmul_with and rmsnorm_into themselves: the layer-by-layer forward calls them from Python too
                [address(matmul_with, MATMUL, twin=False), address(rmsnorm_into, RMSNORM, twin=False)],
                row_kernels(attn),
                block_addresses(),
                [address(attention_with, ATTENTION, twin=False)],  # attention_into calls it from Python too
                dot_bodies(acc),
            ]
        ).astype(np.int64)
        _TABLES[key] = table
    return table


_SIGNATURES = _block_signatures()
input_at = through_address(_SIGNATURES["input"])
"""``input_at(kern[INPUT_AT], kern, w, layer, x, eps, storage, acc, order, h, inv1, q, k, v)``: jitted,
``attention_input_into`` through its address (its arguments' types exactly those of the signature it is compiled
for: a typing error names them otherwise)."""
output_at = through_address(_SIGNATURES["output"])
"""``output_at(kern[OUTPUT_AT], kern, w, layer, x, y, eps, storage, acc, order, x_mid, h2, inv2, u, a, x_out)``:
``block_output_into`` through its address."""
head_at = through_address(_SIGNATURES["head"])
"""``head_at(kern[HEAD_AT], kern, w, x, eps, storage, acc, order, hf, invf, logits)``: ``head_into`` through its
address."""


@nb.njit(**JIT_OPTIONS)
def _store_rows(buf, start, rows):
    """``buf[start : start + T] = rows`` (T, d), element by element (an array assignment would compile
    a shape-mismatch error path with string formatting, about 1.5 s of a cold start)."""
    for t in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            buf[start + t, j] = rows[t, j]


@one_compile_at_a_time
@nb.njit(**JIT_OPTIONS)
def forward_kernel(
    kern, w, n_head, eps, tokens, pos0, kc, vc, causal, storage, acc, order, attn, attn_block, logits, resid
):
    """The forward of ``tokens`` at positions ``pos0 ..`` over all layers; writes ``logits`` (T, vocab).

    ``kern``: :func:`kvfast.model.compiled.kernels` (the kernels it calls by address);
    ``w``: :class:`~kvfast.model.block.StackedWeights`; ``kc``, ``vc``
    (n_layer, S, d): the key/value buffers, rows ``pos0 .. pos0+T-1`` of each
    layer are written here and attention reads rows ``0 ..`` (a cache's
    buffers, or fresh (n_layer, T, d) ones without a cache, pos0 = 0).
    ``resid``: (n_layer+1, T, d) receives the residual stream after the
    embedding and after each layer, or has no rows. ``attn``/``attn_block``:
    ``Numerics.attention_codes``. Every step is the one of ``forward_prepared``.
    """
    # tokens: (T,); x, h, q, k, v, y, x_mid, h2, hf: (T, d); u, a: (T, f); logits: (T, vocab)
    T = tokens.shape[0]
    d = w.wte.shape[1]
    n_layer = w.g1.shape[0]
    f = w.w1.shape[2]
    positions = np.empty(T, dtype=np.int64)  # (T,) pos0, pos0 + 1, ... (a loop: np.arange compiles more)
    for t in range(T):
        positions[t] = pos0 + t
    n_keys = pos0 + T if causal else kc.shape[1]
    scale = 1.0 / math.sqrt(d // n_head)
    no_att = np.empty((0, 0, 0))
    keep = resid.shape[0] > 0
    x = np.empty((T, d))  # the residual stream, updated in place by each layer
    embed_into(w.wte, w.wpe, tokens, positions, storage, x)
    first = np.int64(0)  # not the literal 0: _store_rows is compiled once, for int64 rows
    if keep:
        _store_rows(resid[0], first, x)
    h, q, k, v, y = np.empty((T, d)), np.empty((T, d)), np.empty((T, d)), np.empty((T, d)), np.empty((T, d))
    x_mid, h2 = np.empty((T, d)), np.empty((T, d))
    u, a = np.empty((T, f)), np.empty((T, f))
    inv = np.empty(T)  # 1/rms of each row (inv1, inv2, invf: none is kept)
    for layer in range(n_layer):
        input_at(kern[INPUT_AT], kern, w, layer, x, eps, storage, acc, order, h, inv, q, k, v)
        _store_rows(kc[layer], pos0, k)
        _store_rows(vc[layer], pos0, v)
        attention_at(
            kern[ATTENTION_AT], q, kc[layer], vc[layer], pos0, n_keys, causal, n_head, scale, storage, acc, order, y,
            no_att, attn, attn_block, kern[ROW_AT], kern[BLOCKED_AT], kern[DOTS:],
        )  # fmt: skip
        output_at(kern[OUTPUT_AT], kern, w, layer, x, y, eps, storage, acc, order, x_mid, h2, inv, u, a, x)
        if keep:
            _store_rows(resid[layer + 1], first, x)
    hf = np.empty((T, d))
    head_at(kern[HEAD_AT], kern, w, x, eps, storage, acc, order, hf, inv, logits)
