"""The compiled forward over all layers, and one compiled entry per number format.

:func:`forward_kernel` is :func:`kvfast.model.transformer.forward_prepared`
without a tape in one compiled call: the same kernels called in the same order
on the same tensors (names and shapes as in :mod:`kvfast.model.transformer`),
so every bit is the same; it saves one trip through Python per kernel per layer.

**One compiled entry per format.** Python calls the forward and the decode
kernel through :func:`forward_entry` / :func:`decode_entry`, one small jitted
function per (storage, accumulator) pair that passes the two formats on as
compile-time constants (Numba literals). Numba types every branch of a function
it compiles, so a kernel that picks its body with ``if acc == F64`` at run time
compiles the bodies of every format; :func:`linear_into` (the model's
``matmul_into``) picks the body while typing instead, from the literal, so a
process that runs one format compiles the matmul of that format only (about
a third of a cold start when every format was compiled). Each entry is made on
first use and cached on disk like every kernel (Numba keys a closure's cache entry by the
values it closes over).
"""

from __future__ import annotations

import importlib.util
import math
import sys

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from kvfast.kernels.attention import attention_into
from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.matmul import NARROW_MIN_ROWS, _as_f32, _product, matmul_into
from kvfast.kernels.precision import BF16, F64, rnd
from kvfast.kernels.rowops import add_into, embed_into, rmsnorm_into, silu_into


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

# helpers made inside an overload: compiled into their caller (and cached with it), never alone
_INNER = {k: v for k, v in JIT_OPTIONS.items() if k != "cache"}


def linear_into(x, w, storage, acc, order, y):
    """``matmul_into(x, w, storage, acc, order, y)`` from jitted code: see the overload below."""
    raise NotImplementedError("only callable from jitted code")


@overload(linear_into, jit_options=JIT_OPTIONS, prefer_literal=True)
def _linear_into_overload(x, w, storage, acc, order, y):
    """:func:`kvfast.kernels.matmul.matmul_into` with the accumulator's body chosen while typing.

    With a literal ``acc`` only that format's product kernels are compiled; the
    steps are those of ``matmul_into`` for that format, line for line (tested
    equal bit for bit on random cases in every format, order and shape). With
    a run-time ``acc`` it is ``matmul_into`` itself.
    """
    if not isinstance(acc, types.IntegerLiteral):
        return lambda x, w, storage, acc, order, y: matmul_into(x, w, storage, acc, order, y)
    code = acc.literal_value

    if code == F64:

        @nb.njit(**_INNER, inline="always")
        def product(x, w, order, y):
            _product(x, w, order, y, F64)

    else:
        is_bf16 = code == BF16
        narrow_rows = 0 if is_bf16 else NARROW_MIN_ROWS  # bf16: float32 lanes for any T

        @nb.njit(**_INNER, inline="always")
        def product(x, w, order, y):
            T, n = x.shape
            m = w.shape[1]
            narrow = T >= narrow_rows
            if narrow:
                x32 = np.empty((T, n), dtype=np.float32)
                w32 = np.empty((n, m), dtype=np.float32)
                narrow = _as_f32(x, x32, is_bf16) and _as_f32(w, w32, is_bf16)
            if narrow:
                y32 = np.empty((T, m), dtype=np.float32)
                _product(x32, w32, order, y32, code)
                for r in range(T):
                    for j in range(m):
                        y[r, j] = np.float64(y32[r, j])
            else:
                _product(x, w, order, y, code)

    def impl(x, w, storage, acc, order, y):
        T, n = x.shape
        m = w.shape[1]
        if n == 0 or T == 0:
            for r in range(T):
                for j in range(m):
                    y[r, j] = 0.0
            return
        product(x, w, order, y)
        if storage != F64:
            for r in range(T):
                for j in range(m):
                    y[r, j] = rnd(y[r, j], storage)

    return impl


@nb.njit(**JIT_OPTIONS)
def _store_rows(buf, start, rows):
    """``buf[start : start + T] = rows`` (T, d), element by element (an array assignment would compile
    a shape-mismatch error path with string formatting, about 1.5 s of a cold start)."""
    for t in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            buf[start + t, j] = rows[t, j]


@nb.njit(**JIT_OPTIONS, inline="always")
def forward_kernel(w, n_head, eps, tokens, pos0, kc, vc, causal, storage, acc, order, attn, attn_block, logits, resid):
    """The forward of ``tokens`` at positions ``pos0 ..`` over all layers; writes ``logits`` (T, vocab).

    ``w``: :class:`~kvfast.model.transformer.StackedWeights`; ``kc``, ``vc``
    (n_layer, S, d): the key/value buffers, rows ``pos0 .. pos0+T-1`` of each
    layer are written here and attention reads rows ``0 ..`` (a cache's
    buffers, or fresh (n_layer, T, d) ones without a cache, pos0 = 0).
    ``resid``: (n_layer+1, T, d) receives the residual stream after the
    embedding and after each layer, or has no rows. ``attn``/``attn_block``:
    ``Numerics.attention_codes``. Every step is the one of ``forward_prepared``.
    """
    T = tokens.shape[0]
    d = w.wte.shape[1]
    n_layer = w.g1.shape[0]
    f = w.w1.shape[2]
    positions = np.arange(pos0, pos0 + T)  # (T,) int64
    n_keys = pos0 + T if causal else kc.shape[1]
    scale = 1.0 / math.sqrt(d // n_head)
    no_att = np.empty((0, 0, 0))
    keep = resid.shape[0] > 0
    x = np.empty((T, d))  # (T, d) residual stream
    embed_into(w.wte, w.wpe, tokens, positions, storage, x)
    if keep:
        _store_rows(resid[0], 0, x)
    for layer in range(n_layer):
        h = np.empty((T, d))  # (T, d) rmsnorm(x) * g1
        inv1 = np.empty(T)
        rmsnorm_into(x, w.g1[layer], eps, storage, acc, order, h, inv1)
        q = np.empty((T, d))  # (T, d) each
        k = np.empty((T, d))
        v = np.empty((T, d))
        linear_into(h, w.wq[layer], storage, acc, order, q)
        linear_into(h, w.wk[layer], storage, acc, order, k)
        linear_into(h, w.wv[layer], storage, acc, order, v)
        _store_rows(kc[layer], pos0, k)
        _store_rows(vc[layer], pos0, v)
        y = np.empty((T, d))  # (T, d) attention output, before wo
        kbuf, vbuf = kc[layer], vc[layer]  # (S, d) keys and values of rows 0 .. n_keys-1
        attention_into(
            q, kbuf, vbuf, pos0, n_keys, causal, n_head, scale, storage, acc, order, y, no_att, attn, attn_block
        )
        o = np.empty((T, d))  # (T, d) y @ wo
        linear_into(y, w.wo[layer], storage, acc, order, o)
        x_mid = np.empty((T, d))  # (T, d) x + y @ wo
        add_into(x, o, storage, x_mid)
        h2 = np.empty((T, d))  # (T, d) rmsnorm(x_mid) * g2
        inv2 = np.empty(T)
        rmsnorm_into(x_mid, w.g2[layer], eps, storage, acc, order, h2, inv2)
        u = np.empty((T, f))  # (T, f) h2 @ w1
        linear_into(h2, w.w1[layer], storage, acc, order, u)
        a = np.empty((T, f))  # (T, f) silu(u)
        silu_into(u, storage, a)
        m = np.empty((T, d))  # (T, d) a @ w2
        linear_into(a, w.w2[layer], storage, acc, order, m)
        x = np.empty((T, d))  # (T, d) x_mid + a @ w2, the next layer's input
        add_into(x_mid, m, storage, x)
        if keep:
            _store_rows(resid[layer + 1], 0, x)
    hf = np.empty((T, d))  # (T, d) rmsnorm(x) * gf
    invf = np.empty(T)
    rmsnorm_into(x, w.gf, eps, storage, acc, order, hf, invf)
    linear_into(hf, w.w_out, storage, acc, order, logits)  # (T, vocab)


_FORWARD_ENTRIES: dict = {}
_DECODE_ENTRIES: dict = {}


def forward_entry(storage: int, acc: int):
    """The compiled forward for one (storage, accumulator) pair: :func:`forward_kernel` with the two
    formats as constants; arguments as ``forward_kernel`` without ``storage`` and ``acc``."""
    entry = _FORWARD_ENTRIES.get((storage, acc))
    if entry is None:
        s_, a_ = int(storage), int(acc)

        @nb.njit(**JIT_OPTIONS)
        def forward_format(w, n_head, eps, tokens, pos0, kc, vc, causal, order, attn, attn_block, logits, resid):
            forward_kernel(w, n_head, eps, tokens, pos0, kc, vc, causal, s_, a_, order, attn, attn_block, logits, resid)

        entry = _FORWARD_ENTRIES[(storage, acc)] = forward_format
    return entry
