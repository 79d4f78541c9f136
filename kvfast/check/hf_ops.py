"""The cache operations of :mod:`kvfast.check.scenarios` on Hugging Face caches (:class:`~kvfast.check.hf.HFModel`'s
``crop``, ``snapshot`` and ``restore`` hooks call these).

- ``crop(n)``: the installed transformers release asked how to remove ``length - n`` positions
  (:func:`crop_argument`, the one place that decides it): ``cache.crop(-r)`` removes ``r > 0`` positions in
  every release; ``crop(0)`` removes nothing from 5.14 on (and puts a sliding or linear-attention layer that
  records its past back to its window), but keeps 0 positions, i.e. empties the cache, before 5.14, where a
  rollback of nothing is therefore no call at all. As ``generate`` does for a cache it may roll back, the
  first crop (the rollback scenario calls ``crop(length)`` right after the prefill, a rollback of nothing)
  activates the cache's past recording (``activate_past_recording``, once per cache: a second call forgets
  what was recorded), wherever the release offers it, so that sliding-window and linear-attention layers keep
  the positions and states a later rollback needs.
- Skipped, never the model's error: a cache the release cannot roll back (:func:`cannot_crop`: a tuple cache,
  a layer with no ``crop`` such as 5.0's ``StaticLayer``, a layer transformers marks not croppable, a
  linear-attention layer with no past recording, a sliding-window layer past its window with no past
  recording) raises ``NotImplementedError`` naming the release and the reason before the cache is changed;
  so does a crop, reorder or recording call that the release itself refuses by raising (:func:`refused`).
  What goes wrong after the release accepted the call (the next forward raises, or its logits differ) is
  the model's failure, reported as any other: a release's wrong behaviour is a finding.
- ``snapshot()``: a ``copy.deepcopy`` of the cache and of the adapter's bookkeeping (length, decode
  count); ``restore(state)``: a fresh deep copy of it (a state may be restored again), with the adapter's
  ``_wrap_cache`` hook run on the copy.

Operation bugs (:mod:`kvfast.bugs.operations`) subclass the adapter: they act in its hooks
(``_crop_keep``, ``_copy_cache``, ``_reorder_cache``, ``_padded_positions``, ``_cached_forward``), which
these functions call.
"""

from __future__ import annotations

import copy
import functools
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


# --- what the installed transformers release can do with a cache (asked here, nowhere else) -------------


def release() -> str:
    """The installed transformers release (``transformers.__version__``), as notes name it."""
    import transformers

    return f"transformers {transformers.__version__}"


@functools.cache
def crop_zero_removes_nothing() -> bool:
    """Whether the installed release's ``cache.crop(0)`` removes nothing (5.14 on: ``crop(-r)`` removes ``r``
    positions and ``crop(0)`` none) rather than keeping 0 positions (before 5.14 a non-negative argument is the
    length to KEEP, so ``crop(0)`` empties the cache). Asked of the release itself: a ``DynamicCache`` holding
    two positions, cropped with 0 (``False`` where that cannot be asked: no call is then made for a rollback of
    nothing, which is right on every release)."""
    import torch

    try:
        from transformers import DynamicCache

        cache = DynamicCache()
        kv = torch.zeros(1, 1, 2, 1)
        cache.update(kv, kv, 0)
        cache.crop(0)
        return int(cache.get_seq_length()) == 2
    except Exception:  # noqa: BLE001 - a release that cannot be asked: the safe answer
        return False


def crop_argument(cache, remove: int) -> int | None:
    """The argument of ``cache.crop`` that removes ``remove`` positions on the installed release (``None``: make
    no call). ``crop(-r)`` removes ``r`` in every release kvfast supports; a rollback of nothing is ``crop(0)``
    where that removes nothing (:func:`crop_zero_removes_nothing`), else no call (``crop(0)`` would empty the
    cache), and no call either on a sliding layer past its window that keeps no past (5.14's ``crop`` raises
    there, and there is nothing to tidy)."""
    if remove > 0:
        return -remove
    if not crop_zero_removes_nothing() or any(_past_window(layer) for layer in _layers(cache)):
        return None
    return 0


def _is_linear_attention(layer) -> bool:
    return any(k.__name__ == "LinearAttentionCacheLayerMixin" for k in type(layer).__mro__)


def _past_window(layer) -> bool:
    """A sliding-window layer that has seen its window and keeps no past: its release's ``crop`` raises
    (before 5.15 always; from 5.15 on unless it records its past)."""
    window = getattr(layer, "sliding_window", None)
    if not isinstance(window, int) or getattr(layer, "record_past", False) is True:
        return False
    length = layer.get_seq_length() if callable(getattr(layer, "get_seq_length", None)) else 0
    return int(length) >= window


def cannot_crop(cache, remove: int) -> str | None:
    """Why the installed release cannot remove ``remove`` positions from ``cache`` now (``None``: it can);
    asked before anything is changed."""
    if not callable(getattr(cache, "crop", None)):
        return f"{type(cache).__name__} has no crop()"
    for layer in _layers(cache):
        name = type(layer).__name__
        if not callable(getattr(layer, "crop", None)):
            return f"its {name} layers have no crop()"
        if getattr(layer, "is_croppable", True) is False:
            return f"transformers marks the cache's {name} layers not croppable"
        if _is_linear_attention(layer) and not callable(getattr(layer, "activate_past_recording", None)):
            return f"its {name} layers' crop() leaves their states as they are (no past recording before 5.14)"
        if remove > 0 and _past_window(layer):
            return (
                f"its {name} layers have seen their window of {layer.sliding_window} positions and kept no past, so "
                "they cannot be cropped past it (no past recording before 5.15)"
            )
    return None


def _records_past(cache) -> bool:
    return any(getattr(layer, "record_past", False) is True for layer in _layers(cache))


def refused(cache, operation: str, call, *args) -> None:
    """``call(*args)``, the installed release's own cache operation (``cache.crop(-r)``, ``reorder_cache``,
    ``activate_past_recording``): whatever it raises is the release refusing the operation, not the model's
    error, and becomes ``NotImplementedError`` naming the release, the call and the refusal (the scenario is
    skipped with that note). A call that returns is accepted: what goes wrong after it (the next forward) is
    reported as the model's, as any other failure."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - any refusal of the release's own operation
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise NotImplementedError(
            f"{release()} refuses {type(cache).__name__}.{operation}: {type(exc).__name__}: {reason}"
        ) from exc


def crop(adapter, n: int) -> None:
    """Keep the first ``n`` positions of ``adapter``'s cache (see the module doc)."""
    from kvfast.validation import require_int

    adapter._require_cache()
    n = require_int(n, "n", 0, adapter.length)
    cache = adapter.cache
    why = cannot_crop(cache, adapter.length - n)
    if why is not None:
        raise NotImplementedError(f"{release()}: {why}")
    if callable(getattr(cache, "activate_past_recording", None)) and not _records_past(cache):
        # once per cache, as generate does after its prefill: a second call forgets the states already recorded
        refused(cache, "activate_past_recording()", cache.activate_past_recording)
    n = adapter._crop_keep(n, adapter.length)
    argument = crop_argument(cache, adapter.length - n)
    if argument is not None:
        refused(cache, f"crop({argument})", cache.crop, argument)
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
    logits = _beam_call(adapter, ids, torch)
    adapter.prefill_len = adapter.length
    return logits


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


def _mask_as_generate(adapter, ids, mask):
    """``mask`` where the model's ``generate`` passes one in this call (asked as for a single sequence,
    :meth:`~kvfast.check.hf.HFModel._generate_passes_mask`), else ``None``: state-space models (Mamba, Mamba-2,
    FalconMamba) drop it after the prefill, and their mixers multiply the new rows by it (a mask over every
    position: clean Mamba ``bug`` in reorder and padded on 5.24, a shape error on 4.57.6)."""
    if mask is None or adapter.length == 0:
        return mask
    return mask if adapter._generate_passes_mask(ids[:1], mask[:1]) else None


def _call_appending(adapter, ids, torch, **extra):
    """The model called on ``ids`` after the adapter's cache (``extra``: keyword arguments, ``None`` ones left
    out; ``cache_position`` added where the model takes it); the cache and length advanced; the logits."""
    n = ids.shape[1]
    kwargs = {"input_ids": ids, "use_cache": True, adapter.cache_arg: adapter.cache}
    extra["attention_mask"] = _mask_as_generate(adapter, ids, extra.get("attention_mask"))
    kwargs.update((k, v) for k, v in extra.items() if v is not None)
    if adapter.takes_cache_position:
        kwargs["cache_position"] = adapter.cache_positions(n)
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
        raise NotImplementedError(f"{release()}: {type(cache).__name__} has no reorder_cache()")
    stuck = [type(layer).__name__ for layer in _layers(cache) if not callable(getattr(layer, "reorder_cache", None))]
    if stuck:
        raise NotImplementedError(f"{release()}: its {stuck[0]} layers have no reorder_cache()")
    idx = torch.as_tensor(np.asarray(index, dtype=np.int64))
    refused(cache, "reorder_cache()", adapter._reorder_cache, cache, idx)


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
    adapter.prefill_len = adapter.length
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
