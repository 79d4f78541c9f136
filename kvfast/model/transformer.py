"""The tiny pre-norm transformer: full forward (layer-major) and hand-written backward.

    x = wte[token] + wpe[pos]
    per layer:  h = rmsnorm(x) * g1;  q, k, v = h @ wq, h @ wk, h @ wv
                y = attention(q, k, v);  x_mid = x + y @ wo
                h2 = rmsnorm(x_mid) * g2;  u = h2 @ w1;  a = silu(u);  x = x_mid + a @ w2
    hf = rmsnorm(x) * gf;  logits = hf @ w_out

Shapes: tokens (T,), x/h/q/k/v/y/x_mid/h2 (T, d), u/a (T, f), logits (T, vocab).
The block around attention and the head are written once, in
:mod:`kvfast.model.block`, for both forwards here and the decode.

Each public function (:func:`forward`, :func:`loss_and_grads`, and in
:mod:`kvfast.model.generation` ``decode_step`` and ``generate``) validates its
arguments, rounds the weights once (:class:`Weights`) and calls its
``*_prepared`` twin (:func:`forward_prepared`, :func:`loss_and_grads_prepared`,
``decode_prepared``, ``generate_prepared``). A twin takes prepared weights and
validated arguments and validates nothing, so the studies, the checker's adapter
and the benchmarks call it in their loops. The suffix names what the twin takes:
``run`` means executing a study or a grid elsewhere in kvfast, and ``check``
names the cache checker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvfast.kernels.precision import F64, round_array
from kvfast.model import layers as L
from kvfast.model.block import StackedWeights
from kvfast.model.cache import KVCache
from kvfast.model.compiled import forward_kernel, leading_args
from kvfast.model.config import ModelConfig, require_params
from kvfast.model.validate import require_config, require_numerics, require_tokens
from kvfast.numerics import Numerics


@dataclass(frozen=True)
class Weights:
    """Parameters rounded to a storage format: by name (``named``) and stacked per layer (``stacked``)."""

    named: dict[str, np.ndarray]
    stacked: StackedWeights
    calls: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # leading_args' entries

    def __getstate__(self) -> dict:
        return {**self.__dict__, "calls": {}}  # a copy or a pickle: the entries hold this process's code addresses

    def leading_args(self, config: ModelConfig, numerics: Numerics) -> tuple:
        """:func:`kvfast.model.compiled.leading_args` of the model ``config`` on these weights in ``numerics``, built
        once per model and numerics, not on every call (a decode step's Python was a third of its time): found
        again by the identities of ``config`` and ``numerics`` (both immutable; an entry keeps them alive, so no
        other object takes their ids), the last 16."""
        key = (id(config), id(numerics))
        found = self.calls.get(key)
        if found is None:
            if len(self.calls) >= 16:
                self.calls.clear()
            found = self.calls[key] = (config, numerics, leading_args(config, self.stacked, numerics))
        return found[2]

    @classmethod
    def prepare(cls, config: ModelConfig, params: dict, numerics: Numerics) -> Weights:
        """Validate ``params`` against ``config`` and round them to ``numerics.storage``."""
        checked = require_params(config, params)
        storage = numerics.codes[0]
        n_layer = config.n_layer
        # Each per-layer tensor is stacked first (a copy), then rounded in one call: rounding is elementwise, so
        # these are the bits of rounding each layer's array, in 12 calls instead of 4 + 9 per layer; `named`
        # holds views of the stacked arrays. round_array only ever sees writable C-contiguous 1-D and 2-D arrays
        # (a layer stack as 2-D rows): a read-only array (frozen by `cached`) is copied first, since Numba would
        # compile round_array once more for read-only arrays (a type of their own), and a 3-D stack would be
        # another. f64 storage is the identity (rnd returns its argument): its copy is the rounded array, bit for
        # bit, without round_array's per-element loop (most of preparing a model). Yet f64 rounds gf and w_out
        # through round_array (its 1-D and 2-D types), so that a sweep's warm-up run in any format compiles it
        # and forked workers running other formats compile nothing (benchmarks/sweep.py counts it).
        copy_only = storage == F64
        named: dict[str, np.ndarray] = {}
        fields = []
        for short in StackedWeights._fields:
            a = checked.get(short)
            if a is not None:  # not per layer
                if copy_only and short not in ("gf", "w_out"):
                    out = a.copy()
                else:
                    out = round_array(a if a.flags.writeable else a.copy(), storage)
                named[short] = out
            else:
                shape = checked[f"h0.{short}"].shape
                out = np.empty((n_layer, *shape))
                for i in range(n_layer):
                    out[i] = checked[f"h{i}.{short}"]
                if not copy_only:
                    rows = out.reshape(n_layer, -1) if len(shape) == 1 else out.reshape(-1, shape[-1])
                    out = round_array(rows, storage).reshape(out.shape)
                for i in range(n_layer):
                    named[f"h{i}.{short}"] = out[i]
            fields.append(out)
        return cls({name: named[name] for name in checked}, StackedWeights(*fields))

    @classmethod
    def cached(cls, config: ModelConfig, params: dict, numerics: Numerics) -> Weights:
        """:meth:`prepare`, reused while ``params`` holds the same arrays, unchanged.

        The public functions call this, so a loop of ``decode_step`` calls rounds
        the parameters once, not once per call. Stale weights are made
        impossible rather than looked for: after preparing, every array of
        ``params`` is made read-only (``arr.flags.writeable = False``), so an in-place
        update (``params["h0.wq"] += ...``) raises numpy's "assignment
        destination is read-only" instead of changing the values silently. A
        call finds the prepared weights again only if ``params`` holds the very
        same array objects under the same names, in the same order (the cache keeps them alive, so
        their ids cannot be taken by others), and every one is still
        read-only; a user who sets ``writeable = True`` again (to update in
        place) or puts new arrays in the dict gets freshly prepared weights on
        the next call. Arrays that do not own their memory (views of another
        array, whose owner could still be written) are never cached: their
        weights are prepared on every call. What goes unseen: writing through a
        view made before the first call (it keeps its own flag), or setting the
        flag on, writing and setting it off again between two calls. A hit
        costs one id and one flag read per array.
        """
        arrays = tuple(params.values()) if isinstance(params, dict) else ()
        names = tuple(params) if isinstance(params, dict) else ()  # the same arrays under swapped names differ
        key = (config, numerics.storage, names, tuple(map(id, arrays)))
        entry = _WEIGHTS_CACHE.get(key)
        if entry is not None and not any(a.flags.writeable for a in entry[0]):
            return entry[1]
        w = cls.prepare(config, params, numerics)
        if all(a.base is None for a in arrays):  # prepare checked they are arrays
            for a in arrays:
                a.flags.writeable = False
            _WEIGHTS_CACHE.pop(key, None)
            while len(_WEIGHTS_CACHE) >= _WEIGHTS_CACHE_SIZE:
                del _WEIGHTS_CACHE[next(iter(_WEIGHTS_CACHE))]
            _WEIGHTS_CACHE[key] = (arrays, w)
        return w


# Prepared weights of the last parameter sets the public functions saw, keyed by (config, storage,
# the names and the ids of the arrays in dict order): (the arrays, Weights). An entry keeps its arrays alive, so no
# other array can take one of their ids while it is here.
_WEIGHTS_CACHE: dict[tuple, tuple[tuple, Weights]] = {}
_WEIGHTS_CACHE_SIZE = 8


class LayerTape(NamedTuple):
    """What one layer's forward keeps for its backward (names as in the module docstring)."""

    x: np.ndarray  # (T, d) the layer's input
    h: np.ndarray  # (T, d) rmsnorm(x) * g1
    inv1: np.ndarray  # (T,) 1 / rms of x
    q: np.ndarray  # (T, d)
    k: np.ndarray  # (T, d)
    v: np.ndarray  # (T, d)
    att: np.ndarray  # (H, T, T) attention probabilities
    y: np.ndarray  # (T, d) attention output, before wo
    x_mid: np.ndarray  # (T, d) x + y @ wo
    h2: np.ndarray  # (T, d) rmsnorm(x_mid) * g2
    inv2: np.ndarray  # (T,) 1 / rms of x_mid
    u: np.ndarray  # (T, f) h2 @ w1
    a: np.ndarray  # (T, f) silu(u)


class HeadTape(NamedTuple):
    """What the final norm and unembedding keep for the backward."""

    x: np.ndarray  # (T, d) the last layer's output
    hf: np.ndarray  # (T, d) rmsnorm(x) * gf
    invf: np.ndarray  # (T,) 1 / rms of x
    positions: np.ndarray  # (T,) the rows' positions (for the wpe gradient)


@dataclass
class Tape:
    """The forward's saved activations: one :class:`LayerTape` per layer, then the head's."""

    layers: list[LayerTape] = field(default_factory=list)
    head: HeadTape | None = None


def forward_prepared(
    config: ModelConfig,
    w: Weights,
    tokens: np.ndarray,
    numerics: Numerics,
    cache: KVCache | None = None,
    causal: bool = True,
    tape: Tape | None = None,
    trace: dict | None = None,
) -> np.ndarray:
    """The forward pass on prepared weights and checked tokens (no validation here).

    With a cache, rows sit at positions ``cache.length ..``, their K/V are
    appended to it and attention reads the cache. ``tape`` collects what the
    backward pass needs; ``trace`` collects the residual stream and K, V per layer.
    Without a tape it runs in one compiled call
    (:func:`kvfast.model.compiled.forward_kernel`); with one, layer by layer in
    :func:`forward_layers`. Both run the same kernels in the same order, so the
    logits are the same bits.
    """
    if tape is not None:
        return forward_layers(config, w, tokens, numerics, cache, causal, tape, trace)
    T, d, n_layer = tokens.shape[0], config.d_model, config.n_layer
    if cache is not None:
        pos0, kc, vc = cache.length, cache.k, cache.v  # the kernel stores rows pos0 .. pos0+T-1
    else:
        pos0, kc, vc = 0, np.empty((n_layer, T, d)), np.empty((n_layer, T, d))
    resid = np.empty((n_layer + 1, T, d)) if trace is not None else np.empty((0, 0, 0))
    logits = np.empty((T, config.vocab))
    forward_kernel(*w.leading_args(config, numerics), tokens, np.array([T]), pos0, kc, vc, causal, logits, resid)
    if trace is not None:
        trace.update(resid=list(resid), k=list(kc[:, pos0 : pos0 + T]), v=list(vc[:, pos0 : pos0 + T]))
    if cache is not None:
        cache.advance(T, prefill=True)
    return logits


def forward_layers(
    config: ModelConfig,
    w: Weights,
    tokens: np.ndarray,
    numerics: Numerics,
    cache: KVCache | None = None,
    causal: bool = True,
    tape: Tape | None = None,
    trace: dict | None = None,
) -> np.ndarray:
    """:func:`forward_prepared` one layer function at a time, from Python: the textbook forward, and
    the one that keeps a ``tape`` for the backward."""
    nx = numerics.codes
    if tape is not None and numerics.attention != "standard":
        raise ValueError(
            f"numerics.attention: {numerics.attention!r} has no backward; allowed: 'standard' for gradients"
        )
    eps = config.eps
    T = tokens.shape[0]
    pos0 = cache.length if cache is not None else 0
    positions = np.arange(pos0, pos0 + T, dtype=np.int64)
    x = L.embedding_forward(w.stacked.wte, w.stacked.wpe, tokens, positions, nx)
    if trace is not None:
        trace.update(resid=[x], k=[], v=[])
    for layer in range(config.n_layer):
        h, inv1, q, k, v = L.attention_input_forward(w.stacked, layer, x, eps, nx)
        if cache is not None:
            kbuf, vbuf = cache.append(layer, k, v)
        else:
            kbuf, vbuf = k, v
        y, att = L.attention_forward(
            q, kbuf, vbuf, config.n_head, causal, nx, pos0, keep_att=tape is not None, attn=numerics.attention_codes
        )
        x_mid, h2, inv2, u, a, x_out = L.block_output_forward(w.stacked, layer, x, y, eps, nx)
        if tape is not None:
            tape.layers.append(LayerTape(x, h, inv1, q, k, v, att, y, x_mid, h2, inv2, u, a))
        if trace is not None:
            trace["resid"].append(x_out)
            trace["k"].append(k)
            trace["v"].append(v)
        x = x_out
    hf, invf, logits = L.head_forward(w.stacked, x, eps, nx)
    if tape is not None:
        tape.head = HeadTape(x, hf, invf, positions)
    if cache is not None:
        cache.advance(T, prefill=True)
    return logits


def recompute_prefixes_prepared(
    config: ModelConfig, w: Weights, tokens: np.ndarray, lengths: list[int], numerics: Numerics
) -> list[np.ndarray]:
    """The forwards of ``tokens[:n]`` from position 0, no cache, for each ``n`` of ``lengths`` (each at most
    ``len(tokens)``), in one compiled call: element ``i`` is ``forward_prepared(config, w, tokens[:lengths[i]],
    numerics)``, bit for bit (:func:`kvfast.model.compiled.forward_kernel`). Prepared weights and checked
    arguments, as :func:`forward_prepared`."""
    shape = (config.n_layer, max(lengths), config.d_model)
    kc, vc = np.empty(shape), np.empty(shape)  # each prefix stores its own rows, from row 0
    logits = np.empty((sum(lengths), config.vocab))
    forward_kernel(
        *w.leading_args(config, numerics), tokens, np.array(lengths), 0, kc, vc, True, logits, np.empty((0, 0, 0))
    )
    return np.split(logits, np.cumsum(lengths)[:-1])


def forward(
    config: ModelConfig,
    params: dict,
    tokens,
    numerics: Numerics,
    cache: KVCache | None = None,
    causal: bool = True,
) -> np.ndarray:
    """Logits ``(T, vocab)`` for every position of ``tokens``, computed layer-major.

    Given a cache, the tokens continue it (positions ``cache.length ..``) and
    their keys and values are appended; an empty cache is filled with every
    position's K and V (a prefill).
    """
    config = require_config(config)
    numerics = require_numerics(numerics)
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: {type(cache).__name__} is not allowed; allowed: a KVCache or None")
        if not causal:
            raise ValueError("causal: False is not allowed with a cache; allowed: True")
    start = cache.length if cache is not None else 0
    tokens = require_tokens(config, tokens, start=start)
    if cache is not None:
        cache.require_fits(config, numerics, tokens.shape[0])
    w = Weights.cached(config, params, numerics)
    return forward_prepared(config, w, tokens, numerics, cache, bool(causal))


def forward_trace(config: ModelConfig, params: dict, tokens, numerics: Numerics, causal: bool = True) -> dict:
    """A forward that also returns, per layer, the residual stream and K, V of every position.

    Keys: ``logits`` (T, vocab), ``resid`` (n_layer+1, T, d) (index 0 is the
    embedding), ``k`` and ``v`` (n_layer, T, d).
    """
    config = require_config(config)
    numerics = require_numerics(numerics)
    tokens = require_tokens(config, tokens)
    w = Weights.cached(config, params, numerics)
    trace: dict = {}
    logits = forward_prepared(config, w, tokens, numerics, None, bool(causal), trace=trace)
    return {"logits": logits} | {key: np.stack(trace[key]) for key in ("resid", "k", "v")}


def loss_and_grads_prepared(
    config: ModelConfig,
    w: Weights,
    tokens: np.ndarray,
    targets: np.ndarray,
    numerics: Numerics,
    loss_from: int = 0,
    detach_kv_before: int = 0,
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy over positions ``loss_from ..`` and its gradients.

    ``detach_kv_before = P`` treats the keys and values of positions ``< P`` as
    constants (a cached prefix reused in training): no gradient flows back
    through them.
    """
    tape = Tape()
    logits = forward_prepared(config, w, tokens, numerics, tape=tape)
    sel = slice(loss_from, None)
    loss, probs = L.cross_entropy_forward(logits[sel], targets[sel])
    dlogits = np.zeros_like(logits)
    dlogits[sel] = L.cross_entropy_backward(probs, targets[sel])
    p = w.named
    grads: dict[str, np.ndarray] = {}
    head = tape.head
    dhf, grads["w_out"] = L.linear_backward(dlogits, head.hf, p["w_out"])
    dx, grads["gf"] = L.rmsnorm_backward(dhf, head.x, p["gf"], head.invf)
    for layer in reversed(range(config.n_layer)):
        pre = f"h{layer}."
        t = tape.layers[layer]
        # x_out = x_mid + silu(h2 @ w1) @ w2
        da, grads[pre + "w2"] = L.linear_backward(dx, t.a, p[pre + "w2"])
        du = L.silu_backward(da, t.u)
        dh2, grads[pre + "w1"] = L.linear_backward(du, t.h2, p[pre + "w1"])
        dx_mid, grads[pre + "g2"] = L.rmsnorm_backward(dh2, t.x_mid, p[pre + "g2"], t.inv2)
        dx_mid = dx_mid + dx
        # x_mid = x + attention(q, k, v) @ wo
        dy, grads[pre + "wo"] = L.linear_backward(dx_mid, t.y, p[pre + "wo"])
        dq, dk, dv = L.attention_backward(dy, t.q, t.k, t.v, t.att, config.n_head)
        dk[:detach_kv_before] = 0.0
        dv[:detach_kv_before] = 0.0
        dh_q, grads[pre + "wq"] = L.linear_backward(dq, t.h, p[pre + "wq"])
        dh_k, grads[pre + "wk"] = L.linear_backward(dk, t.h, p[pre + "wk"])
        dh_v, grads[pre + "wv"] = L.linear_backward(dv, t.h, p[pre + "wv"])
        dx_in, grads[pre + "g1"] = L.rmsnorm_backward(dh_q + dh_k + dh_v, t.x, p[pre + "g1"], t.inv1)
        dx = dx_in + dx_mid
    grads["wte"], grads["wpe"] = L.embedding_backward(dx, tokens, head.positions, config.vocab, config.max_pos)
    return loss, {name: grads[name] for name in p}


def loss_and_grads(
    config: ModelConfig, params: dict, tokens, targets, numerics: Numerics
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy of ``targets`` given ``tokens`` (both (T,)), and hand-written gradients.

    The forward honours ``numerics``; the backward is float64 NumPy. Gradients
    have the parameters' names and shapes.
    """
    config = require_config(config)
    numerics = require_numerics(numerics)
    tokens = require_tokens(config, tokens)
    targets = require_tokens(config, targets, field="targets")
    if targets.shape != tokens.shape:
        raise ValueError(f"targets: shape {targets.shape} is not allowed; allowed: {tokens.shape} (as tokens)")
    w = Weights.cached(config, params, numerics)
    return loss_and_grads_prepared(config, w, tokens, targets, numerics)
