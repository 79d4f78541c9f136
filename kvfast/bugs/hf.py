"""Cache bugs injected into a Hugging Face model's cache path (:class:`~kvfast.check.hf.HFModel`): the recompute
and the order-noise variants stay clean. Each is a mixin over the adapter's hooks (:func:`inject_hf_bug`).

``HFModel(model)`` with bug ``"posoff"``: ``inject_hf_bug(HFModel(model), "posoff")`` (or
``HF_BUGS["posoff"].inject(HFModel(model))``). :func:`first_acting_step` says where each first acts.
"""

from __future__ import annotations

import numpy as np

from kvfast.bugs.bug import Bug, catalogue, first_acting_in, inject_from, mixin_injector
from kvfast.check.hf import HFModel
from kvfast.validation import not_allowed

#: The window of the ``window`` bug (positions decode attends).
HF_WINDOW = 8


class _HFBug:
    """What every Hugging Face bug mixin shares: its name (``bug``), shown in the adapter's repr."""

    bug: str

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, bug={self.bug!r})"


class _Window(_HFBug):
    bug = "window"

    def _attention_mask(self, n: int):
        mask = super()._attention_mask(n)
        if n == 1:
            mask[0, : max(0, self.length + n - HF_WINDOW)] = 0
        return mask

    def _generate_passes_mask(self, ids, mask) -> bool:
        passes = super()._generate_passes_mask(ids, mask)
        if not passes and ids.shape[1] == 1:  # the bug lives in the mask: a model given none cannot take it
            raise not_allowed("bug", self.bug, "a bug the model can take (its generate passes no attention mask)")
        return passes


class _Positions(_HFBug):
    """A bug in the decoded token's ``position_ids``: a model whose forward takes none cannot take it."""

    def _decode_positions(self) -> list[int]:
        if not self.takes_position_ids:
            raise not_allowed("bug", self.bug, "a bug the model's forward() can take (it has no position_ids)")
        return [self._position()]

    def _position(self) -> int:
        raise NotImplementedError


class _PositionOff(_Positions):
    bug = "posoff"

    def _position(self) -> int:
        return self.length - 1


class _Restart(_Positions):
    bug = "restart"

    def _position(self) -> int:
        return self.prefill_len + self.decoded


class _CacheUpdate(_HFBug):
    """A bug inside the cache: the fresh (or restored) cache's ``update`` wrapped by :meth:`_update`."""

    def _wrap_cache(self) -> None:
        super()._wrap_cache()
        if not callable(getattr(self.cache, "update", None)):
            raise not_allowed("bug", self.bug, "a bug the model's cache can take (its cache is a tuple, no update())")
        self.cache.update = self._update(self.cache.update)


class _Freeze(_CacheUpdate):
    bug = "freeze"

    def _update(self, update):
        last_layer = int(self.model.config.num_hidden_layers) - 1
        frozen: dict[str, object] = {}
        adapter = self

        def frozen_update(key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == last_layer and key_states.shape[-2] == 1:
                step = adapter.decoded  # decode step being computed (1-based; incremented before the call)
                if step == 1:
                    frozen["key"] = key_states.clone()
                elif step > 1 and "key" in frozen:
                    key_states = frozen["key"]
            return update(key_states, value_states, layer_idx, *args, **kwargs)

        return frozen_update


class _Float16(_CacheUpdate):
    bug = "f16"

    def _update(self, update):
        import torch

        def f16_update(key_states, value_states, layer_idx, *args, **kwargs):
            n = key_states.shape[-2]
            k16 = key_states.to(torch.float16).to(key_states.dtype)
            v16 = value_states.to(torch.float16).to(value_states.dtype)
            keys, values = update(k16, v16, layer_idx, *args, **kwargs)
            if n > 1 and keys.shape[-2] == n:  # the prefill attends its fresh keys; the cache keeps rounded ones
                return key_states, value_states
            return keys, values

        return f16_update


class _Replay(_HFBug):
    bug = "replay"

    def extend(self, tokens):
        self._require_cache()
        tokens = np.concatenate([[self.last_token], np.asarray(tokens, dtype=np.int64).reshape(-1)])
        return self._cached(tokens)[1:]


_injector = mixin_injector(HFModel, "an HFModel (kvfast.check.hf)")


def _window_acts(scenario, prompt_len, steps, window):
    return max(1, HF_WINDOW - prompt_len + 1)


#: The Hugging Face cache bugs (the ``bug`` axis of the ``hf_matrix``, ``hf_score`` and ``hf_scan`` studies).
HF_BUGS: dict[str, Bug] = catalogue(
    Bug(
        "window", "an unasked-for sliding window: decode attends only the last HF_WINDOW positions",
        _window_acts, _injector(_Window),
    ),
    Bug(
        "posoff", "decode position off by one (position_ids one behind)",
        lambda s, t, n, w: 1, _injector(_PositionOff),
    ),
    Bug(
        "freeze", "the last layer's key frozen after step 1: later decode steps store step 1's key",
        lambda s, t, n, w: 2, _injector(_Freeze),
    ),
    Bug(
        "f16", "the cache round-tripped through float16 (every stored key and value)",
        # the resumed chunk reads the first chunk's rounded keys
        lambda s, t, n, w: 0 if s == "resume" else 1, _injector(_Float16), logic=False,
    ),
    Bug(
        "restart", "a resume restarts positions at the first chunk's length (decode position = prefill length + "
        "tokens decoded, so extend() is not counted)",
        lambda s, t, n, w: 1 if s == "resume" else None, _injector(_Restart),
    ),
    Bug(
        "replay", "a token appended twice: extend() first re-appends the last token already in the cache",
        lambda s, t, n, w: 0 if s == "resume" else None, _injector(_Replay),
    ),
)  # fmt: skip
#: Bugs of the cache's logic (positions, eviction, growth, resume offsets); ``f16`` is a precision bug.
HF_LOGIC_BUGS = tuple(name for name, bug in HF_BUGS.items() if bug.logic)


def first_acting_step(bug: str, scenario: str, prompt_len: int) -> int | None:
    """The first step at which ``bug`` changes the cache path's logits in ``scenario`` (``None``: never)."""
    return first_acting_in(HF_BUGS, bug, scenario, prompt_len)


def inject_hf_bug(adapter: HFModel, bug: str | None) -> HFModel:
    """``adapter`` with cache bug ``bug`` of :data:`HF_BUGS` (``None``: clean, unchanged), in place and returned."""
    return inject_from(HF_BUGS, adapter, bug)
