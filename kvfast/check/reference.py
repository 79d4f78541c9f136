"""The reference a cache path is compared with, and the order noise around it where the judge needs it.

Two kinds, one per ``follow`` mode, each telling the pipeline (:mod:`kvfast.check.checker`)
how to run a scenario's cache path and which recompute rows to compare it with:

- :class:`Reference`: what both kinds share and the scenario loop reads.
- :class:`SharedReference` (``follow="recompute"``): one sequence for every scenario, the
  recompute's greedy choices (or the given continuation). Fast path: one recompute of the final
  sequence after verifying append-invariance, falling back to one recompute per step from the first
  step where the cache's greedy token differs; a judge that measures noise (control and auto modes) keeps
  the fast path on a recompute that is not append-invariant and measures its batch-shape noise. Per-step
  path: one recompute per step. The order noise is measured when the judge asks for it
  (:meth:`SharedReference.order_noise`).
- :class:`OwnReference` (``follow="cache"``, exact mode): each scenario decodes its own greedy
  tokens and is compared with the recompute of its own sequence (fast path after the same
  verification, else one recompute per step).

The method is in :mod:`kvfast.check.checker`'s module doc; the noise's use in :mod:`kvfast.check.control`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvfast.check import control as C
from kvfast.check import formats as F
from kvfast.check.check_report import LengthDependence
from kvfast.check.protocol import ModelCalls
from kvfast.check.scenarios import REGISTRY, Run, Scenario, Unsupported
from kvfast.check.scenarios.base import mark_greedy
from kvfast.check.scenarios.decode import Decode
from kvfast.check.subject import CheckSubject

if TYPE_CHECKING:  # the judge is asked what noise it needs, never built here
    from kvfast.check.judge import Judge


def per_step_rows(
    calls: ModelCalls, prompt: np.ndarray, rows: np.ndarray, tokens: np.ndarray, start: int, greedy: bool = True
) -> None:
    """Fill ``rows[start:]`` by one recompute per position; with ``greedy``, also the tokens they choose
    (else ``tokens`` are given)."""
    T = prompt.shape[0]
    steps = tokens.shape[0]
    for p in range(start, T + steps):
        seq = np.concatenate([prompt, tokens[: p - T + 1]])
        rows[p] = calls.recompute(seq)[-1]
        if greedy and p - T + 1 < steps:
            tokens[p - T + 1] = int(np.argmax(rows[p]))


def recompute_whole(calls: ModelCalls, final: np.ndarray, T: int, steps: int) -> tuple[np.ndarray, dict]:  # noqa: N803
    """``recompute(final)`` and the prefix recompute :func:`invariance` checks (``{q: rows}``, ``q`` the prompt's
    ``T`` and a quarter of the ``steps``, odd: :func:`kvfast.check.control.prefix_length`; none where ``q`` reaches
    the end), in one call where the model has ``recompute_prefixes``."""
    n = final.shape[0]
    q = C.prefix_length(T + max(1, steps // 4))
    if q >= n:
        return calls.recompute(final, "of the whole sequence"), {}
    full, part = calls.recompute_prefixes(final, (n, q), ("of the whole sequence", f"of the first {q} tokens"))
    return full, {q: part}


def invariance(
    full: np.ndarray, ref0: np.ndarray, prefixes: dict[int, np.ndarray]
) -> tuple[str | None, dict[int, np.ndarray]]:
    """``(None, parts)`` if the recompute is append-invariant at the checked prefixes, else ``(why, parts)``:
    ``ref0`` (the prompt's recompute) and ``prefixes`` (:func:`recompute_whole`'s) against the same rows of
    ``full``, the whole sequence's; ``parts`` maps each prefix length checked to its recompute's rows. ``None``
    means every part equals (``==``) the same rows of ``full``: no length dependence there either
    (:func:`length_dependence` of such parts is ``None``, so the callers skip it)."""
    T = ref0.shape[0]
    parts = {T: ref0, **prefixes}
    why = None
    if not _equal(ref0, full[:T]):
        why = f"recompute(prompt) differs from the first {T} rows of recompute(whole sequence) by {_where(ref0, full)}"
    for q, part in prefixes.items():
        if why is None and not _equal(part, full[:q]):
            where = _where(part, full)
            why = f"recompute(first {q} tokens) differs from the same rows of recompute(whole sequence) by {where}"
    return why, parts


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """``numpy.array_equal(a, b)`` of two float64 arrays (NaN never equal), without its conversions."""
    return a.shape == b.shape and not np.count_nonzero(a != b)  # (a count: cheaper than a reduction)


def _where(part: np.ndarray, full: np.ndarray) -> str:
    """How far and where ``part`` (a shorter recompute's rows) differs from the same rows of ``full``: the largest
    difference, its row, and the rows that differ (``4.47e-07 at row 3285; 300 rows differ, from row 3200 to 3499``)."""
    dev = np.abs(part - full[: part.shape[0]]).max(axis=1)
    rows = np.nonzero(dev > 0)[0]
    return (
        f"{float(dev.max()):.4g} at row {int(np.argmax(dev))}; {rows.size} row{'s' if rows.size > 1 else ''} "
        f"differ{'' if rows.size > 1 else 's'}, from row {int(rows[0])} to {int(rows[-1])}"
    )


def length_dependence(
    parts: dict[int, np.ndarray], full: np.ndarray, fmt: str | F.NoiseFormats, per_step: int | None = None
) -> LengthDependence | None:
    """The worst row where a shorter recompute differs from the same row of ``full`` (the recompute of
    ``len(full)`` tokens) by more than rounding can explain, or ``None``: the admission ceiling of the
    model's :class:`~kvfast.check.formats.NoiseFormats` (:func:`kvfast.check.formats.ceiling`), or, given
    only the logits' format ``fmt``, :func:`kvfast.check.formats.length_ceiling`. ``parts`` maps a prefix
    length to its recompute's rows (the per-step path, ``per_step`` the prompt's length ``T``: a length to rows
    holding row ``p`` of ``recompute(first max(T, p + 1) tokens)``)."""
    scale = np.abs(full).max(axis=1)
    ceiling = F.length_ceiling(fmt, scale) if isinstance(fmt, str) else F.ceiling(fmt.ceiling, scale)
    worst: LengthDependence | None = None
    for q, part in parts.items():
        dev = np.abs(part - full[:q]).max(axis=1)
        p = int(np.argmax(dev / ceiling[:q]))
        if dev[p] > ceiling[p] and (worst is None or dev[p] / ceiling[p] > worst.ratio):
            short = q if per_step is None else max(per_step, p + 1)
            worst = LengthDependence(p, short, full.shape[0], float(dev[p]), float(ceiling[p]))
    return worst


def batch_shape_noise(
    calls: ModelCalls, final: np.ndarray, full: np.ndarray, parts: dict[int, np.ndarray], steps: int
) -> dict[str, np.ndarray]:
    """Batch-shape noise from a few prefix recomputes (those of the invariance check, and two more)
    against the same rows of the whole-sequence recompute ``full``; per position, 0 where not measured."""
    n = final.shape[0]
    T = min(parts)
    for q in map(C.prefix_length, (T + steps // 2, T + (3 * steps) // 4)):
        if T < q < n and q not in parts:
            parts[q] = calls.recompute(final[:q])
    noise = np.zeros(n)
    for q, part in parts.items():
        noise[:q] = np.maximum(noise[:q], np.abs(part - full[:q]).max(axis=1))
    return {f"batch shape ({len(parts)} prefix recomputes)": noise}


class Reference:
    """What the scenario loop reads of a reference, in either ``follow`` mode.

    ``subject``; ``judge``: the check's (:mod:`kvfast.check.judge`), asked whether it may need the model's order
    noise (:attr:`~kvfast.check.judge.Judge.measures_noise`); ``prompt_rows``: ``recompute(prompt)``; ``formats``:
    the model's formats (:func:`kvfast.check.formats.formats_of`); ``length`` (a
    :class:`~kvfast.check.check_report.LengthDependence` when the recompute changes with the length by more than
    rounding, else ``None``); ``notes`` (how the reference was found). A kind adds ``path``, ``noise``, ``tokens``
    and ``skipped_tokens``, and says how a scenario runs (:meth:`cache_run`) and what it is compared with
    (:meth:`rows_for`).
    """

    def __init__(self, subject: CheckSubject, judge: Judge, prompt_rows: np.ndarray, formats: F.NoiseFormats):
        self.subject = subject
        self.noisy = judge.measures_noise  # the judge may need the order noise
        self.prompt_rows = prompt_rows
        self.formats = formats
        self.length: LengthDependence | None = None
        self.notes: list[str] = []

    def choose(self, t: int, out: np.ndarray) -> int:
        """The token fed at decode step ``t + 1`` (``out``: the cache's logits of step ``t``)."""
        raise NotImplementedError

    def cache_run(self, scenario: Scenario) -> Run:
        """``scenario``'s run, fed this reference's tokens (:meth:`choose`); raises
        :class:`~kvfast.check.scenarios.Unsupported` when the model declines one of its hooks."""
        s = self.subject
        return scenario.run(s.calls, s.prompt, s.split, s.steps, self.choose)

    def rows_for(self, scenario: str, run: Run) -> np.ndarray:
        """The recompute rows ``run`` (``scenario``'s cache path) is compared with."""
        raise NotImplementedError

    def branch_rows(self, prompt: np.ndarray, branch) -> np.ndarray:
        """The reference rows of a scenario's second branch on ``prompt``: one recompute of its sequence, else
        (a judge that measures no noise, where this reference found the recompute not append-invariant or
        ``fast=False``) one recompute per step."""
        calls = self.subject.calls
        seq = np.concatenate([prompt, branch.fed])
        if self.noisy or self.path != "per-step":
            return calls.recompute(seq, "of the fork's second branch")
        T = prompt.shape[0]
        rows = np.empty((seq.shape[0], self.subject.vocab))
        rows[:T] = calls.recompute(prompt, "of the prompt")
        per_step_rows(calls, prompt, rows, branch.fed.copy(), T, greedy=False)
        return rows


class SharedReference(Reference):
    """``follow="recompute"``: the reference rows ``(T + steps, V)`` and the ``tokens`` every scenario is fed.

    ``path`` (``fast`` or ``per-step``), ``noise`` (control mode: the order noise per source and position,
    else ``None``). The arguments are :class:`Reference`'s; built as the module doc says, the order noise
    measured only when the judge asks for it (:meth:`order_noise`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        subject = self.subject
        T, steps = subject.T, subject.steps
        self.full: np.ndarray | None = None  # the per-step path's whole-sequence recompute, once measured
        self.rows = np.empty((T + steps, subject.vocab))
        self.tokens = np.empty(steps, dtype=np.int64)  # filled in place: a skipped scenario's report holds them
        self.skipped_tokens = self.tokens
        self.rows[:T] = self.prompt_rows
        if subject.given is not None:
            self.tokens[:] = subject.given
        else:
            self.tokens[0] = int(np.argmax(self.rows[T - 1]))
        self.path = "per-step"
        self.noise: dict[str, np.ndarray] | None = None
        self.known = T  # rows[:known] and the tokens they chose are final
        self.reuse: Run | None = None  # the fast path's cache run, when it was fed these tokens
        # the fast path runs the first scenario asked for (a resume-only check never prefills the whole prompt)
        # (an operation-only check's fast path runs, and its scenario reuses, the first operation's path)
        asked = subject.options.scenarios
        self.reuse_scenario = next((n for n in asked if REGISTRY[n].default), asked[0])
        self.batch_shape: dict[str, np.ndarray] | None = None
        if subject.options.fast:
            self._take_fast_path()
        if self.known < T + steps:
            per_step_rows(subject.calls, subject.prompt, self.rows, self.tokens, self.known, subject.given is None)
        if self.path == "per-step" and (self.noisy or not subject.options.fast):
            final = np.concatenate([subject.prompt, self.tokens])
            self.full = subject.calls.recompute(final, "of the whole sequence")
            if self.length is None:
                self.length = length_dependence({T + steps: self.rows}, self.full, self.formats, T)

    def choose(self, t: int, out: np.ndarray) -> int:
        """The shared token of step ``t + 1``."""
        return int(self.tokens[t])

    def cache_run(self, scenario: Scenario) -> Run:
        """``scenario``'s run, fed :attr:`tokens` (the fast path's run when it was this scenario's)."""
        if scenario.name == self.reuse_scenario and self.reuse is not None:
            return self.reuse
        return super().cache_run(scenario)

    def rows_for(self, scenario: str, run: Run) -> np.ndarray:
        """The rows every scenario's run is compared with."""
        return self.rows

    def _take_fast_path(self) -> None:
        """Decode with the cache's greedy choices, recompute the final sequence once and verify
        append-invariance; keep the rows (and tokens) it settles, notes on what it could not."""
        s = self.subject
        T, steps, given = s.T, s.steps, s.given
        first_tok = int(self.tokens[0])

        @mark_greedy
        def greedy(t: int, out: np.ndarray) -> int:
            return first_tok if t == 0 else int(out.argmax())

        choose = greedy if given is None else self.choose  # a continuation: its tokens, the shared ones

        own = True  # the run is the scenario's own (not the decode run standing in for a declined operation)
        try:
            spec = REGISTRY[self.reuse_scenario].run(s.calls, s.prompt, s.split, steps, choose)
        except Unsupported:  # the reference needs only tokens; the scenario itself reports the skip
            own = False
            spec = Decode().run(s.calls, s.prompt, s.split, steps, choose)
        final = np.concatenate([s.prompt, spec.fed])
        full, prefixes = recompute_whole(s.calls, final, T, steps)
        why, parts = invariance(full, self.rows[:T], prefixes)
        self.length = None if why is None else length_dependence(parts, full, self.formats)
        if why is not None and not self.noisy:
            self.notes.append(f"recompute is not append-invariant ({why}); used one recompute per step")
            return
        self.path = "fast"
        if why is not None:
            # control mode's fast path: the whole-sequence recompute is the reference; the rows it would
            # have had in a shorter batch are order noise, measured from a few prefix recomputes
            self.batch_shape = batch_shape_noise(s.calls, final, full, parts, steps)
            self.length = length_dependence(parts, full, self.formats)
            self.notes.append(
                f"recompute is not append-invariant ({why}); the reference is one recompute of the final "
                f"sequence and its batch-shape noise comes from {len(parts)} prefix recomputes"
            )
            self.rows[:] = full
            self.tokens[:] = spec.fed
            self.known = T + steps
            self.reuse = spec if own else None
            return
        greedy = spec.fed if given is not None else np.argmax(full[T - 1 : T + steps - 1], axis=1)
        wrong = np.nonzero(greedy != spec.fed)[0]
        j = steps if wrong.size == 0 else int(wrong[0])
        self.rows[T : T + j] = full[T : T + j]
        n_ok = min(j + 1, steps)  # tokens chosen from valid rows
        self.tokens[:n_ok] = greedy[:n_ok]
        self.known = T + j
        if j == steps and own:
            self.reuse = spec
        else:
            self.notes.append(
                f"the cache's greedy token differs from the recompute's at step {j}; the reference "
                "continues per step from there and the scenarios ran again on the recompute's tokens"
            )

    def order_noise(self) -> dict[str, np.ndarray]:
        """The order noise around the reference rows, per source and position, measured on the first call (notes
        name its sources): :attr:`noise`, what the control judge asks for. The sources: batch shape (the fast
        path's prefix recomputes; on the per-step path the whole-sequence recompute against the rows), unless
        the recompute depends on the length, and the model's ``recompute_variants`` of the final sequence."""
        if self.noise is not None:
            return self.noise
        s, rows, formats = self.subject, self.rows, self.formats
        sources = dict(self.batch_shape or {})
        if self.batch_shape is None and self.path == "per-step":
            sources = {"batch shape (whole-sequence recompute)": np.abs(self.full - rows).max(axis=1)}
        if self.length is not None and sources:
            self.notes.append(
                f"{', '.join(sources)} not admitted as order noise: it exceeds what rounding can explain "
                "(the recompute depends on the length)"
            )
            sources = {}
        if s.calls.has("recompute_variants"):
            variants, skipped = s.calls.variants_or_skipped(np.concatenate([s.prompt, self.tokens]))
            for k, v in variants.items():
                sources[f"variant {k!r}"] = np.abs(v - rows).max(axis=1)
            self.notes += [f"order-noise variant {k!r} skipped: {why}" for k, why in skipped.items()]
        if not sources:
            self.notes.append(
                "control mode found no order-noise source (no batch-shape noise was measured or admitted and the model "
                "has no recompute_variants()); its bound is the logits' format resolution alone"
            )
        scale = np.abs(rows).max(axis=1)
        admitted, refused = F.admission(sources, scale, formats)
        lower = "" if formats.source == "assumed" else f" than the model's lowest ({formats.ceiling}, {formats.source})"
        for r in refused:  # why a source above the admission ceiling is no rounding (rule 1 of issue 18)
            why = (
                "the recompute's rows change with the batch's length by more than rounding (the recompute depends "
                "on it)"
                if r.name.startswith("batch shape")
                else f"it computes in a lower format inside{lower}, or differs from the recompute in logic: it cannot "
                "raise the bound"
            )
            self.notes.append(r.line(formats, why))
        if sources and not admitted:
            self.notes.append(
                "control mode admitted no order-noise source (every one measured was above what rounding can produce); "
                f"its bound is the {formats.floor} resolution alone"
            )
        if admitted:
            safe = np.where(scale > 0, scale, np.inf)
            listed = ", ".join(f"{k} (up to {float((v / safe).max()):.3g} relative)" for k, v in admitted.items())
            self.notes.append(f"order noise measured from: {listed}; pooled over the run")
        self.noise = admitted
        return admitted


class OwnReference(Reference):
    """``follow="cache"``: each scenario is fed its own greedy tokens and compared with the recompute of
    its own sequence. ``tokens``: the first scenario run's; ``path``: ``fast`` unless a scenario needed
    one recompute per step; ``noise`` is ``None`` (exact mode only); ``length``: the first scenario's, if
    its recompute changes with the length. The arguments are :class:`Reference`'s."""

    noise = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.paths: list[str] = []
        self.tokens: np.ndarray | None = None
        self.skipped_tokens = np.zeros(0, dtype=np.int64)

    @property
    def path(self) -> str:
        return "fast" if all(p == "fast" for p in self.paths) else "per-step"

    @mark_greedy
    def choose(self, t: int, out: np.ndarray) -> int:
        """The cache's own greedy choice (the first from its last prompt row)."""
        return int(out.argmax())

    def rows_for(self, scenario: str, run: Run) -> np.ndarray:
        """The recompute rows of ``run``'s own sequence (one recompute after verifying append-invariance,
        else one recompute per step)."""
        s = self.subject
        T, steps = s.T, s.steps
        final = np.concatenate([s.prompt, run.fed])
        why = "fast=False"
        if s.options.fast:
            rows, prefixes = recompute_whole(s.calls, final, T, steps)
            why, parts = invariance(rows, self.prompt_rows, prefixes)
            if why is not None:
                self.length = self.length or length_dependence(parts, rows, self.formats)
                self.notes.append(
                    f"scenario {scenario!r}: recompute is not append-invariant ({why}); used one recompute per step"
                )
        if why is not None:
            rows = np.empty((T + steps, s.vocab))
            rows[:T] = self.prompt_rows
            per_step_rows(s.calls, s.prompt, rows, run.fed, T, greedy=False)
            if not s.options.fast:
                full = s.calls.recompute(final, "of the whole sequence")
                self.length = self.length or length_dependence({T + steps: rows}, full, self.formats, T)
        self.paths.append("fast" if why is None else "per-step")
        if self.tokens is None:
            self.tokens = run.fed
        return rows
