"""A transformers causal LM's cached path, called as the model's own ``generate`` calls it, and the cache
operations of :mod:`kvfast.check.scenarios` on it: :class:`CachedPath`, written once; and the tiny model a
reproducer names, built from its config (:func:`model_from_config`).

:class:`~kvfast.check.hf.HFModel` is a ``CachedPath`` that measures how ``generate`` calls the model; every
standalone reproducer (:mod:`kvfast.repro.script`) carries this module's source verbatim and answers the same
questions from what kvfast measured, so the reproducer's path and the checker's cannot drift. So this module
imports only torch, transformers and the standard library (torch and transformers inside the functions: importing
it must not load them).

A subclass answers how ``generate`` calls its model: the attributes ``cache_arg`` (:data:`CACHE_ARGS`),
``takes_mask``, ``takes_position_ids``, ``takes_cache_position``, and the methods ``_fresh_cache()`` (a fresh
cache, ``None`` where the model builds its own), ``_generate_passes_mask(ids, mask)`` (whether this call gets the
attention mask), ``_generate_positions()`` (whether cached calls get ``position_ids``) and
``_prefill_positions()`` (how many ``cache_position`` entries a ``cache_params`` model's prefill gets).

The cache operations:

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
- ``snapshot()``: a ``copy.deepcopy`` of the cache and of the counters (length, decode count);
  ``restore(state)``: a fresh deep copy of it (a state may be restored again), with ``_wrap_cache`` run on it.
- ``prefill_beams``, ``decode_beams``, ``reorder``: a batch of beams and ``cache.reorder_cache``;
  ``prefill_padded``, ``decode_padded``: a left-padded batch with the mask and positions ``generate`` builds.

The methods marked *hook* are where kvfast's injected bugs act (:mod:`kvfast.bugs.hf_mixins`).
"""

import copy
import functools
from dataclasses import dataclass

#: The names a model's ``forward`` may give its cache argument (and its output the cache), the first it takes
#: used: ``cache`` (transformers 5.x), ``past_key_values`` (4.x), ``cache_params`` (4.x and early 5.x state-space
#: models, whose own cache class the model builds itself).
CACHE_ARGS = ("cache", "past_key_values", "cache_params")
MODEL = "a transformers causal LM with a language-model head and a KV cache (e.g. AutoModelForCausalLM)"


@dataclass(frozen=True)
class CacheState:
    """A snapshot of a :class:`CachedPath`'s cache: the cache and the path's counters."""

    cache: object
    length: int
    prefill_len: int
    decoded: int
    last_token: int | None


def cache_layers(cache) -> list:
    """``cache.layers`` (``[]`` for a cache without layers)."""
    return list(getattr(cache, "layers", None) or [])


def model_from_config(model_class: str, config: dict, seed, attention: str, dtype: str, promote=None, weights=None):
    """The tiny model a reproducer names, built as kvfast and the standalone script both build it:
    ``torch.manual_seed(seed)`` (``None``: no seed, the weights are ``weights``, a state dict), the transformers class
    ``model_class``'s ``_from_config(AutoConfig.for_model(**config))`` with ``attention``, eval mode, cast to
    ``dtype``, then to ``promote`` (the logic check: the weights rounded to ``dtype``, run in ``promote``)."""
    import torch
    import transformers

    built = transformers.AutoConfig.for_model(**copy.deepcopy(config))
    if seed is not None:
        torch.manual_seed(seed)
    model = getattr(transformers, model_class)._from_config(built, attn_implementation=attention)
    if not isinstance(getattr(model.config, "vocab_size", None), int):  # a composite config (as the scan does)
        model.config.vocab_size = model.config.get_text_config().vocab_size
    model = model.eval().to(getattr(torch, dtype))
    if promote is not None:
        model = model.to(getattr(torch, promote))
    if weights is not None:
        model.load_state_dict(weights)
    return model


def new_dynamic_cache(config):
    """A fresh ``DynamicCache`` for ``config`` (4.x takes no config)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # pragma: no cover - 4.x: no config argument
        return DynamicCache()


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
    if not crop_zero_removes_nothing() or any(_past_window(layer) for layer in cache_layers(cache)):
        return None
    return 0


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
    for layer in cache_layers(cache):
        name = type(layer).__name__
        if not callable(getattr(layer, "crop", None)):
            return f"its {name} layers have no crop()"
        if getattr(layer, "is_croppable", True) is False:
            return f"transformers marks the cache's {name} layers not croppable"
        linear = any(k.__name__ == "LinearAttentionCacheLayerMixin" for k in type(layer).__mro__)
        if linear and not callable(getattr(layer, "activate_past_recording", None)):
            return f"its {name} layers' crop() leaves their states as they are (no past recording before 5.14)"
        if remove > 0 and _past_window(layer):
            return (
                f"its {name} layers have seen their window of {layer.sliding_window} positions and kept no past, so "
                "they cannot be cropped past it (no past recording before 5.15)"
            )
    return None


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


class CachedPath:
    """A transformers causal LM's cached calls as its ``generate`` makes them (a fresh cache per prefill, an
    all-ones attention mask over every position so far where ``generate`` passes one, ``position_ids`` after the
    cache where it passes them, ``cache_position`` where the model takes it) and the cache operations (see the
    module doc, which also lists what a subclass answers)."""

    beams = 0  # the beams of prefill_beams' batch
    pad_mask = None  # the attention mask of prefill_padded's batch

    def __init__(self, model) -> None:
        self.model = model
        self.cache = None
        self.length = 0
        self.prefill_len = 0
        self.decoded = 0
        self.last_token: int | None = None

    # --- hooks ------------------------------------------------------------------------------------------------

    def _ids(self, tokens, start: int):
        """Hook: ``tokens`` (fed at positions ``start`` on) as a ``(1, n)`` int64 tensor."""
        import torch

        return torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)

    def _call(self, model, **kwargs):
        """``model(**kwargs)`` without gradients: ``(logits, cache)`` (``None`` for what it does not return)."""
        import torch

        with torch.no_grad():
            out = model(**kwargs)
        if isinstance(out, tuple):
            return out[0], (out[1] if len(out) > 1 else None)
        keys = list(out.keys())  # never read a deprecated name: transformers 5.x warns on past_key_values
        name = next((k for k in CACHE_ARGS if k in keys), None)
        return out.get("logits"), (None if name is None else out[name])

    def _cached_forward(self, **kwargs):
        """Hook: the model's forward on the cache path (every cached call; never the recompute): ``(logits,
        cache)``."""
        return self._call(self.model, **kwargs)

    def _attention_mask(self, n: int):
        """Hook: the attention mask of a cached call of ``n`` tokens, as ``generate`` builds it (all ones over
        every position so far)."""
        import torch

        return torch.ones(1, self.length + n, dtype=torch.long)

    def _decode_positions(self) -> list[int] | None:
        """Hook: the ``position_ids`` of the next decoded token, ``None`` for the model's own (or ``generate``'s)."""
        return None

    def _wrap_cache(self) -> None:
        """Hook: called on every fresh or restored cache (``self.cache``), where a subclass may wrap it."""

    def _crop_keep(self, n: int, length: int) -> int:
        """Hook: the positions a crop to ``n`` of a cache of ``length`` positions keeps (``n``)."""
        return n

    def _copy_cache(self, cache):
        """Hook: the copy of ``cache`` a snapshot or restore takes: a deep copy without a wrapper of the
        instance's ``update`` (its closure holds the ORIGINAL cache's method; ``_wrap_cache`` wraps the copy
        again)."""
        clone = copy.deepcopy(cache)
        if hasattr(clone, "__dict__"):
            clone.__dict__.pop("update", None)
        return clone

    def _reorder_cache(self, cache, index) -> None:
        """Hook: ``cache``'s beams reordered by ``index`` (a tensor; ``cache.reorder_cache``)."""
        cache.reorder_cache(index)

    def _padded_positions(self, mask, n: int):
        """Hook: the positions of the last ``n`` columns of a left-padded batch's ``mask``, as ``generate`` builds
        them (``mask.cumsum(-1) - 1``, pads at 1)."""
        positions = mask.cumsum(-1) - 1
        positions.masked_fill_(mask == 0, 1)
        return positions[:, -n:]

    # --- one sequence -----------------------------------------------------------------------------------------

    def _require_cache(self) -> None:
        if self.cache is None and self.length == 0:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")

    def cache_positions(self, n: int):
        """The ``cache_position`` of the next ``n`` tokens, as ``generate`` numbers them: the positions after the
        cache, except in a ``cache_params`` model (4.x Mamba, Mamba-2), whose ``generate`` gives the prefill
        ``arange(conv_kernel)`` whatever the prompt's length (``_prefill_positions``) and counts on from there: a
        shorter prefill's later calls are numbered ``conv_kernel`` on (the state cache writes the new conv column
        at the clamped position; measured on 4.57.6, Mamba continued after a prefill of 1 or 2 tokens numbered
        from the tokens was off by about 1 from the recompute)."""
        import torch

        start = self.length
        if self.cache_arg == "cache_params" and self.length > 0:
            start += max(0, self._prefill_positions() - self.prefill_len)
        return torch.arange(start, start + n)

    def _cached(self, tokens, positions=None):
        """``tokens`` on top of the cache (positions from ``self.length``); their logits ``(n, V)``."""
        import torch

        ids = self._ids(tokens, self.length)
        n = ids.shape[1]
        if positions is None and self._generate_positions():
            positions = list(range(self.length, self.length + n))
        if positions is not None:
            positions = torch.as_tensor(positions, dtype=torch.long)[None, :]
        mask = self._attention_mask(n) if self.takes_mask else None
        logits = self._batch_call(ids, mask, positions, ask_at_prefill=True)
        self.last_token = int(ids[0, -1])
        return logits[0]

    def prefill(self, tokens):
        """A fresh cache filled with ``tokens`` (positions ``0..T-1``); their logits ``(T, V)``."""
        self.cache, self.length, self.decoded = self._fresh_cache(), 0, 0
        self._wrap_cache()
        out = self._cached(tokens)
        self.prefill_len = self.length
        return out

    def extend(self, tokens):
        """``tokens`` continuing the cache (a further prompt chunk); their logits ``(n, V)``. A ``cache_params``
        model (:data:`CACHE_ARGS`) takes them one call per token, as its ``generate`` feeds it after the prefill
        (its ``prepare_inputs_for_generation`` keeps the last token only): measured on 4.57.6, a chunk raises in
        Mamba (IndexError) and is ``bug`` from its first row in Mamba-2."""
        import torch

        self._require_cache()
        if self.cache_arg == "cache_params":
            return torch.cat([self._cached([t]) for t in self._ids(tokens, self.length)[0].tolist()])
        return self._cached(tokens)

    def decode(self, token):
        """One token at the cache's next position; logits ``(V,)``."""
        self._require_cache()
        positions = self._decode_positions()
        self.decoded += 1
        return self._cached([token], positions)[0]

    # --- rollback and fork ------------------------------------------------------------------------------------

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions of the cache (see the module doc)."""
        self._require_cache()
        cache = self.cache
        why = cannot_crop(cache, self.length - n)
        if why is not None:
            raise NotImplementedError(f"{release()}: {why}")
        if callable(getattr(cache, "activate_past_recording", None)) and not any(
            getattr(layer, "record_past", False) is True for layer in cache_layers(cache)
        ):  # once per cache, as generate does after its prefill: a second call forgets the states already recorded
            refused(cache, "activate_past_recording()", cache.activate_past_recording)
        n = self._crop_keep(n, self.length)
        argument = crop_argument(cache, self.length - n)
        if argument is not None:
            refused(cache, f"crop({argument})", cache.crop, argument)
        self.length = n
        self.decoded = max(0, n - self.prefill_len)

    def snapshot(self) -> CacheState:
        """A copy of the cache as it is now, with the counters."""
        self._require_cache()
        return CacheState(self._copy_cache(self.cache), self.length, self.prefill_len, self.decoded, self.last_token)

    def restore(self, state: CacheState) -> None:
        """The cache set back to a copy of ``state`` (a :meth:`snapshot`)."""
        if not isinstance(state, CacheState):
            raise ValueError(f"state: {type(state).__name__!r} is not allowed; allowed: a CacheState from snapshot()")
        self.cache = self._copy_cache(state.cache)
        self.length, self.prefill_len, self.decoded = state.length, state.prefill_len, state.decoded
        self.last_token = state.last_token
        self._wrap_cache()

    # --- a batch: beams (the reorder scenario) and a left-padded batch (the padded scenario) --------------------

    def _batch_call(self, ids, mask, positions=None, ask_at_prefill: bool = False):
        """The model called on the batch ``ids`` after the cache, as ``generate`` calls it: ``mask`` where it passes
        one (asked of the first row; a batch's prefill keeps its mask unless ``ask_at_prefill``: state-space models
        drop it after the prefill, and their mixers multiply the new rows by it), ``positions`` as
        ``position_ids``, ``cache_position`` where the model takes it; the cache and length advanced; the logits
        ``(b, n, V)``."""
        n = ids.shape[1]
        kwargs = {"input_ids": ids, "use_cache": True, self.cache_arg: self.cache}
        prefill_keeps = self.length == 0 and not ask_at_prefill
        if mask is not None and (prefill_keeps or self._generate_passes_mask(ids[:1], mask[:1])):
            kwargs["attention_mask"] = mask
        if positions is not None:
            kwargs["position_ids"] = positions
        if self.takes_cache_position:
            kwargs["cache_position"] = self.cache_positions(n)
        logits, cache = self._cached_forward(**kwargs)
        if cache is None:
            name = type(self.model).__name__
            raise ValueError(
                f"model: {name!r} is not allowed; allowed: {MODEL}; it returned no cache with use_cache=True"
            )
        self.cache = cache
        self.length += n
        return logits

    def prefill_beams(self, tokens, n: int):
        """A fresh cache holding ``n`` beams of ``tokens`` (a batch of ``n`` copies, as beam search starts);
        logits ``(n, T, V)``."""
        import torch

        ids = self._ids(tokens, 0).repeat(n, 1)
        self.cache, self.length, self.decoded = self._fresh_cache(), 0, 0
        self.beams = n
        logits = self._batch_call(ids, torch.ones(n, ids.shape[1], dtype=torch.long) if self.takes_mask else None)
        self.prefill_len = self.length
        return logits

    def decode_beams(self, tokens):
        """One token per beam on top of the beams' cache; logits ``(n, V)``."""
        import torch

        if self.beams < 1 or self.cache is None:
            raise ValueError("cache: no beams; allowed: call prefill_beams(tokens, n) first")
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)
        if ids.shape[0] != self.beams:
            raise ValueError(f"tokens: {ids.shape[0]} tokens are not allowed; allowed: one per beam ({self.beams})")
        mask = torch.ones(ids.shape[0], self.length + 1, dtype=torch.long) if self.takes_mask else None
        return self._batch_call(ids, mask)[:, -1]

    def reorder(self, index) -> None:
        """The beams reordered: beam ``i`` holds what beam ``index[i]`` held (``_reorder_cache``)."""
        import torch

        cache = self.cache
        if not callable(getattr(cache, "reorder_cache", None)):
            raise NotImplementedError(f"{release()}: {type(cache).__name__} has no reorder_cache()")
        stuck = [
            type(layer).__name__ for layer in cache_layers(cache) if not callable(getattr(layer, "reorder_cache", None))
        ]
        if stuck:
            raise NotImplementedError(f"{release()}: its {stuck[0]} layers have no reorder_cache()")
        refused(cache, "reorder_cache()", self._reorder_cache, cache, torch.as_tensor(index, dtype=torch.long))

    def _padded_call(self, ids, n: int):
        positions = self._padded_positions(self.pad_mask, n) if self.takes_position_ids else None
        return self._batch_call(ids, self.pad_mask, positions)

    def prefill_padded(self, prompts) -> list:
        """A fresh cache holding ``prompts`` (token sequences of any lengths) as one left-padded batch, with the
        attention mask and positions ``generate`` builds; each prompt's logits ``(T_i, V)``, pads dropped."""
        import torch

        rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        width = max(r.shape[0] for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - r.shape[0] :] = r
            mask[i, width - r.shape[0] :] = 1
        self.cache, self.length, self.decoded = self._fresh_cache(), 0, 0
        self.pad_mask = mask
        logits = self._padded_call(ids, width)
        self.prefill_len = self.length
        return [logits[i, width - r.shape[0] :] for i, r in enumerate(rows)]

    def decode_padded(self, tokens):
        """One token per row of the padded batch; logits ``(n, V)``."""
        import torch

        mask = self.pad_mask
        if mask is None or self.cache is None:
            raise ValueError("cache: no padded batch; allowed: call prefill_padded(prompts) first")
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)
        if ids.shape[0] != mask.shape[0]:
            raise ValueError(f"tokens: {ids.shape[0]} tokens are not allowed; allowed: one per row ({mask.shape[0]})")
        self.pad_mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], dim=1)
        return self._padded_call(ids, 1)[:, -1]
