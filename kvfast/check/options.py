"""The options of one cache check, validated once: :class:`CheckOptions`.

``check_cache``'s keyword arguments, the ``kv_check`` fixture's, ``kvfast check``'s flags and the
check study's config all become one :class:`CheckOptions`; the checker reads nothing else. What
needs the model or the prompt (the split against the prompt's length, a token against the
vocabulary, ``promote`` against the model's methods) is checked when a check starts
(:func:`kvfast.check.subject.resolve`).

Each field is one place: its default, its validation (``__post_init__``) and its flag on the
command line (:class:`Flag`, the field's ``metadata["flag"]``: the flag's name, its help and how
its text is read; :func:`flags` lists them, ``kvfast check`` builds its parser from them). A field
without a flag is Python only: ``keep_logits`` (the logits stay in the report object, never printed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from kvfast.check.control import DEFAULT_DECISIVE, DEFAULT_MARGIN, check_margin
from kvfast.check.protocol import check_prompt, check_timeout
from kvfast.check.scenarios import REGISTRY
from kvfast.validation import not_allowed, require_choice, require_int

#: ``auto`` (the default): ``exact`` when every compared row is bit-equal, else judged as ``control`` judges, the
#: order noise measured only then; ``exact``: ``==`` at every step; ``control``: always against the order noise.
MODES = ("auto", "exact", "control")
SCENARIOS = tuple(name for name, s in REGISTRY.items() if s.default)  # the default scenarios (decode, resume)
#: Every registered scenario (:data:`kvfast.check.scenarios.REGISTRY`); those not in :data:`SCENARIOS`, the cache
#: operations, are asked for by name.
ALL_SCENARIOS = tuple(REGISTRY)
FOLLOW = ("recompute", "cache")
PROMOTE = ("float64",)
DEFAULT_STEPS = 64  # the kv_check fixture's and `kvfast check`'s steps when neither steps nor a continuation is given


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"1,2,3"`` -> ``(1, 2, 3)``; ``ValueError`` naming the bad item (the text of a token-list flag)."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"{text!r} is not allowed; allowed: comma-separated token ids such as 1,2,3")
    out = []
    for t in items:
        try:
            out.append(int(t))
        except ValueError:
            raise ValueError(f"{t!r} is not an integer; allowed: comma-separated token ids") from None
    return tuple(out)


@dataclass(frozen=True)
class Flag:
    """A :class:`CheckOptions` field's flag on the command line.

    ``name`` (``--steps``) and ``help``; the value is read from the flag's text by ``parse`` (text ->
    value, ``ValueError`` for bad text) or is one of ``choices``. ``bare``: the field's value for the
    flag given without a value (``--per-step``: ``fast=False``; ``--promote``: ``"float64"``, and
    ``--promote float64`` too since it has ``choices``); ``None``: the flag takes a value. The value is
    then validated by :class:`CheckOptions`, as in Python."""

    name: str
    help: str
    parse: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    bare: object = None


def option(default: object, *flag: object, **keywords: object):
    """A :class:`CheckOptions` field: its default and its :class:`Flag`'s arguments (none: Python only)."""
    return field(default=default, metadata={"flag": Flag(*flag, **keywords)} if flag else {})


def ratio_help(what: str, default: float) -> str:
    """The help of a ratio to the order noise's flag (``--margin``, ``--decisive``): one form for both."""
    return f"{what} X times the order noise (auto, control; default {default:g})"


@dataclass(frozen=True)
class CheckOptions:
    """How to check a model's cache; every field validated on construction (``ValueError`` naming it).

    - ``steps``: decode steps to check (>= 1); the model sees ``len(prompt) + steps``
      positions. Optional with ``continuation`` (then its length); after
      construction always an ``int``.
    - ``mode``: ``"auto"`` (the default: ``exact`` when every compared row is
      bit-equal to the recompute, else judged as ``"control"`` judges, the order
      noise measured only then), ``"exact"`` (``==`` at every step: for a cache
      that promises one summation order) or ``"control"`` (rounding,
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
    - ``promote``: ``"float64"`` adds the logic check: the same check (``auto``
      unless the mode is ``control``) on the model promoted to float64 (its ``promote`` method; built in for
      Hugging Face models), on the same tokens, reported in ``report.promoted``.
    - ``fast``: use one recompute of the final sequence as the reference
      (exact mode: after verifying append-invariance; control mode: also when
      the recompute is not append-invariant, with the batch-shape noise from a
      few prefix recomputes). ``False``: one recompute per step.
    - ``follow``: whose greedy tokens are fed to ``decode``: ``"recompute"``
      (the default: the recompute path's, one sequence for every scenario) or
      ``"cache"`` (each scenario's own cache path's, compared with the
      recompute of that same sequence; judged exactly: mode ``exact``, or ``auto``,
      which then judges as ``exact`` does). See :mod:`kvfast.check.checker`.
    - ``keep_logits``: keep each scenario's cache logits and reference rows in
      its report (``cache_logits``, ``reference``).
    - ``timeout``: seconds the whole check may take (``None``: no limit; at most 1e9); a
      model call still running then ends with :class:`~kvfast.check.CheckTimeout`
      naming it (a ``SIGALRM`` timer: main thread only; see
      :func:`kvfast.check.protocol.watched`). On the command line ``--timeout``
      watches the user's code in the check's child process: the import of its
      module and the factory too.
    - ``strict``: any requested scenario that was skipped fails the check.
    """

    steps: int | None = option(
        None, "--steps", "decode steps to check (default 64, or the continuation's length)", int, metavar="N"
    )
    mode: str = option(
        "auto",
        "--mode",
        "auto (the default: exact where every step equals the recompute bit for bit, else rounding, "
        "inconclusive or bug against the model's order noise), exact (== at every step) or control (always "
        "against the order noise)",
        choices=MODES,
    )
    scenarios: Sequence[str] | str = option(
        SCENARIOS,
        "--scenarios",
        f"comma-separated: {', '.join(SCENARIOS)} (the default: both), "
        f"{', '.join(s for s in ALL_SCENARIOS if s not in SCENARIOS)} (cache operations)",
        lambda text: tuple(name.strip() for name in text.split(",")),  # (the names: validated as in Python)
        metavar="A,B",
    )
    fast: bool = option(True, "--per-step", "one recompute per step instead of the fast path", bare=False)
    split: int | None = option(
        None, "--split", "the resume scenario's split (default half the prompt)", int, metavar="N"
    )
    margin: float = option(DEFAULT_MARGIN, "--margin", ratio_help("rounding up to", DEFAULT_MARGIN), float, metavar="X")
    decisive: float = option(
        DEFAULT_DECISIVE, "--decisive", ratio_help("bug beyond", DEFAULT_DECISIVE), float, metavar="X"
    )
    continuation: Sequence[int] | None = option(
        None,
        "--continuation",
        "comma-separated token ids to feed instead of greedy ones",
        parse_tokens,
        metavar="T1,T2,...",
    )
    promote: str | None = option(
        None,
        "--promote",
        f"add the logic check: the same model in {PROMOTE[0]}, on the same tokens; --promote alone is "
        f"--promote {PROMOTE[0]}",
        choices=PROMOTE,
        bare=PROMOTE[0],
    )
    follow: str = option(
        "recompute",
        "--follow",
        "whose greedy tokens are fed: the recompute's (the default) or each scenario's own cache path's (exact mode)",
        choices=FOLLOW,
    )
    keep_logits: bool = option(False)
    timeout: float | None = option(
        None,
        "--timeout",
        "give up after S seconds of the user's code: importing its module, the factory and the check "
        "(kvfast's own start-up is not counted)",
        float,
        metavar="S",
    )
    strict: bool = option(False, "--strict", "any requested scenario that was skipped fails the check", bare=True)

    def __post_init__(self) -> None:
        given, steps = _check_continuation(self.continuation, self.steps)
        mode = require_choice(self.mode, "mode", MODES)
        scenarios = _check_scenarios(self.scenarios)
        for name in ("fast", "keep_logits", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise not_allowed(name, getattr(self, name), "True or False")
        if self.follow not in FOLLOW:
            raise not_allowed("follow", self.follow, ", ".join(FOLLOW))
        if self.follow == "cache" and mode == "control":
            raise ValueError("follow: 'cache' is not allowed with mode='control'; allowed: mode='exact' or 'auto'")
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
    def defaulting_steps(cls, steps: int | None = None, **given) -> CheckOptions:
        """``CheckOptions(steps, **given)``, with :data:`DEFAULT_STEPS` (64) when neither ``steps`` nor a
        ``continuation`` is given: the ``kv_check`` fixture's and ``kvfast check``'s default. A name that is
        no field is a ``ValueError`` listing the fields (never a ``TypeError`` from the constructor)."""
        names = [f.name for f in fields(cls)]
        for name in given:
            if name not in names:
                raise ValueError(f"options: {name!r} is not allowed; allowed: {', '.join(names)}")
        if steps is None and given.get("continuation") is None:
            steps = DEFAULT_STEPS
        return cls(steps, **given)

    def logic_check(self, mode: str, tokens: np.ndarray, split: int) -> CheckOptions:
        """The options of this check's logic check (``promote``): the same scenarios, path and ratios in ``mode``, on
        ``tokens`` (the check's) with the resume scenario's ``split`` (the check's, resolved); nothing else is
        carried (no logic check of its own, no timeout of its own: the check's watches it)."""
        return CheckOptions(
            self.steps, mode, self.scenarios, fast=self.fast, split=split, margin=self.margin, decisive=self.decisive,
            continuation=tuple(tokens.tolist()),
        )  # fmt: skip

    def given_tokens(self) -> np.ndarray | None:
        """The continuation as an ``int64`` array of ``steps`` tokens (``None``: greedy tokens)."""
        return None if self.continuation is None else np.asarray(self.continuation, dtype=np.int64)


def flags() -> dict[str, Flag]:
    """``{field name: its Flag}`` for every :class:`CheckOptions` field with one (every field but the Python-only
    ``keep_logits``), in the fields' order."""
    return {f.name: f.metadata["flag"] for f in fields(CheckOptions) if "flag" in f.metadata}


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
    n = int(tokens.shape[0])
    steps = n if steps is None else require_int(steps, "steps", 1, n)
    return tokens[:steps], steps


def _check_scenarios(scenarios: object) -> tuple[str, ...]:
    """``scenarios`` as a tuple of distinct registered names (:data:`kvfast.check.scenarios.REGISTRY`; one
    name alone is accepted)."""
    known = tuple(REGISTRY)  # read now: a scenario registered after import is a scenario like the others
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
