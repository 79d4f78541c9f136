"""The cache operations of :mod:`kvfast.check.scenarios` on Hugging Face caches (:class:`~kvfast.check.hf.HFModel`'s
``crop``, ``snapshot`` and ``restore`` hooks call these).

- ``crop(n)``: ``cache.crop(n - length)`` (transformers 5.x takes the number of positions to remove, as a
  negative int). As ``generate`` does for a cache it may roll back, the first crop (the rollback scenario
  calls ``crop(length)`` right after the prefill, a rollback of nothing) activates the cache's past
  recording (``activate_past_recording``), so that a sliding-window layer keeps the positions a later
  rollback needs; a crop that keeps everything is ``crop(0)``, which puts a sliding layer back to its
  window. A cache that cannot be rolled back (a tuple cache, a layer transformers marks not croppable)
  raises ``NotImplementedError``: the scenario is skipped with a note.
- ``snapshot()``: a ``copy.deepcopy`` of the cache and of the adapter's bookkeeping (length, decode
  count); ``restore(state)``: a fresh deep copy of it (a state may be restored again), with the adapter's
  ``_wrap_cache`` hook run on the copy.

Operation bugs (:mod:`kvfast.bugs.operations`) subclass the adapter: they act in its hooks
(``_crop_keep``, ``_copy_cache``, ``_reorder_cache``, ``_padded_positions``, ``_cached_forward``), which
these functions call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np


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
    n = adapter._crop_keep(n, adapter.length)
    cache.crop(n - adapter.length)
    adapter.length = n
    adapter.decoded = max(0, n - adapter.prefill_len)


def copy_cache(cache):
    """A deep copy of ``cache`` without a wrapper of the instance's ``update`` (its closure holds the ORIGINAL
    cache's method; the adapter's ``_wrap_cache`` hook wraps the copy again)."""
    clone = copy.deepcopy(cache)
    if hasattr(clone, "__dict__"):
        clone.__dict__.pop("update", None)
    return clone


def snapshot(adapter) -> CacheState:
    """A copy of ``adapter``'s cache as it is now."""
    adapter._require_cache()
    cache = adapter._copy_cache(adapter.cache)
    return CacheState(cache, adapter.length, adapter.prefill_len, adapter.decoded, adapter.last_token)


def restore(adapter, state: CacheState) -> None:
    """``adapter``'s cache set back to a copy of ``state`` (a :func:`snapshot`)."""
    if not isinstance(state, CacheState):
        raise ValueError(f"state: {type(state).__name__} is not allowed; allowed: a CacheState from snapshot()")
    adapter.cache = adapter._copy_cache(state.cache)
    adapter.length, adapter.prefill_len, adapter.decoded = state.length, state.prefill_len, state.decoded
    adapter.last_token = state.last_token
    adapter._wrap_cache()
    if getattr(adapter, "lossy_emulation", None) is not None:  # the emulation's wrapper, on the copy
        frozen = dict(getattr(adapter.cache, "lossy_scales", {}))
        wrap_round_trip(adapter.cache, adapter.lossy_emulation)
        adapter.cache.lossy_scales.update(frozen)


# --- lossy caches (kvfast.check.lossy) -------------------------------------------------------------------


def lossy_format(adapter) -> str | None:
    """The lossy format of ``adapter``'s cache: kvfast's emulation's, else read from a fresh cache's layers
    (a ``QuantizedCache``: ``fp8-tensor`` for its fp8 backend, ``int<nbits>`` for quanto and HQQ), else ``None``."""
    emulated = getattr(adapter, "lossy_emulation", None)
    if emulated is not None:
        return emulated
    if adapter.new_cache is None:
        return None
    key = id(adapter.new_cache)
    if getattr(adapter, "_lossy_probe", (None,))[0] != key:
        found = None
        for layer in _layers(adapter.new_cache()):
            name = type(layer).__name__
            if name == "Fp8QuantizedLayer":
                found = "fp8-tensor"
            elif "Quantized" in name:
                found = f"int{int(getattr(layer, 'nbits', 4))}"
        adapter._lossy_probe = (key, found)
    return adapter._lossy_probe[1]


def lossless(adapter):
    """The same adapter (bugs included) over a fresh ``DynamicCache``: the cache unquantized."""
    twin = copy.copy(adapter)
    twin.new_cache, twin.lossy_emulation = None, None
    twin.cache, twin.length = None, 0
    return twin


def _round_trip_tensor(fmt: str, tensor, scale: float | None = None):
    import torch

    from kvfast.check.lossy_formats import round_trip

    out = round_trip(fmt, tensor.detach().double().numpy(), scale)
    return torch.from_numpy(out).to(tensor.dtype)


def wrap_round_trip(cache, fmt: str) -> None:
    """Round-trip every key and value ``cache`` stores through ``fmt`` (kvfast's own emulation); a prefill
    attends its fresh rows, every later call the stored ones (as transformers' quantized layers do).
    ``fp8-tensor``: each layer's key and value scales are frozen at its first store."""
    from kvfast.check.lossy_formats import FP8_MAX

    update = cache.update
    scales: dict[int, tuple] = {}

    def lossy_update(key_states, value_states, layer_idx, *args, **kwargs):
        n = key_states.shape[-2]
        if fmt == "fp8-tensor" and layer_idx not in scales:
            scales[layer_idx] = tuple(float(t.abs().amax().float()) / FP8_MAX for t in (key_states, value_states))
        ks, vs = scales.get(layer_idx, (None, None))
        kq, vq = _round_trip_tensor(fmt, key_states, ks), _round_trip_tensor(fmt, value_states, vs)
        keys, values = update(kq, vq, layer_idx, *args, **kwargs)
        if n > 1 and keys.shape[-2] == n:
            return key_states, value_states
        return keys, values

    cache.update = lossy_update
    cache.lossy_scales = scales  # a restored copy keeps the frozen scales (restore wraps the copy again)


def with_lossy_cache(adapter, fmt: str):
    """The lossless twin of ``adapter`` with kvfast's own round trip of ``fmt`` on a ``DynamicCache``."""
    from transformers import DynamicCache

    twin = lossless(adapter)
    model = adapter.model

    def make():
        cache = DynamicCache(config=model.config)
        wrap_round_trip(cache, fmt)
        return cache

    twin.new_cache, twin.lossy_emulation = make, fmt
    return twin


# --- beams (the reorder scenario, kvfast.check.scenarios) -------------------------------------------------


def prefill_beams(adapter, tokens, n: int):
    """A fresh cache holding ``n`` beams of ``tokens`` (a batch of ``n`` copies, as beam search starts);
    logits ``(n, T, V)``."""
    import torch

    ids = adapter._ids(tokens, 0).repeat(n, 1)
    adapter.cache, adapter.length, adapter.decoded = adapter._fresh_cache(), 0, 0
    adapter.beams = n
    return _beam_call(adapter, ids, torch)


def decode_beams(adapter, tokens):
    """One token per beam on top of the beams' cache; logits ``(n, V)``."""
    import torch

    if getattr(adapter, "beams", 0) < 1 or adapter.cache is None:
        raise ValueError("cache: no beams; allowed: call prefill_beams(tokens, n) first")
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64).reshape(-1, 1))
    if ids.shape[0] != adapter.beams:
        raise ValueError(f"tokens: {ids.shape[0]} tokens are not allowed; allowed: one per beam ({adapter.beams})")
    return _beam_call(adapter, ids, torch)[:, -1]


def _beam_call(adapter, ids, torch):
    n = ids.shape[1]
    mask = torch.ones(ids.shape[0], adapter.length + n, dtype=torch.long) if adapter.takes_mask else None
    return _call_appending(adapter, ids, torch, attention_mask=mask)


def _call_appending(adapter, ids, torch, **extra):
    """The model called on ``ids`` after the adapter's cache (``extra``: keyword arguments, ``None`` ones left
    out; ``cache_position`` added where the model takes it); the cache and length advanced; the logits."""
    n = ids.shape[1]
    kwargs = {"input_ids": ids, "use_cache": True, adapter.cache_arg: adapter.cache}
    kwargs.update((k, v) for k, v in extra.items() if v is not None)
    if adapter.takes_cache_position:
        kwargs["cache_position"] = torch.arange(adapter.length, adapter.length + n)
    logits, cache = adapter._cached_forward(**kwargs)
    adapter.cache = cache
    adapter.length += n
    return logits


def reorder(adapter, index) -> None:
    """The beams reordered: beam ``i`` holds what beam ``index[i]`` held (the adapter's ``_reorder_cache``
    hook: ``cache.reorder_cache``)."""
    import torch

    cache = adapter.cache
    if not callable(getattr(cache, "reorder_cache", None)):
        raise NotImplementedError(f"{type(cache).__name__} has no reorder_cache()")
    idx = torch.as_tensor(np.asarray(index, dtype=np.int64))
    adapter._reorder_cache(cache, idx)


# --- a left-padded batch (the padded scenario, kvfast.check.scenarios) ------------------------------------


def prefill_padded(adapter, prompts) -> list:
    """A fresh cache holding ``prompts`` (token arrays of any lengths) as one left-padded batch, with the
    attention mask and positions ``generate`` builds (``mask.cumsum(-1) - 1``, pads at 1); each prompt's
    logits ``(T_i, V)``, pads dropped."""
    import torch

    rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    width = max(r.shape[0] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[0] :] = torch.from_numpy(r)
        mask[i, width - r.shape[0] :] = 1
    adapter.cache, adapter.length, adapter.decoded = adapter._fresh_cache(), 0, 0
    adapter.pad_mask = mask
    logits = _padded_call(adapter, ids, adapter._padded_positions(mask, width), torch)
    return [logits[i, width - r.shape[0] :] for i, r in enumerate(rows)]


def decode_padded(adapter, tokens):
    """One token per row of the padded batch; logits ``(n, V)``."""
    import torch

    mask = getattr(adapter, "pad_mask", None)
    if mask is None or adapter.cache is None:
        raise ValueError("cache: no padded batch; allowed: call prefill_padded(prompts) first")
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64).reshape(-1, 1))
    if ids.shape[0] != mask.shape[0]:
        raise ValueError(f"tokens: {ids.shape[0]} tokens are not allowed; allowed: one per row ({mask.shape[0]})")
    adapter.pad_mask = mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], dim=1)
    return _padded_call(adapter, ids, adapter._padded_positions(mask, 1), torch)[:, -1]


def generate_positions(mask, n: int):
    """The positions of the last ``n`` columns of ``mask``, as ``generate`` builds them."""
    positions = mask.cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)
    return positions[:, -n:]


def _padded_call(adapter, ids, positions, torch):
    positions = positions if adapter.takes_position_ids else None
    return _call_appending(adapter, ids, torch, attention_mask=adapter.pad_mask, position_ids=positions)
