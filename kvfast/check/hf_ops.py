"""The cache operations of :mod:`kvfast.check.operations` on Hugging Face caches (:class:`~kvfast.check.hf.HFModel`'s
``crop``, ``snapshot`` and ``restore`` hooks call these).

- ``crop(n)``: ``cache.crop(n - length)`` (transformers 5.x takes the number of positions to remove, as a
  negative int). As ``generate`` does for a cache it may roll back, the first crop (the rollback scenario
  calls ``crop(length)`` right after the prefill, a rollback of nothing) activates the cache's past
  recording (``activate_past_recording``), so that a sliding-window layer keeps the positions a later
  rollback needs; a crop that keeps everything is ``crop(0)``, which puts a sliding layer back to its
  window. A cache that cannot be rolled back (a tuple cache, a layer transformers marks not croppable)
  raises ``NotImplementedError``: the scenario is skipped with a note.
- ``snapshot()``: a ``copy.deepcopy`` of the cache and of the adapter's bookkeeping (length, decode
  count); ``restore(state)``: a fresh deep copy of it (a state may be restored again), with any injected
  bug's ``update`` wrapper put back on the copy.

Operation bugs (:data:`kvfast.check.operations.OP_BUGS`, set with
:func:`kvfast.check.operations.inject_op_bug`): ``crop_short`` keeps one position too many;
``fork_shared_keys`` gives every copy the original layers' key tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheState:
    """A snapshot of an :class:`~kvfast.check.hf.HFModel`'s cache: the cache and the adapter's counters."""

    cache: object
    length: int
    prefill_len: int
    decoded: int
    last_token: int | None


def _layers(cache) -> list:
    return list(getattr(cache, "layers", None) or [])


def crop(adapter, n: int) -> None:
    """Keep the first ``n`` positions of ``adapter``'s cache (see the module doc)."""
    from kvfast.validation import require_int

    adapter._require_cache()
    n = require_int(n, "n", 0, adapter.length)
    cache = adapter.cache
    if not callable(getattr(cache, "crop", None)):
        raise NotImplementedError(f"{type(cache).__name__} has no crop() (a tuple cache cannot roll back)")
    stuck = [type(layer).__name__ for layer in _layers(cache) if getattr(layer, "is_croppable", True) is False]
    if stuck:
        raise NotImplementedError(f"transformers marks the cache's {stuck[0]} layers not croppable")
    if callable(getattr(cache, "activate_past_recording", None)):
        cache.activate_past_recording()  # idempotent; generate does it before it may roll back
    if getattr(adapter, "op_bug", None) == "crop_short" and n < adapter.length:
        n += 1
    cache.crop(n - adapter.length)
    adapter.length = n
    adapter.decoded = max(0, n - adapter.prefill_len)


def _copy(cache, share_keys: bool = False):
    clone = copy.deepcopy(cache)
    if hasattr(clone, "__dict__"):
        # an injected bug wraps the instance's update(); its closure holds the ORIGINAL cache's method
        clone.__dict__.pop("update", None)
    if share_keys:  # the fork_shared_keys bug: the copy's layers keep the original key tensors
        for mine, theirs in zip(_layers(clone), _layers(cache), strict=True):
            mine.keys = theirs.keys
    return clone


def _shares_keys(adapter) -> bool:
    return getattr(adapter, "op_bug", None) == "fork_shared_keys"


def snapshot(adapter) -> CacheState:
    """A copy of ``adapter``'s cache as it is now."""
    adapter._require_cache()
    cache = _copy(adapter.cache, _shares_keys(adapter))
    return CacheState(cache, adapter.length, adapter.prefill_len, adapter.decoded, adapter.last_token)


def restore(adapter, state: CacheState) -> None:
    """``adapter``'s cache set back to a copy of ``state`` (a :func:`snapshot`)."""
    if not isinstance(state, CacheState):
        raise ValueError(f"state: {type(state).__name__} is not allowed; allowed: a CacheState from snapshot()")
    adapter.cache = _copy(state.cache, _shares_keys(adapter))
    adapter.length, adapter.prefill_len, adapter.decoded = state.length, state.prefill_len, state.decoded
    adapter.last_token = state.last_token
    adapter._inject()
