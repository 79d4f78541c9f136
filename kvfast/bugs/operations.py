"""Bugs of the cache operations (the rollback, fork, reorder and padded scenarios of
:mod:`kvfast.check.scenarios`), injected into the cache path only (:func:`inject_op_bug`; kvfast's own model
and :class:`~kvfast.check.hf.HFModel`): the recompute always stays clean; every bug but the window bug acts in
the operation hooks only (prefill and decode stay clean), the window bug in every cached call.

Each is a mixin over the adapters' hooks (:mod:`kvfast.bugs.hf_mixins`, the source a reproducer carries):
``_crop_keep`` (both adapters), ``_copy_keys`` (kvfast's) and ``_copy_cache`` (Hugging Face's), ``_reorder_cache``,
``_padded_positions`` and ``_cached_forward`` (Hugging Face's). :func:`op_first_acting_step` says where each first acts.
"""

from __future__ import annotations

import functools

import numpy as np

from kvfast.bugs import hf_mixins as mix
from kvfast.bugs.bug import Bug, Catalogue, subclass_with
from kvfast.check.adapters import KvfastModel
from kvfast.check.hf import HFModel
from kvfast.check.scenarios import BRANCH, branches, padded_prompt
from kvfast.validation import require_int

_BRANCH_OF = {op: b for b, op in branches().items()}  # each operation's second branch's report name

#: The sliding-window operation bug's name (:data:`OP_BUGS`).
WINDOW_BUG = mix.WindowEvictsOneTooMany.bug


class _ForkSharedKeys(mix.ForkSharedKeys):
    def _copy_keys(self, k):  # kvfast's own cache: the snapshot keeps the live key buffer
        return k


def _adapter(model) -> object:
    if not isinstance(model, KvfastModel | HFModel):
        raise ValueError(f"model: {type(model).__name__} takes no operation bug; allowed: KvfastModel or HFModel")
    return model


def _injector(mixin: type):
    return lambda model: subclass_with(_adapter(model), mixin)


def _never_cleared(model):
    """Every prefill reuses the first cache object ``new_cache`` made, as it was left."""
    if getattr(_adapter(model), "new_cache", None) is None:
        raise ValueError(
            "bug: 'static_never_cleared' is not allowed here; allowed: an HFModel with new_cache (a StaticCache)"
        )
    model.new_cache = functools.cache(model.new_cache)  # the first cache object, every call after the first
    return model


def _window_bug(model):
    if sliding_window(_adapter(model)) is None:
        raise ValueError(
            f"bug: {WINDOW_BUG!r} is not allowed here; allowed: an HFModel of a model with a sliding window"
        )
    return subclass_with(model, mix.WindowEvictsOneTooMany)


def _window_acts(scenario, prompt_len, steps, window):
    """The first row the cached path computes at position ``window - 1`` or later, where the cache holds more
    than ``window - 1`` positions of the sequence: step ``window - L`` (``L``: the prompt's length; the other
    prompt's, :func:`~kvfast.check.scenarios.padded_prompt`, for ``padded-row``: its pads are masked, and the
    buggy window first drops a real token there), or step 0 where the prefill reaches it."""
    T = require_int(prompt_len, "prompt_len", 1)
    W = require_int(window, "window", 2)
    own = padded_prompt(np.zeros(T, dtype=np.int64), 2).shape[0] if scenario == _BRANCH_OF["padded"] else T
    first = max(0, W - own)
    last = max(1, steps // 2) if scenario == BRANCH else steps
    return first if first <= last else None


def _fork_acts(scenario, prompt_len, steps, window):
    """Where the cache writes its key buffer in place (kvfast's own cache, a Hugging Face ``StaticCache``); a
    ``DynamicCache`` concatenates new tensors, and sharing one is harmless."""
    return steps // 2 + 1 if scenario == "fork" and steps // 2 >= 1 else None


def _reorder_acts(scenario, prompt_len, steps, window):
    return 2 if scenario in ("reorder", _BRANCH_OF["reorder"]) and steps >= 2 else None


#: The operation bugs (the ``op_score`` study's cases).
OP_BUGS = Catalogue(
    Bug(
        "crop_short", "a rollback that crops one token too few: crop(n) keeps n + 1 positions",
        lambda s, t, n, w: 1 if s == "rollback" else None, _injector(mix.CropShort),
    ),
    Bug(
        "fork_shared_keys", "a fork that shares the key tensor: snapshot() and restore() copy the values, not the keys",
        _fork_acts, _injector(_ForkSharedKeys),
    ),
    Bug(
        "reorder_wrong_index", "a beam reorder by the wrong index: the cache keeps its old order (HFModel only)",
        _reorder_acts, _injector(mix.ReorderWrongIndex),
    ),
    Bug(
        "reorder_keys_only", "a beam reorder of the keys only: the values stay in the old order (HFModel only)",
        _reorder_acts, _injector(mix.ReorderKeysOnly),
    ),
    Bug(
        "padded_positions_from_start", "a left-padded batch whose positions count from the padded start (HFModel "
        "only; invisible to rotary positions in exact arithmetic, a shift of every position of a row)",
        # absolute positions only (GPT-2): the padded (shorter) row
        lambda s, t, n, w: 0 if s == _BRANCH_OF["padded"] else None, _injector(mix.PaddedPositionsFromStart),
    ),
    Bug(
        "static_never_cleared", "a static cache never cleared between prompts: every prefill reuses the first "
        "cache object as it was left (HFModel with new_cache only)",
        # every prefill after the first: step 0 of each later scenario's run
        lambda s, t, n, w: 0, _never_cleared,
    ),
    Bug(
        WINDOW_BUG, "a window that evicts one too many: the cached path attends the last window - 1 positions, the "
        "recompute the last window (HFModel of a sliding-window model only)",
        _window_acts, _window_bug,
    ),
)  # fmt: skip


def inject_op_bug(model, bug: str | None):
    """``model`` (a :class:`~kvfast.check.KvfastModel` or :class:`~kvfast.check.hf.HFModel`) with operation bug
    ``bug`` from :data:`OP_BUGS` (``None``: clean), in place and returned."""
    return OP_BUGS.inject(_adapter(model), bug)


def sliding_window(model) -> int | None:
    """The sliding window of ``model`` (an :class:`~kvfast.check.hf.HFModel`'s model config's
    ``sliding_window``), ``None`` where it has none."""
    config = getattr(getattr(model, "model", None), "config", None)
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 1 else None


def op_first_acting_step(
    bug: str, scenario: str, steps: int, prompt_len: int | None = None, window: int | None = None
) -> int | None:
    """The first step at which operation bug ``bug`` changes ``scenario``'s logits (``None``: never).
    :data:`WINDOW_BUG` needs ``prompt_len`` and the model's ``window``."""
    return OP_BUGS.first_acting_step(bug, scenario, prompt_len, steps, window)
