"""The judge of a check, chosen once from its options (:func:`judge_for`): how each scenario's cache path is
judged against its reference rows, and how the scenarios' verdicts make the check's.

- :class:`ExactJudge` (``mode="exact"``): a step passes when its logits are equal (``==``) to the reference;
  no tolerance anywhere. Verdicts ``exact`` / ``divergent``.
- :class:`ControlJudge` (``mode="control"``): each step against the model's measured order noise
  (:mod:`kvfast.check.control`). Verdicts ``rounding`` / ``inconclusive`` / ``bug``.
- :class:`AutoJudge` (``mode="auto"``, the default): settles on one of the two once the scenarios have run
  (:meth:`Judge.settled`): the exact judge when every compared row is bit-equal, else the control judge, the
  order noise measured only then (a bit-exact model costs what exact mode costs).

A lossy cache (:mod:`kvfast.check.lossy`) is judged by the same judge first, then re-judged as a lossy
cache's. The judge is the one place that knows the mode, and carries it to the end: the reference asks it
whether it may need the order noise (:attr:`Judge.measures_noise`), the pipeline asks it for the noise
(:meth:`Judge.noise`), the scenarios' overall verdict and the notes only its mode makes, and each report holds
its judge's detail (:class:`~kvfast.check.check_report.ExactDetail`, :class:`~kvfast.check.check_report.ControlDetail`),
which renders what only that judge measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvfast.check import control as C
from kvfast.check import formats as F
from kvfast.check.check_report import ControlDetail, Detail, ExactDetail, ScenarioReport
from kvfast.check.scenarios.base import CachePath

if TYPE_CHECKING:  # the options are read, never built or validated here
    from kvfast.check.options import CheckOptions


class NoiseSource(Protocol):
    """What a judge asks for the order noise: the reference (:class:`kvfast.check.reference.SharedReference`)."""

    def order_noise(self) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Part:
    """One judged comparison, a report's worth: ``name`` (the report's), ``prompt`` (the prompt the path ran on),
    ``path`` (the cache path), ``rows`` (the reference rows, ``(T + steps, V)``), ``noise`` (the order noise per
    source and position, control mode), ``split`` (the resume scenario's: step 0 judges rows ``split..T-1``;
    else ``None``), ``notes`` and ``keep_logits`` (the report keeps the compared logits, ``cache_logits``, and a
    copy of the rows, ``reference``: passed to the report as it is built, not copied into it after)."""

    name: str
    prompt: np.ndarray
    path: CachePath
    rows: np.ndarray
    noise: dict[str, np.ndarray] | None
    split: int | None = None
    notes: tuple[str, ...] = ()
    keep_logits: bool = False

    @cached_property
    def compared(self) -> tuple[np.ndarray, int | None, bool]:
        """:func:`deviations` of this part, computed once (the auto judge settles on it, the judge then reports it)."""
        return deviations(self.path, self.rows, self.split or 0)


def deviations(run: CachePath, rows: np.ndarray, start: int = 0) -> tuple[np.ndarray, int | None, bool]:
    """Per-step max |cache - reference| (step 0 over prompt rows ``start..T-1``), the first differing prompt row
    (or ``None``) and whether every row is equal (then nothing about the steps needs searching)."""
    T = run.prompt_rows.shape[0]
    diff = run.logits()[start:] - rows[start:]
    if not np.count_nonzero(diff):  # every row equal (as in the sweeps' runs): no reduction to pay for
        return np.zeros(diff.shape[0] - (T - start) + 1), None, True
    per_row = _MAX(np.abs(diff, out=diff), axis=1)  # (one reduction for every row: prompt rows start..T-1, steps)
    prompt = per_row[: T - start]
    worst = prompt[prompt.argmax()]  # (the largest by its index: no reduction's set-up for a few rows)
    bad_row = start + int(np.nonzero(prompt > 0)[0][0]) if worst > 0 else None  # (0 or more: > 0 differs)
    dev = per_row[T - start - 1 :]  # step 0 in the last prompt row's place, then one per decode step
    dev[0] = worst
    return dev, bad_row, False


_MAX = np.maximum.reduce


@dataclass(frozen=True)
class Judge:
    """How a check judges (see the module doc). ``mode``: the option it was chosen from; ``measures_noise``:
    whether it may judge against the model's order noise (the reference is built for it: a recompute that is not
    append-invariant keeps one recompute of the whole sequence, its batch-shape noise measured); ``margin`` and
    ``decisive``: the ratios up to which a step is rounding (a lossy cache's step: ``lossy``) and beyond which
    it is a bug."""

    margin: float = C.DEFAULT_MARGIN
    decisive: float = C.DEFAULT_DECISIVE
    how: str = ""  # how it judges, in the words of a report's "checked ..." line
    mode = ""
    measures_noise = False
    logic_check_mode = "auto"  # the mode of the float64 logic check (promote) of a check judged so

    def settled(self, parts: list[Part]) -> Judge:
        """The judge that decides once ``parts`` (every comparison of the check) are known: itself, except
        :class:`AutoJudge`'s."""
        return self

    def noise(self, reference: NoiseSource) -> dict[str, np.ndarray] | None:
        """The order noise this judge judges against (``reference``'s, measured now; ``None``: it needs none)."""
        return None

    def noise_notes(self, formats: F.NoiseFormats) -> list[str]:
        """The notes on the noise model's ``formats`` that limit this judge's bounds."""
        return []

    def advice(self, verdict: str, fmt: str) -> list[str]:
        """What a ``verdict`` on ``fmt`` logits cannot see, and the logic check that can (a check without one)."""
        return []

    def judge(self, part: Part, fmt: str) -> ScenarioReport:
        """``part``'s report; ``fmt``: the format whose 1 ulp is the least bound of a step (control)."""
        dev, bad_row, _ = part.compared
        differs = (dev > 0).tolist()  # (one list, cheaper than an array's search: the exact judge's verdicts read it)
        first = differs.index(True) if True in differs else None
        verdicts, verdict, detail = self.steps(part, dev, differs, fmt)
        kept = {"cache_logits": part.path.logits(), "reference": part.rows.copy()} if part.keep_logits else {}
        return ScenarioReport(
            part.name, part.prompt, part.path.fed, dev, verdicts, verdict, first, bad_row, detail, part.split,
            part.notes, **kept,
        )  # fmt: skip

    def steps(self, part: Part, dev: np.ndarray, differs: list, fmt: str) -> tuple[tuple[str, ...], str, Detail]:
        """``(step verdicts, the scenario's verdict, the report's detail)`` of ``part`` from its steps' deviations
        ``dev`` (``differs``: whether each is not 0) and ``fmt`` (see :meth:`judge`)."""
        raise NotImplementedError

    def overall(self, reports: list[ScenarioReport]) -> str:
        """The check's verdict from the reports of the scenarios that ran (at least one)."""
        raise NotImplementedError

    def lossy_verdicts(self, ratio: np.ndarray) -> list[str]:
        """A lossy cache's step verdicts from its ratios to the format's expected error (:mod:`kvfast.check.lossy`)."""
        raise NotImplementedError

    def lossy_detail(self, bounds: ControlDetail, judged: Detail) -> Detail:
        """A lossy cache's report's detail: its ``bounds`` (the format's expected error), judged as this judge
        judges; ``judged``: the detail of the report before it was re-judged as a lossy cache's."""
        return bounds


@dataclass(frozen=True)
class ExactJudge(Judge):
    how: str = "bit for bit"
    mode = "exact"

    def steps(self, part: Part, dev: np.ndarray, differs: list, fmt: str) -> tuple[tuple[str, ...], str, Detail]:
        if True not in differs:  # bit-exact, as the sweeps' runs are: nothing more to pay for
            return ("exact",) * len(differs), "exact", ExactDetail(None)
        verdicts = tuple("divergent" if d else "exact" for d in differs)
        T, start = part.prompt.shape[0], part.split or 0  # each step's deviation in ulps of fmt at its magnitude
        magnitude = np.abs(part.rows).max(axis=1)
        ulps = dev / F.ulp(fmt, np.concatenate([[magnitude[start:T].max()], magnitude[T:]]))
        return verdicts, "divergent", ExactDetail(ulps)

    def overall(self, reports: list[ScenarioReport]) -> str:
        if all(r.verdict == "exact" for r in reports):
            return "exact"
        return "lossy" if all(r.verdict in ("exact", "lossy") for r in reports) else "divergent"

    def lossy_verdicts(self, ratio: np.ndarray) -> list[str]:
        return ["lossy" if r <= self.margin else "divergent" for r in ratio]

    def lossy_detail(self, bounds: ControlDetail, judged: Detail) -> Detail:
        return ExactDetail(judged.ulps, bounds=bounds)


@dataclass(frozen=True)
class ControlJudge(Judge):
    """Control mode with rounding up to ``margin`` times a step's bound and a bug beyond ``decisive`` times."""

    how: str = "against the model's measured order noise"
    mode = "control"
    measures_noise = True
    logic_check_mode = "control"

    def steps(self, part: Part, dev: np.ndarray, differs: list, fmt: str) -> tuple[tuple[str, ...], str, Detail]:
        rows, noise = part.rows, part.noise
        T = part.prompt.shape[0]
        start = part.split or 0
        scale_pos = np.abs(rows).max(axis=1)
        noise_pos = np.max([np.zeros(rows.shape[0]), *noise.values()], axis=0)
        scale = np.concatenate([[scale_pos[start:T].max()], scale_pos[T:]])
        floor = np.concatenate([[noise_pos[start:T].max()], noise_pos[T:]])
        rel, where = C.pooled_noise(noise, scale_pos)
        compared = T - start + dev.shape[0] - 1  # the reference rows the steps cover
        bound, ratio, verdicts, floor_source = C.judge(
            dev, scale, rel, where, fmt, self.margin, self.decisive, compared, C.noise_draws(noise)
        )
        detail = ControlDetail(floor, bound, ratio, floor_source, self.margin, self.decisive)
        return verdicts, C.worst(verdicts), detail

    def noise(self, reference: NoiseSource) -> dict[str, np.ndarray] | None:
        return reference.order_noise()

    def noise_notes(self, formats: F.NoiseFormats) -> list[str]:
        return [n for n in (formats.note(), formats.cache_note()) if n is not None]

    def advice(self, verdict: str, fmt: str) -> list[str]:
        if fmt not in ("bfloat16", "float16"):
            return []
        if verdict == "inconclusive":
            return [
                f"the {fmt} verdict is inconclusive: run the logic check in float64 (promote='float64', "
                "--promote on the command line), where a cache logic bug stands far above rounding"
            ]
        if verdict == "rounding":
            return [
                f"{fmt} logits resolve only a few significant digits: a cache logic bug can hide below "
                f"{self.margin:g} units in their last place; the logic check in float64 (promote='float64') rules "
                "it out"
            ]
        return []

    def overall(self, reports: list[ScenarioReport]) -> str:
        return C.worst([r.verdict for r in reports])

    def lossy_verdicts(self, ratio: np.ndarray) -> list[str]:
        return ["lossy" if r <= self.margin else "bug" if r > self.decisive else "inconclusive" for r in ratio]


@dataclass(frozen=True)
class AutoJudge(Judge):
    """``mode="auto"``: the reference is built as for control mode (its noise measured only if needed); the
    check is then judged by :class:`ExactJudge` when every compared row equals its reference (``==``), else by
    :class:`ControlJudge`, which measures the noise. It judges nothing itself: the pipeline asks it to settle
    first."""

    mode = "auto"
    measures_noise = True

    def settled(self, parts: list[Part]) -> Judge:
        equal = all(p.compared[2] for p in parts)
        settled = (ExactJudge if equal else ControlJudge)(self.margin, self.decisive)
        return replace(settled, how=f"{settled.how} (auto: {'every step' if equal else 'not'} bit-identical)")


def judge_for(options: CheckOptions) -> Judge:
    """The judge ``options`` ask for: the one place a check's mode is decided (``follow="cache"`` compares each
    scenario with its own sequence's recompute, which has no order noise measured: judged exactly in ``auto``)."""
    mode = "exact" if options.mode == "auto" and options.follow == "cache" else options.mode
    kind = {"auto": AutoJudge, "exact": ExactJudge, "control": ControlJudge}[mode]
    return kind(options.margin, options.decisive)
