"""The cache operations' injected bugs (:data:`OP_BUGS`): test tooling, not the checker (it moves to the bug
catalogues). The scenarios themselves live in :mod:`kvfast.check.scenarios`."""

from __future__ import annotations

import numpy as np

from kvfast.check.scenarios import BRANCH, branches, padded_prompt

BRANCHES = {op: b for b, op in branches().items()}

#: The sliding-window operation bug's name (:data:`OP_BUGS`).
WINDOW_BUG = "window_evicts_one_too_many"

#: Bugs of the cache operations, injected into the cache path only (``inject_op_bug``; kvfast's own model and
#: :class:`~kvfast.check.hf.HFModel`): the recompute always stays clean; every bug but the window bug acts in
#: the operation hooks only (prefill and decode stay clean), the window bug in every cached call.
OP_BUGS: dict[str, str] = {
    "crop_short": "a rollback that crops one token too few: crop(n) keeps n + 1 positions",
    "fork_shared_keys": "a fork that shares the key tensor: snapshot() and restore() copy the values, not the keys",
    "reorder_wrong_index": "a beam reorder by the wrong index: the cache keeps its old order (HFModel only)",
    "reorder_keys_only": "a beam reorder of the keys only: the values stay in the old order (HFModel only)",
    "padded_positions_from_start": "a left-padded batch whose positions count from the padded start (HFModel "
    "only; invisible to rotary positions in exact arithmetic, a shift of every position of a row)",
    "static_never_cleared": "a static cache never cleared between prompts: every prefill reuses the first "
    "cache object as it was left (HFModel with new_cache only)",
    WINDOW_BUG: "a window that evicts one too many: the cached path attends the last window - 1 positions, the "
    "recompute the last window (HFModel of a sliding-window model only)",
}


def inject_op_bug(model, bug: str | None):
    """``model`` (a :class:`~kvfast.check.KvfastModel` or :class:`~kvfast.check.hf.HFModel`) with operation bug
    ``bug`` from :data:`OP_BUGS` (``None``: clean), set in place and returned."""
    from kvfast.validation import require_choice

    if bug is not None:
        require_choice(bug, "bug", OP_BUGS)
    if not hasattr(type(model), "op_bug"):
        raise ValueError(f"model: {type(model).__name__} takes no operation bug; allowed: KvfastModel or HFModel")
    if bug == "static_never_cleared":
        if getattr(model, "new_cache", None) is None:
            raise ValueError(f"bug: {bug!r} is not allowed here; allowed: an HFModel with new_cache (a StaticCache)")
        made = []
        fresh = model.new_cache
        model.new_cache = lambda: made[0] if made else made.append(fresh()) or made[0]
    if bug == WINDOW_BUG and sliding_window(model) is None:
        raise ValueError(f"bug: {bug!r} is not allowed here; allowed: an HFModel of a model with a sliding window")
    model.op_bug = bug
    return model


def sliding_window(model) -> int | None:
    """The sliding window of ``model`` (an :class:`~kvfast.check.hf.HFModel`'s model config's
    ``sliding_window``), ``None`` where it has none."""
    config = getattr(getattr(model, "model", None), "config", None)
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 1 else None


def op_first_acting_step(
    bug: str, scenario: str, steps: int, prompt_len: int | None = None, window: int | None = None
) -> int | None:
    """The first step at which operation bug ``bug`` changes ``scenario``'s logits (``None``: never). For
    ``fork_shared_keys`` this holds where the cache writes its key buffer in place (kvfast's own cache, a
    Hugging Face ``StaticCache``); a ``DynamicCache`` concatenates new tensors, and sharing one is harmless.

    :data:`WINDOW_BUG` needs ``prompt_len`` and the model's ``window``: it first acts on the first row the
    cached path computes at position ``window - 1`` or later, where the cache holds more than
    ``window - 1`` positions of the sequence: step ``window - L`` (``L``: the prompt's length; the other
    prompt's, :func:`padded_prompt`, for ``padded-row``: its pads are masked, and the buggy window first
    drops a real token there), or step 0 where the prefill reaches it."""
    if bug == WINDOW_BUG:
        from kvfast.validation import require_int

        T = require_int(prompt_len, "prompt_len", 1)
        W = require_int(window, "window", 2)
        own = padded_prompt(np.zeros(T, dtype=np.int64), 2).shape[0] if scenario == BRANCHES["padded"] else T
        first = max(0, W - own)
        last = max(1, steps // 2) if scenario == BRANCH else steps
        return first if first <= last else None
    if bug == "crop_short":
        return 1 if scenario == "rollback" else None
    if bug == "fork_shared_keys":
        return steps // 2 + 1 if scenario == "fork" and steps // 2 >= 1 else None
    if bug in ("reorder_wrong_index", "reorder_keys_only"):
        return 2 if scenario in ("reorder", BRANCHES["reorder"]) and steps >= 2 else None
    if bug == "padded_positions_from_start":  # absolute positions only (GPT-2): the padded (shorter) row
        return 0 if scenario == BRANCHES["padded"] else None
    if bug == "static_never_cleared":  # every prefill after the first: step 0 of each later scenario's run
        return 0
    raise ValueError(f"bug: {bug!r} is not allowed; allowed: {', '.join(OP_BUGS)}")
