"""The options of one cache check, validated once: :class:`CheckOptions`.

``check_cache``'s keyword arguments, the ``kv_check`` fixture's, ``kvfast check``'s flags and the
check study's config all become one :class:`CheckOptions`; the checker reads nothing else. What
needs the model or the prompt (the split against the prompt's length, a token against the
vocabulary, ``promote`` against the model's methods) is checked when a check starts
(:func:`kvfast.check.subject.resolve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfast.check.control import DEFAULT_DECISIVE, DEFAULT_MARGIN, check_margin
from kvfast.check.protocol import check_prompt, check_timeout
from kvfast.check.scenarios import all_scenarios, default_scenarios
from kvfast.validation import not_allowed, require_choice, require_int

MODES = ("exact", "control")
SCENARIOS = default_scenarios()  # the default scenarios (decode, resume)
#: Every registered scenario (:data:`kvfast.check.scenarios.REGISTRY`); those not in :data:`SCENARIOS`, the cache
#: operations, are asked for by name.
ALL_SCENARIOS = all_scenarios()
FOLLOW = ("recompute", "cache")
PROMOTE = ("float64",)
DEFAULT_STEPS = 64  # the kv_check fixture's and `kvfast check`'s steps when neither steps nor a continuation is given


@dataclass(frozen=True)
class CheckOptions:
    """How to check a model's cache; every field validated on construction (``ValueError`` naming it).

    - ``steps``: decode steps to check (>= 1); the model sees ``len(prompt) + steps``
      positions. Optional with ``continuation`` (then its length); after
      construction always an ``int``.
    - ``mode``: ``"exact"`` (``==`` at every step) or ``"control"`` (rounding,
      inconclusive or bug against the model's order noise; ``margin`` and
      ``decisive`` as documented in :mod:`kvfast.check.control`).
    - ``scenarios``: ``"decode"`` (prefill the prompt, then decode) and/or
      ``"resume"`` (prefill ``prompt[:split]``, then ``extend`` with the rest,
      or feed the rest through ``decode`` if the model has no ``extend``; then
      decode); a name or a sequence, kept as a tuple. ``split`` defaults to
      ``len(prompt) // 2``; a one-token prompt cannot be split: the resume
      scenario is then reported as skipped beside ``decode``, and asking for it
      alone is bad input. Also, by name only (the cache operations, see
      :mod:`kvfast.check.scenarios`): ``"rollback"`` (drafts cropped away
      again, the model's ``crop``) and ``"fork"`` (branches from snapshots,
      ``snapshot``/``restore``) and ``"reorder"`` (two beams, the cache reordered
      by a beam index: ``prefill_beams``/``decode_beams``/``reorder``) and
      ``"padded"`` (a left-padded batch of two prompts: ``prefill_padded``/
      ``decode_padded``); skipped with a note on a model without the hooks.
    - ``continuation``: the tokens to feed ``decode`` (at least ``steps``)
      instead of greedy ones (random-weight models repeat one token greedily);
      kept as a tuple of its first ``steps`` token ids.
    - ``promote``: ``"float64"`` adds the logic check: the same check in control
      mode on the model promoted to float64 (its ``promote`` method; built in for
      Hugging Face models), on the same tokens, reported in ``report.promoted``.
    - ``fast``: use one recompute of the final sequence as the reference
      (exact mode: after verifying append-invariance; control mode: also when
      the recompute is not append-invariant, with the batch-shape noise from a
      few prefix recomputes). ``False``: one recompute per step.
    - ``follow``: whose greedy tokens are fed to ``decode``: ``"recompute"``
      (the default: the recompute path's, one sequence for every scenario) or
      ``"cache"`` (each scenario's own cache path's, compared with the
      recompute of that same sequence; exact mode only). See :mod:`kvfast.check.checker`.
    - ``keep_logits``: keep each scenario's cache logits and reference rows in
      its report (``cache_logits``, ``reference``).
    - ``timeout``: seconds the whole check may take (``None``: no limit); a
      model call still running then ends with :class:`~kvfast.check.CheckTimeout`
      naming it (a ``SIGALRM`` timer: main thread only; see
      :func:`kvfast.check.protocol.watched`).
    - ``strict``: any requested scenario that was skipped fails the check (verdict ``unchecked``); by default a
      check passes on the scenarios that ran and names the skipped ones in its first lines.
    """

    steps: int | None = None
    mode: str = "exact"
    scenarios: Sequence[str] | str = SCENARIOS
    fast: bool = True
    split: int | None = None
    margin: float = DEFAULT_MARGIN
    decisive: float = DEFAULT_DECISIVE
    continuation: Sequence[int] | None = None
    promote: str | None = None
    follow: str = "recompute"
    keep_logits: bool = False
    timeout: float | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        given, steps = _check_continuation(self.continuation, self.steps)
        mode = require_choice(self.mode, "mode", MODES)
        scenarios = _check_scenarios(self.scenarios)
        for name in ("fast", "keep_logits", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise not_allowed(name, getattr(self, name), "True or False")
        if self.follow not in FOLLOW:
            raise not_allowed("follow", self.follow, ", ".join(FOLLOW))
        if self.follow == "cache" and mode != "exact":
            raise ValueError(f"follow: 'cache' is not allowed with mode={mode!r}; allowed: mode='exact'")
        if self.follow == "cache" and given is not None:
            raise ValueError("follow: 'cache' is not allowed with a continuation; allowed: follow='recompute'")
        if self.promote is not None:
            require_choice(self.promote, "promote", PROMOTE)
        margin = check_margin(self.margin)
        decisive = check_margin(self.decisive, "decisive", margin)
        timeout = check_timeout(self.timeout)
        normalized = {
            "steps": steps, "mode": mode, "scenarios": scenarios, "margin": margin, "decisive": decisive,
            "continuation": None if given is None else tuple(given.tolist()), "timeout": timeout,
        }  # fmt: skip
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    @classmethod
    def defaulting_steps(cls, steps: int | None = None, **fields) -> CheckOptions:
        """``CheckOptions(steps, **fields)``, with :data:`DEFAULT_STEPS` (64) when neither ``steps`` nor a
        ``continuation`` is given: the ``kv_check`` fixture's and ``kvfast check``'s default."""
        if steps is None and fields.get("continuation") is None:
            steps = DEFAULT_STEPS
        return cls(steps, **fields)

    def given_tokens(self) -> np.ndarray | None:
        """The continuation as an ``int64`` array of ``steps`` tokens (``None``: greedy tokens)."""
        return None if self.continuation is None else np.asarray(self.continuation, dtype=np.int64)


def _check_continuation(continuation: object, steps: object) -> tuple[np.ndarray | None, int]:
    """``(tokens or None, steps)``: the continuation's first ``steps`` tokens, and ``steps`` (default: its length)."""
    if continuation is None:
        if steps is None:
            raise not_allowed("steps", None, "an integer >= 1 (or give a continuation)")
        return None, require_int(steps, "steps", 1)
    try:
        tokens = check_prompt(continuation)
    except ValueError as exc:
        raise ValueError(str(exc).replace("prompt:", "continuation:", 1)) from None
    if steps is None:
        return tokens, int(tokens.shape[0])
    steps = require_int(steps, "steps", 1, int(tokens.shape[0]))
    return tokens[:steps], steps


def _check_scenarios(scenarios: object) -> tuple[str, ...]:
    """``scenarios`` as a tuple of distinct registered names (:func:`kvfast.check.scenarios.all_scenarios`; one
    name alone is accepted)."""
    known = all_scenarios()  # read now: a scenario registered after import is a scenario like the others
    if isinstance(scenarios, str):
        scenarios = (scenarios,)
    if not isinstance(scenarios, Sequence) or not scenarios:
        raise not_allowed("scenarios", scenarios, f"a non-empty subset of {known}")
    out = []
    for s in scenarios:
        require_choice(s, "scenarios", known)
        if s in out:
            raise ValueError(f"scenarios: {s!r} appears twice; allowed: each scenario once")
        out.append(s)
    return tuple(out)
