"""What every scenario is: :class:`Scenario` (one unit: what it needs of the model, how its cache path runs,
what it reports), the run it hands back (:class:`Run`, :class:`CachePath`) and the pieces units share.

A scenario declares the optional hooks it needs (:attr:`Scenario.hooks`), says before any model call
whether it can run on this model and prompt (:meth:`Scenario.skip_reason`), and runs its cache path fed
by ``choose`` (:meth:`Scenario.run`); a hook that raises ``NotImplementedError`` while it runs raises
:class:`Unsupported`, whose text is the skip note. The pipeline (:mod:`kvfast.check.checker`) judges
what it ran; a unit knows nothing of modes, references or verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvfast.check.protocol import ModelCalls, ModelUnderTestError

#: ``choose(t, logits) -> token``: the token fed at decode step ``t + 1`` from the cache's logits of step ``t``
#: (step 0: the prompt's last row).
Choose = Callable[[int, np.ndarray], int]


class Unsupported(Exception):  # noqa: N818 - a hook the model declines, not an error of the check
    """A model's operation hook raised ``NotImplementedError``: its scenario is skipped, ``str(self)`` the note."""


class CachePath(NamedTuple):
    """One run of a cache path: ``prompt_rows`` ``(T, V)`` (the prompt's logits, as the scenario filled
    the cache), ``decoded`` ``(steps, V)`` (decode step ``t``'s logits in row ``t - 1``) and ``fed``
    ``(steps,)`` (the token fed at each decode step)."""

    prompt_rows: np.ndarray
    decoded: np.ndarray
    fed: np.ndarray

    def logits(self) -> np.ndarray:
        """Every logits row of the run, ``(T + steps, V)``."""
        return np.concatenate([self.prompt_rows, self.decoded])


@dataclass(frozen=True)
class Run:
    """What a scenario's run hands back: ``path`` (the judged cache path), ``notes`` (what the run did) and
    ``branch`` (a second path judged on its own: the fork's other branch, the other beam, the padded batch's
    other row; else ``None``). Has :class:`CachePath`'s fields, those of ``path``."""

    path: CachePath
    notes: tuple[str, ...] = ()
    branch: CachePath | None = None

    def __getattr__(self, name: str) -> np.ndarray:  # (only names the instance lacks: never path, notes, branch)
        if name in CachePath._fields:  # prompt_rows, decoded, fed: the judged path's
            return getattr(self.path, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class Scenario:
    """One scenario. A unit sets :attr:`name`, :attr:`hooks`, :attr:`default` (run when no scenarios are
    named) and :attr:`branch` (the report name of its second path, if it has one) and implements :meth:`run`;
    it may override :meth:`prompt_reason`, :meth:`skip_reason`, :meth:`judged_notes`, :meth:`first_row`,
    :meth:`branch_prompt` and :meth:`branch_note`. Register it in :data:`kvfast.check.scenarios.REGISTRY`."""

    name: str = ""
    hooks: tuple[str, ...] = ()
    default: bool = False
    branch: str | None = None

    def prompt_reason(self, prompt: np.ndarray) -> str | None:
        """Why this scenario cannot run on ``prompt`` whatever the model (``None``: it can)."""
        return None

    def skip_reason(self, calls: ModelCalls, prompt: np.ndarray) -> str | None:
        """Why this scenario cannot run on ``calls``' model and ``prompt`` (``None``: it can); asked before it runs."""
        missing = [h for h in self.hooks if not calls.has(h)]
        if missing:
            return f"the model has no {' and '.join(f'{h}()' for h in missing)}"
        return self.prompt_reason(prompt)

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        """Fill the cache for ``prompt`` this scenario's way, then decode ``steps`` tokens chosen by ``choose``."""
        raise NotImplementedError

    def first_row(self, split: int) -> int:
        """The first prompt row step 0 judges (``split``: the resume scenario's split)."""
        return 0

    def judged_notes(self, calls: ModelCalls, prompt: np.ndarray, split: int) -> tuple[str, ...]:
        """Notes on what this scenario's step 0 judges (before the run's own notes)."""
        return ()

    def branch_prompt(self, prompt: np.ndarray, vocab: int) -> np.ndarray:
        """The prompt of the second path (:attr:`branch`)."""
        return prompt

    def branch_note(self, run: Run) -> str:
        """What the second path is, for its report."""
        return ""


def hook(calls: ModelCalls, name: str, *args):
    """``model.<name>(*args)``; a missing hook or a ``NotImplementedError`` from it becomes :class:`Unsupported`."""
    if not calls.has(name):
        raise Unsupported(f"the model has no {name}()")
    try:
        return getattr(calls.model, name)(*args)
    except ModelUnderTestError as exc:
        if isinstance(exc.error, NotImplementedError):
            raise Unsupported(f"{exc.where} is not supported by this model: {exc.error}") from exc
        raise


def mark_greedy(choose: Choose) -> Choose:
    """``choose`` (a function) marked greedy: from decode step 2 on it feeds the argmax (first maximum) of the step
    before's logits, so :func:`decode_steps` may ask a model with ``decode_greedy`` for every step in one call."""
    choose.greedy = True
    return choose


def decode_steps(
    calls: ModelCalls, first: np.ndarray, steps: int, choose: Choose, before: dict[int, Callable] | None = None
) -> CachePath:
    """``steps`` decode steps on a cache that holds the prompt (``first``: the prompt's rows as it was filled).

    ``before``: ``{step t: operation(t, token)}``, what a scenario does to the cache before decode step ``t``
    (fed ``token``): the rollback's drafts and crop, the fork's second branch. Without it, a ``choose``
    marked greedy (:func:`mark_greedy`) and a model that has ``decode_greedy`` (:mod:`kvfast.check.protocol`),
    one call decodes every step: the token of step 1 is ``choose``'s, those of later steps the argmax of the
    rows returned (what ``choose`` would have fed); the rows are what ``decode`` step by step returns, compared
    the same way. A model that declines is decoded step by step."""
    T = first.shape[0]
    if before is None and getattr(choose, "greedy", False) is True and calls.has("decode_greedy"):
        tok = int(choose(0, first[-1]))
        decoded = calls.decode_greedy(tok, steps, f"of steps 1-{steps} (positions {T}-{T + steps - 1})")
        if decoded is not None:
            fed = np.empty(steps, dtype=np.int64)
            fed[0] = tok
            fed[1:] = decoded[:-1].argmax(axis=1)
            return CachePath(first, decoded, fed)
    decoded = np.empty((steps, calls.vocab))
    fed = np.empty(steps, dtype=np.int64)
    last = first[-1]
    for t in range(1, steps + 1):
        tok = int(choose(t - 1, last))
        fed[t - 1] = tok
        if before is not None and t in before:
            before[t](t, tok)
        last = calls.decode(tok, f"at step {t} (position {T + t - 1})")
        decoded[t - 1] = last
    return CachePath(first, decoded, fed)


def decode_pair(
    calls: ModelCalls, first: list[np.ndarray], steps: int, choose: Choose, decode_rows: Callable, note: str
) -> Run:
    """Two rows of a batch decoded together (beams, a padded batch): row 0 (the judged path, ``first[0]`` its
    prompt's rows) fed ``choose``'s tokens, row 1 (the second path) other ones (:func:`draft_tokens`);
    ``decode_rows(t, tokens)`` decodes step ``t`` and returns its logits ``(2, V)``, row by row."""
    rows = np.empty((2, steps, calls.vocab))
    fed = np.empty((2, steps), dtype=np.int64)
    last = first[0][-1]
    for t in range(1, steps + 1):
        fed[0, t - 1] = int(choose(t - 1, last))
        fed[1, t - 1] = int(draft_tokens(int(fed[0, t - 1]), 1, calls.vocab)[0])
        rows[:, t - 1] = decode_rows(t, fed[:, t - 1].copy())
        last = rows[0, t - 1]
    return Run(CachePath(first[0], rows[0], fed[0]), (note,), CachePath(first[1], rows[1], fed[1]))


def draft_tokens(next_token: int, k: int, vocab: int) -> np.ndarray:
    """``k`` tokens that are not the kept text: from ``next_token + 1`` on, modulo ``vocab`` (the rollback's drafts,
    the fork's second branch, the second beam and the padded batch's other row)."""
    return (next_token + 1 + np.arange(k, dtype=np.int64) * 7) % vocab


def shown(points: list[int]) -> str:
    """The first steps of ``points`` for a note (``1, 5, 9, ...``)."""
    return ", ".join(map(str, points[:6])) + (", ..." if len(points) > 6 else "")
