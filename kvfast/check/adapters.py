"""kvfast's own model as a model under test, on its real decode path (catalogue bugs included)."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from kvfast.model import bugs as B
from kvfast.model.cache import KVCache
from kvfast.model.config import ModelConfig
from kvfast.model.generation import decode_greedy_prepared, decode_prepared
from kvfast.model.transformer import Weights, forward_prepared, recompute_prefixes_prepared
from kvfast.model.validate import require_config, require_numerics, require_token, require_tokens
from kvfast.numerics import Numerics
from kvfast.validation import require_int


class KvfastModel:
    """kvfast's tiny transformer behind the check protocol (:mod:`kvfast.check.protocol`).

    - ``recompute``: :func:`kvfast.forward` without a cache, in ``numerics``; ``recompute_prefixes``: several
      prefixes of one sequence recomputed in one compiled call.
    - ``prefill``: a fresh :class:`~kvfast.KVCache`, filled by the batched forward.
    - ``extend``: the batched forward continuing the cache (positions from its length).
    - ``decode``: the compiled decode kernel, in ``decode_numerics`` (default:
      ``numerics``; same storage), with catalogue bug ``bug`` (:data:`kvfast.BUGS`).
    - ``crop``/``snapshot``/``restore``: the cache operations (a rollback keeps
      the first ``n`` positions; a snapshot copies the buffers), all exact; the
      operation bugs of :mod:`kvfast.bugs.operations` act in their hooks
      (``_crop_keep``, ``_copy_keys``).
    - ``recompute_variants``: when ``decode_numerics`` differs from
      ``numerics``, ``{"decode order": the recompute in decode_numerics}`` (a
      computation that differs from ``recompute`` only in how it adds up); else
      nothing.

    Weights are rounded once, here (:func:`prepared_weights`: once per parameter set and storage
    while the parameters are read-only arrays). Bad arguments raise ``ValueError``.
    """

    def __init__(
        self,
        config,
        params: dict,
        numerics: Numerics | str = "f64",
        bug: str | None = None,
        decode_numerics: Numerics | str | None = None,
    ) -> None:
        self.config = require_config(config)
        self.numerics = require_numerics(numerics)
        self.decode_numerics = (
            self.numerics if decode_numerics is None else require_numerics(decode_numerics, "decode_numerics")
        )
        if self.decode_numerics.storage != self.numerics.storage:
            raise ValueError(
                f"decode_numerics.storage: {self.decode_numerics.storage!r} differs from numerics.storage "
                f"{self.numerics.storage!r}; allowed: the same storage (the cache is shared)"
            )
        self.bug = bug
        self.bug_code = B.bug_code(bug)
        self.params = params
        self.weights = prepared_weights(self.config, params, self.numerics)
        self.cache: KVCache | None = None
        self.vocab_size = self.config.vocab
        self.max_positions = self.config.max_pos  # a check needing more is bad input before any work

    def __repr__(self) -> str:
        dec = "" if self.decode_numerics == self.numerics else f", decode={self.decode_numerics.name}"
        return f"KvfastModel({self.numerics.name}{dec}, bug={self.bug!r})"

    def recompute(self, tokens) -> np.ndarray:
        """Logits (T, V) of a full forward of ``tokens`` from position 0, no cache."""
        tokens = require_tokens(self.config, tokens)
        return forward_prepared(self.config, self.weights, tokens, self.numerics)

    def recompute_prefixes(self, tokens, lengths) -> list[np.ndarray]:
        """:meth:`recompute` of ``tokens[:n]`` for each ``n`` of ``lengths``, in one compiled call, bit for bit what
        :meth:`recompute` returns for each (:mod:`kvfast.check.protocol`). Declines with ``NotImplementedError``
        where :meth:`recompute` is not this class's own (a model that overrides it is recomputed through it)."""
        if type(self).recompute is not KvfastModel.recompute or "recompute" in vars(self):
            raise NotImplementedError("recompute() is overridden: each prefix goes through it")
        tokens = require_tokens(self.config, tokens)
        lengths = [require_int(n, "lengths", 1, tokens.shape[0]) for n in lengths]
        if not lengths:
            raise ValueError("lengths: [] is not allowed; allowed: one length or more")
        return recompute_prefixes_prepared(self.config, self.weights, tokens, lengths, self.numerics)

    def recompute_variants(self, tokens) -> dict[str, np.ndarray]:
        """The recompute in the decode numerics, when they differ from the prefill's (see the class)."""
        if self.decode_numerics == self.numerics:
            return {}
        tokens = require_tokens(self.config, tokens)
        return {"decode order": forward_prepared(self.config, self.weights, tokens, self.decode_numerics)}

    def promote(self, dtype: str = "float64") -> KvfastModel:
        """The same model and bug in float64 (``f64`` storage and accumulator, each path keeping its order)."""
        if dtype != "float64":
            raise ValueError(f"promote: {dtype!r} is not allowed; allowed: 'float64'")
        nx, dec = self.numerics, self.decode_numerics
        return KvfastModel(
            self.config, self.params, replace(nx, storage="f64", accum="f64"), bug=self.bug,
            decode_numerics=replace(dec, storage="f64", accum="f64"),
        )  # fmt: skip

    def prefill(self, tokens) -> np.ndarray:
        """A fresh cache filled with ``tokens`` (positions 0..T-1); their logits (T, V)."""
        tokens = require_tokens(self.config, tokens)
        self.cache = KVCache.empty(self.config, self.numerics)
        return forward_prepared(self.config, self.weights, tokens, self.numerics, self.cache)

    def extend(self, tokens) -> np.ndarray:
        """``tokens`` continuing the cache (a further prefill chunk); their logits (n, V)."""
        cache = self._cache()
        tokens = require_tokens(self.config, tokens, start=cache.length)
        return forward_prepared(self.config, self.weights, tokens, self.numerics, cache)

    def decode(self, token) -> np.ndarray:
        """One token at the cache's next position through the decode kernel; logits (V,)."""
        cache = self._cache()
        token = require_token(self.config, token)
        if cache.length >= cache.capacity:
            raise ValueError(
                f"decode: the cache is full ({cache.length} positions, max_pos={self.config.max_pos}); "
                f"allowed: at most {self.config.max_pos} positions in all"
            )
        return decode_prepared(self.config, self.weights, cache, token, self.decode_numerics, self.bug_code)

    def decode_greedy(self, token, n) -> np.ndarray:
        """``n`` :meth:`decode` steps, the first fed ``token``, each next the argmax (first maximum) of the step
        before's logits; their logits ``(n, V)`` (:mod:`kvfast.check.protocol`). Declines with
        ``NotImplementedError``, the cache untouched, when it has no room for ``n`` more positions (the checker
        then decodes step by step and meets :meth:`decode`'s own error)."""
        cache = self._cache()
        n = require_int(n, "n", 1)
        if cache.length + n > cache.capacity:
            raise NotImplementedError(f"{n} steps from position {cache.length} pass the cache's {cache.capacity}")
        if type(self).decode is KvfastModel.decode:  # the kernel itself: decode's checks hold at every step
            # (room: checked above; every token after the first: an argmax)
            return decode_greedy_prepared(
                self.config, self.weights, cache, require_token(self.config, token), n, self.decode_numerics,
                self.bug_code,
            )  # fmt: skip
        out = np.empty((n, self.vocab_size))
        for i in range(n):
            out[i] = self.decode(token)
            token = int(out[i].argmax())
        return out

    # --- cache operations (the rollback and fork scenarios, kvfast.check.scenarios) ------------------

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions of the cache (a rollback); the next decode is at position ``n``."""
        cache = self._cache()
        cache.truncate(self._crop_keep(n, cache.length))

    def _crop_keep(self, n: int, length: int) -> int:
        """Hook: the positions a crop to ``n`` of a cache of ``length`` positions keeps (``n``)."""
        return n

    def snapshot(self) -> KVCache:
        """A copy of the cache as it is now (its own key and value buffers)."""
        cache = self._cache()
        return replace(cache, k=self._copy_keys(cache.k), v=cache.v.copy())

    def restore(self, state: KVCache) -> None:
        """The cache set back to a copy of ``state`` (a :meth:`snapshot`; restorable again)."""
        if not isinstance(state, KVCache):
            raise ValueError(f"state: {type(state).__name__} is not allowed; allowed: a KVCache from snapshot()")
        self.cache = replace(state, k=self._copy_keys(state.k), v=state.v.copy())

    def _copy_keys(self, k: np.ndarray) -> np.ndarray:
        """Hook: the key buffer a snapshot or restore takes (a copy)."""
        return k.copy()

    def _cache(self) -> KVCache:
        if self.cache is None:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")
        return self.cache


def prepared_weights(config: ModelConfig, params: dict, numerics: Numerics) -> Weights:
    """``Weights.prepare(config, params, numerics)``, reused while ``params`` holds the same read-only arrays.

    Reused only for parameters that cannot change: a dict whose every array is read-only
    (``flags.writeable`` off) and owns its memory (not a view, whose owner could be written), the
    same array objects under the same names in the same order (an entry keeps them alive, so no
    other array can take their ids). Unlike :meth:`Weights.cached` (the public functions'), no flag
    of the caller's arrays is changed: writable parameters are prepared on every call, as before.
    Prepared weights depend on the parameters' shapes and the storage format only, so models that
    differ in ``n_head``, ``eps`` or their accumulator and order share them (the studies' grids do).
    A hit costs one id and one flag read per array (an entry's arrays are the very objects it was made of: only
    their flag can have changed since).
    """
    arrays = tuple(params.values()) if isinstance(params, dict) else ()
    shape = (config.vocab, config.d_model, config.n_layer, config.d_ff, config.max_pos)
    key = (shape, numerics.storage, tuple(params), tuple(map(id, arrays)))
    with _PREPARED_LOCK:
        entry = _PREPARED.pop(key, None)  # (put back below while still frozen)
    owners = entry is not None or all(isinstance(a, np.ndarray) and a.base is None for a in arrays)
    if not (arrays and owners) or any(a.flags.writeable for a in arrays):
        return Weights.prepare(config, params, numerics)
    if entry is None:
        entry = (arrays, Weights.prepare(config, params, numerics))
    with _PREPARED_LOCK:  # (a sweep's threads share it)
        _PREPARED.pop(key, None)
        while len(_PREPARED) >= _PREPARED_SIZE:
            del _PREPARED[next(iter(_PREPARED))]  # the least recently used
        _PREPARED[key] = entry  # most recently used last
    return entry[1]


# prepared_weights' entries, least recently used first: key -> (the arrays, kept alive; their Weights)
_PREPARED: dict[tuple, tuple[tuple, Weights]] = {}
_PREPARED_SIZE = 64
_PREPARED_LOCK = threading.Lock()


def clear_prepared_weights() -> None:
    """Forget every parameter set :func:`prepared_weights` keeps (a fresh process's state, for benchmarks)."""
    with _PREPARED_LOCK:
        _PREPARED.clear()
