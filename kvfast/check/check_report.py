"""A check's report and its rendering: :class:`ScenarioReport` (one scenario, step by step) and
:class:`CheckReport` (every scenario, the overall verdict, ``format()``), and a skipped scenario's
report (:func:`skipped`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvfast.check.formats import NoiseFormats

PASSING = ("exact", "rounding", "lossy", "skipped")  # lossy: a quantized cache within its format (check.lossy)
LENGTH_DEPENDENT = "length-dependent"  # the check's verdict when the recompute itself changes with the length
#: The check's verdict when no requested scenario ran (or, with ``strict``, when any was skipped and the rest
#: passed): nothing, or not everything asked for, was checked. It never passes.
UNCHECKED = "unchecked"


@dataclass(frozen=True)
class LengthDependence:
    """A recompute whose past changes with the length: row ``position`` of ``recompute(first short tokens)``
    differs from the same row of ``recompute(first long tokens)`` by ``deviation``, ``ratio`` times what
    rounding can explain (:func:`kvfast.check.formats.length_ceiling`, ``ceiling``). ``by``: the check
    that found it (``""``: this one; ``"the logic check in float64"``)."""

    position: int
    short: int
    long: int
    deviation: float
    ceiling: float
    by: str = ""

    @property
    def ratio(self) -> float:
        return self.deviation / self.ceiling

    def line(self) -> str:
        """One line: what differs, by how much, and the likely causes."""
        by = f" (found by {self.by})" if self.by else ""
        return (
            f"the recompute depends on the sequence's length{by}: row {self.position} of recompute(first "
            f"{self.short} tokens) differs from the same row of recompute(first {self.long} tokens) by "
            f"{self.deviation:.4g}, {self.ratio:.3g}x what rounding can explain ({self.ceiling:.3g}); likely a "
            "length-dependent position scaling (dynamic NTK, LongRoPE, YaRN) or a recompute that is itself wrong. "
            "No cache can equal a recompute whose past changes with the length: the check cannot pass"
        )


@dataclass(frozen=True)
class ExactDetail:
    """Exact mode's detail of a scenario (the judge's, :mod:`kvfast.check.judge`): ``ulps[t]``, where a step
    diverged, the deviation in units in the last place of the logits' format at the step's magnitude (a
    divergence of a few is the size of order noise, not of a logic bug); ``None``: every step equal.
    ``bounds``: a lossy cache's, the format's expected error (:mod:`kvfast.check.lossy`: judged as exact mode
    judges, a lossy cache never passes, the first nonzero error is the first failure), else ``None`` (exact mode
    judges no step against a bound)."""

    ulps: np.ndarray | None = None
    bounds: ControlDetail | None = field(default=None, kw_only=True)
    mode = "exact"

    def passes(self, verdict: str) -> bool:
        """Exact mode promises ``==``, which no lossy cache can keep."""
        return verdict in PASSING and verdict != "lossy"

    def focus(self, s: ScenarioReport) -> int | None:
        return s.first_divergent_step

    def first_bug(self, verdicts: tuple[str, ...]) -> int | None:
        return None if self.bounds is None else self.bounds.first_bug(verdicts)

    def first_row(self, s: ScenarioReport) -> int | None:
        """The first differing prompt row, the position a message about step 0 names."""
        return s.first_divergent_position

    def columns(self) -> str:
        return "" if self.bounds is None else self.bounds.columns()

    def cells(self, t: int) -> str:
        return "" if self.bounds is None else self.bounds.cells(t)

    def passing(self, s: ScenarioReport, head: str) -> str:
        return f"{head}; all {s.deviation.shape[0]} steps bit-identical to the recompute"

    def failing(self, s: ScenarioReport, focus: int, head: str) -> str:
        return f"{head}; first divergent step {s.where(focus)}: max |cached - recompute| = {s.deviation[focus]:.6g}"

    def size(self, step: int, fmt: str) -> str:
        if self.bounds is not None:
            return self.bounds.size(step, fmt)
        return "" if self.ulps is None else f", {self.ulps[step]:.4g} units in the last place of the {fmt} logits"

    def pass_size(self, deviation: float, ratio: float | None) -> str:
        """The size line of a pass: ``deviation`` and ``ratio``, the largest over every scenario."""
        return "every compared step equals the recompute bit for bit"

    def noise_line(self, step: int, fmt: str, ran: list[ScenarioReport]) -> str:
        """The first line's note where the failing step is within a few units in the last place: the size of order
        noise, and the mode that tells rounding from bugs (``""``: farther off)."""
        if self.ulps is None or self.ulps[step] > FEW_ULPS:
            return ""
        line = (
            f", {self.ulps[step]:.3g} units in the last place of its {fmt} logits: the size of "
            "order noise (two paths adding in different orders), not of a logic bug"
        )
        far = max(ran, key=lambda s: s.detail.ulps.max() if s.detail.ulps is not None else 0.0)
        if far.detail.ulps is not None and far.detail.ulps.max() > MANY_ULPS:
            t = int(far.detail.ulps.argmax())
            line += f"; but step {t} of {far.name!r} is {far.detail.ulps[t]:.3g} units off, far beyond it"
        return line + "; --mode auto (the default) tells rounding from bugs"

    def floor_line(self, formats: NoiseFormats | None, passed: bool) -> str | None:
        return None

    def noise_bound(self) -> np.ndarray | float:
        """The least bound the order noise sets on each step (a lossy cache's bound is at least it): none (a lossy
        cache's: its bounds)."""
        return 0.0 if self.bounds is None else self.bounds.bound

    def threshold(self, steps: int) -> tuple[tuple[float, ...], str]:
        """Per step (``steps`` + 1 of them), the deviation beyond which the step fails, and where it comes from
        (in a reproducer's words)."""
        return (0.0,) * (steps + 1), "exact equality (kvfast's exact mode: the paths must be bit-equal)"


@dataclass(frozen=True)
class ControlDetail:
    """Control mode's detail of a scenario (:mod:`kvfast.check.control`), and a lossy cache's bounds in either
    mode (:mod:`kvfast.check.lossy`): ``floor[t]`` (the order noise measured at step ``t``; a lossy cache's: the
    expected error of its format), ``bound[t]`` (what the step is judged against), ``ratio[t]`` =
    ``deviation / bound`` (always finite), ``floor_source[t]`` (what set the bound), ``margin`` and ``decisive``
    (rounding up to ``margin`` times the bound, a bug beyond ``decisive`` times)."""

    floor: np.ndarray
    bound: np.ndarray
    ratio: np.ndarray
    floor_source: tuple[str, ...]
    margin: float
    decisive: float
    mode = "control"

    @property
    def bounds(self) -> ControlDetail:
        return self

    def passes(self, verdict: str) -> bool:
        return verdict in PASSING

    def focus(self, s: ScenarioReport) -> int | None:
        return s.first_bug_step if s.first_bug_step is not None else s.first_inconclusive_step

    def first_bug(self, verdicts: tuple[str, ...]) -> int | None:
        """The first step judged a bug (a lossy cache's: or divergent, its lossless twin's exact verdict)."""
        return next((t for t, v in enumerate(verdicts) if v in ("bug", "divergent")), None)

    def first_row(self, s: ScenarioReport) -> int | None:
        return None

    def columns(self) -> str:
        return f" {'floor':>10} {'bound':>10} {'ratio':>9}"

    def cells(self, t: int) -> str:
        return f" {self.floor[t]:>10.4g} {self.bound[t]:>10.4g} {self.ratio[t]:>9.4g}"

    def passing(self, s: ScenarioReport, head: str) -> str:
        worst, most = float(s.deviation.max()), float(self.ratio.max())
        return (
            f"{head}; every step within {self.margin:g}x its bound (worst deviation {worst:.4g}, largest ratio "
            f"{most:.3g})"
        )

    def failing(self, s: ScenarioReport, focus: int, head: str) -> str:
        what = "first bug step" if s.first_bug_step is not None else "first inconclusive step"
        msg = (
            f"{head}; {what} {s.where(focus)}: max |cached - recompute| = {s.deviation[focus]:.6g}, "
            f"{self.ratio[focus]:.4g}x its bound {self.bound[focus]:.4g} (rounding <= {self.margin:g}x, "
            f"bug > {self.decisive:g}x; bound from {self.floor_source[focus]})"
        )
        if s.first_bug_step is not None and s.first_divergent_step is not None:
            msg += f"; first nonzero deviation at step {s.first_divergent_step}"
        return msg

    def size(self, step: int, fmt: str) -> str:
        return (
            f", {self.ratio[step]:.4g}x the bound {self.bound[step]:.4g} that rounding can reach (rounding up to "
            f"{self.margin:g}x, a bug beyond {self.decisive:g}x)"
        )

    def pass_size(self, deviation: float, ratio: float | None) -> str:
        if not deviation > 0:
            return "every compared step equals the recompute bit for bit"
        return (
            f"largest deviation {deviation:.4g}, at most {ratio:.3g}x the bound that rounding can reach (rounding up "
            f"to {self.margin:g}x)"
        )

    def noise_line(self, step: int, fmt: str, ran: list[ScenarioReport]) -> str:
        return ""

    def floor_line(self, formats: NoiseFormats | None, passed: bool) -> str | None:
        """Where the lowest internal format sets the bounds' floor and was not merely assumed (or the check
        failed)."""
        if formats is None or (formats.source == "assumed" and passed):
            return None
        return f"the bounds' floor is set by the lowest internal format {formats.line()}"

    def noise_bound(self) -> np.ndarray | float:
        return self.bound

    def threshold(self, steps: int) -> tuple[tuple[float, ...], str]:
        return tuple(float(b) * float(self.decisive) for b in self.bound), (
            f"kvfast's control-mode bug threshold at each step: {self.decisive:g} x the step's bound (the order noise "
            "kvfast measured for this model at that step, from recomputes that differ only in how they add up)"
        )


Detail = ExactDetail | ControlDetail


@dataclass(frozen=True)
class ScenarioReport:
    """One scenario's comparison of the cache path against the recompute, step by step.

    - ``deviation[t]``: ``max |cache - recompute|`` over the logits of step ``t``
      (step 0: the prompt rows the scenario judges: every row in ``decode``, the
      resumed chunk's rows ``split..T-1`` in ``resume``); ``0.0`` exactly when equal.
    - ``first_divergent_step``: the first step whose logits are not equal
      (``None``: none); ``first_divergent_position`` the position of its first
      differing row.
    - ``step_verdicts[t]``: ``exact``/``divergent`` or ``rounding``/``inconclusive``/``bug``;
      ``verdict``: the scenario's (its worst step's, or ``skipped`` with the reason in ``notes``).
    - ``detail``: how the judge judged it, and what only that judge measures (``None``: skipped):
      :class:`ExactDetail` (exact mode: each divergent step in units in the last place) or
      :class:`ControlDetail` (control mode: each step's bound and ratio, :attr:`bounds`).
    - ``keep_logits=True`` only: ``cache_logits`` ``(T + steps, V)``, the cache
      path's logits (rows ``0..T-1`` the prompt's, row ``T + t - 1`` decode step
      ``t``'s), and ``reference``, the recompute rows they were compared with
      (same shape); else ``None``.
    """

    name: str
    prompt: np.ndarray
    tokens: np.ndarray
    deviation: np.ndarray
    step_verdicts: tuple[str, ...]
    verdict: str
    first_divergent_step: int | None
    first_divergent_position: int | None
    detail: Detail | None = None
    split: int | None = None
    notes: tuple[str, ...] = ()
    cache_logits: np.ndarray | None = field(default=None, repr=False)
    reference: np.ndarray | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        """``True`` for ``exact``, ``rounding`` and ``skipped``, and ``lossy`` where not judged exactly (exact mode
        promises ``==``, which no lossy cache can keep)."""
        return self.verdict in PASSING if self.detail is None else self.detail.passes(self.verdict)

    @property
    def bounds(self) -> ControlDetail | None:
        """Each step's bound, ratio and floor (control mode; a lossy cache's in either mode); ``None``: judged bit
        for bit."""
        return None if self.detail is None else self.detail.bounds

    @property
    def first_bug_step(self) -> int | None:
        """The first step judged a bug (control mode, and a lossy cache's; ``None``: none, or judged bit for bit)."""
        return None if self.detail is None else self.detail.first_bug(self.step_verdicts)

    @property
    def first_inconclusive_step(self) -> int | None:
        """The first step judged ``inconclusive`` (``None``: none)."""
        return next((t for t, v in enumerate(self.step_verdicts) if v == "inconclusive"), None)

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def first_row(self) -> int:
        """The first prompt row step 0 judges (the resume scenario's: the split)."""
        return self.split or 0

    def position(self, step: int) -> str:
        """The position(s) a step covers, as text (step 0: ``first_row-(T-1)``)."""
        T = self.prompt.shape[0]
        return f"{self.first_row}-{T - 1}" if step == 0 else str(T + step - 1)

    def focus_step(self) -> int | None:
        """The step a message is about: the first bug, else the first inconclusive step (control), or the
        first divergence (exact)."""
        return self.detail.focus(self)

    def table(self, max_rows: int = 12) -> str:
        """A short per-step table: the first steps, and the steps around the first failure."""
        n = self.deviation.shape[0]
        focus = self.focus_step()
        show = set(range(min(n, 4)))
        if focus is not None:
            show |= set(range(max(0, focus - 2), min(n, focus + 4)))
        show |= {n - 1}
        rows = sorted(show)[:max_rows]
        head = f"{'step':>5} {'position':>9} {'fed token':>9} {'deviation':>11}" + self.detail.columns()
        lines = [head + "  verdict"]
        prev = -1
        for t in rows:
            if t != prev + 1:
                lines.append(f"{'...':>5}")
            prev = t
            tok = "-" if t == 0 else str(int(self.tokens[t - 1]))
            line = f"{t:>5} {self.position(t):>9} {tok:>9} {self.deviation[t]:>11.4g}" + self.detail.cells(t)
            mark = "  <- first" if t == focus else ""
            lines.append(f"{line}  {self.step_verdicts[t]}{mark}")
        return "\n".join(lines)

    def where(self, step: int) -> str:
        """``S (position P)``; the resume scenario's step 0 says it is the resumed chunk, not a prefill."""
        row = self.detail.first_row(self) if step == 0 else None
        at = self.position(step) if row is None else str(row)
        if step == 0 and self.split is not None:  # the resume scenario
            return f"0 (the resumed chunk, prompt position {at}, after a prefill of 0-{self.first_row - 1})"
        return f"{step} (position {at})"

    def summary(self) -> str:
        """One paragraph: the verdict, the first divergent step, its deviation and the context tokens."""
        if self.verdict == "skipped":
            return f"scenario {self.name!r}: skipped ({'; '.join(self.notes)})"
        mode = self.detail.mode
        if self.verdict == "lossy":  # a quantized cache within its format (kvfast.check.lossy)
            lossy = [n for n in self.notes if n.startswith("a lossy cache")]
            b = self.bounds
            return (
                f"scenario {self.name!r} ({mode}): lossy; every step within {b.margin:g}x its bound (largest "
                f"error against the cache unquantized {float(self.deviation.max()):.4g}, largest ratio "
                f"{float(b.ratio.max()):.3g}); " + "; ".join(lossy)
            )
        T = self.prompt.shape[0]
        head = f"scenario {self.name!r} ({mode}): {self.verdict}"
        if self.split is not None:
            head += f" (prompt split {self.split} + {T - self.split})"
        focus = self.focus_step()
        if focus is None:
            return self.detail.passing(self, head)
        msg = self.detail.failing(self, focus, head)
        ctx = self.context(focus)
        shown = ", ".join(map(str, ctx[-24:]))
        more = f"... ({ctx.shape[0] - 24} earlier) " if ctx.shape[0] > 24 else ""
        msg += f"\ncontext tokens up to position {ctx.shape[0] - 1}: [{more}{shown}]"
        return msg

    def context(self, step: int) -> np.ndarray:
        """The tokens the model had seen when step ``step``'s logits were computed."""
        if step == 0:
            end = self.first_divergent_position
            return self.prompt if end is None else self.prompt[: end + 1]
        return np.concatenate([self.prompt, self.tokens[:step]])


@dataclass(frozen=True)
class CheckReport:
    """The result of :func:`check_cache`: one :class:`ScenarioReport` per scenario, and the overall verdict.

    ``verdict`` is ``exact`` or ``divergent`` (exact mode), ``rounding``,
    ``inconclusive`` or ``bug`` (control mode: the worst scenario's), or, in
    either mode, ``length-dependent`` (:data:`LENGTH_DEPENDENT`) when the
    recompute itself changes with the sequence's length by more than rounding
    (``length_dependence`` says where and how much; the scenarios keep their own
    verdicts): such a check never passes.
    ``passed``: ``exact`` or ``rounding``; with a logic check (``promoted``, the
    same check on the model in float64), an ``inconclusive`` native verdict
    passes when the logic check says ``rounding``, and a logic-check ``bug``
    fails. ``tokens`` are the tokens fed to ``decode`` (``steps`` of them).
    ``path`` is ``fast`` or ``per-step`` (``per-step`` if any scenario needed
    it). ``logits_format``: the format the model's logits came in; ``formats``: the noise model's formats
    (:class:`~kvfast.check.formats.NoiseFormats`: the lowest internal format, which sets the floor of every
    bound and the admission ceiling of order noise, and whether it was declared, measured or assumed).
    ``how``: how the judge judged, in words (``bit for bit (auto: every step bit-identical)``).
    """

    mode: str
    prompt: np.ndarray
    tokens: np.ndarray
    scenarios: dict[str, ScenarioReport]
    verdict: str
    path: str
    notes: tuple[str, ...] = field(default=())
    logits_format: str = "float64"
    promoted: CheckReport | None = None
    length_dependence: LengthDependence | None = None
    formats: NoiseFormats | None = None
    strict: bool = False
    native: str | None = None
    how: str = ""

    @property
    def native_verdict(self) -> str:
        """The verdict in the model's own format (``verdict`` is the deciding one: a logic check's where it found
        what the native format could not see)."""
        return self.verdict if self.native is None else self.native

    @property
    def judged(self) -> str:
        """How the check was judged: ``exact`` or ``control`` (``auto`` settles on one of them)."""
        ran = self.ran
        return ran[0].detail.mode if ran else self.mode

    @property
    def ran(self) -> list[ScenarioReport]:
        """The reports of the scenarios that ran (not skipped)."""
        return [s for s in self.scenarios.values() if s.verdict != "skipped"]

    @property
    def skipped(self) -> dict[str, str]:
        """``{scenario: why}`` for each requested scenario that did not run."""
        return {name: "; ".join(s.notes) for name, s in self.scenarios.items() if s.verdict == "skipped"}

    @property
    def passed(self) -> bool:
        """Whether the deciding verdict passes: ``exact``, ``rounding``, or ``lossy`` where not judged exactly (exact
        mode promises ``==``, which no lossy cache can keep); never with a length dependence."""
        if self.length_dependence is not None:
            return False
        return self.verdict in ("exact", "rounding") or (
            self.verdict == "lossy" and all(s.passed for s in self.decider().ran)
        )

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def first_divergent_step(self) -> int | None:
        """The earliest first divergent step over the scenarios (``None``: every step equal)."""
        found = (s.first_divergent_step for s in self.scenarios.values() if s.first_divergent_step is not None)
        return min(found, default=None)

    @property
    def first_bug_step(self) -> int | None:
        """Control mode: the earliest step judged a bug over the scenarios."""
        return min((s.first_bug_step for s in self.scenarios.values() if s.first_bug_step is not None), default=None)

    @property
    def worst(self) -> ScenarioReport | None:
        """The scenario a failure message is about (the earliest failure; else the first scenario run; ``None``
        when none ran)."""
        ran = self.ran
        failing = [s for s in ran if not s.passed]
        bugs = [s for s in failing if s.verdict == "bug"] or failing
        if bugs:
            return min(bugs, key=lambda s: s.focus_step())
        return ran[0] if ran else None

    @property
    def deviation(self) -> np.ndarray:
        """Per-step deviation of :attr:`worst` (empty when no scenario ran)."""
        worst = self.worst
        return np.zeros(0) if worst is None else worst.deviation

    @property
    def max_deviation(self) -> float:
        """The largest deviation over every step of every scenario that ran (NaN when none ran: nothing measured)."""
        return max((float(s.deviation.max()) for s in self.ran), default=float("nan"))

    @property
    def max_ratio(self) -> float | None:
        """Control mode: the largest ratio over every step of every scenario that ran (``None``: no scenario has
        ratios, as in exact mode)."""
        ratios = (float(s.bounds.ratio.max()) for s in self.ran if s.bounds is not None and s.bounds.ratio.size)
        return max(ratios, default=None)

    def skipped_line(self) -> str | None:
        """One line naming each skipped scenario and why (``None``: none was skipped)."""
        if not self.skipped:
            return None
        listed = "; ".join(f"{name} ({why})" for name, why in self.skipped.items())
        if not self.ran:
            return f"no requested scenario ran, nothing was checked: {listed}"
        if self.strict:
            return f"strict: a requested scenario was skipped, so the check cannot pass: {listed}"
        return f"skipped (not checked; the verdict covers only {', '.join(s.name for s in self.ran)}): {listed}"

    def headline(self) -> str:
        """Which scenario diverged (or failed) first, and each scenario's first step on its own."""
        ran = self.ran
        parts = [
            f"{s.name}: {s.verdict}" + ("" if s.focus_step() is None else f" from step {s.where(s.focus_step())}")
            for s in ran
        ]
        failing = [s for s in ran if s.focus_step() is not None]
        if not failing:
            return "; ".join(parts)
        first = self.worst if not self.worst.passed else min(failing, key=lambda s: s.focus_step())
        return f"first in scenario {first.name!r}, step {first.where(first.focus_step())}; " + "; ".join(parts)

    def decider(self) -> CheckReport:
        """The report whose verdict decides: the logic check's where it overrode the native verdict, else this."""
        return self if self.native is None or self.promoted is None else self.promoted

    def verdict_line(self) -> str:
        """Line 1, the whole truth: pass or fail, the deciding verdict, where it was found (scenario and step), and
        the native verdict beside a logic check's."""
        line = f"kvfast check: {'PASS' if self.passed else 'FAIL'}: {self.verdict.upper()}"
        if self.verdict == LENGTH_DEPENDENT:
            return line + " (the recompute itself changes with the sequence's length: no cache can equal it)"
        if self.verdict == UNCHECKED:
            return line + (" (strict: a requested scenario was skipped)" if self.ran else " (nothing was checked)")
        decider = self.decider()
        worst = decider.worst
        step = None if worst is None or worst.passed else worst.focus_step()
        if step is not None:
            line += f" in scenario {worst.name!r} at step {worst.where(step)}"
        if decider is not self:
            line += (
                f" ({decider.logits_format} logic check); native {self.logits_format}: {self.native_verdict.upper()}"
            )
        elif step is not None:
            line += worst.detail.noise_line(step, self.logits_format, self.ran)
        return line

    def detail_lines(self) -> list[str]:
        """Lines 2-3 in plain words: how large the deciding deviation is against what, and what was checked."""
        decider = self.decider()
        worst = decider.worst
        lines = []
        if self.length_dependence is not None:
            lines.append(self.length_dependence.line())
        if worst is not None:
            lines.append(decider.size_line())
        names = ", ".join(self.scenarios)
        lines.append(
            f"checked {self.how}: {self.steps} decode steps after a prompt of {self.prompt.shape[0]} tokens, "
            f"{self.logits_format} logits, {self.path} reference; scenarios: {names}"
        )
        return lines

    def size_line(self) -> str:
        """How far the cache is from the recompute, in plain words: at the first failing step of the worst scenario,
        against the bound that decides; on a pass, the largest deviation (and ratio) over every step."""
        worst = self.worst
        step = None if worst.passed else worst.focus_step()
        if step is None:
            return worst.detail.pass_size(self.max_deviation, self.max_ratio)
        return (
            f"scenario {worst.name!r}, step {worst.where(step)}: the cached logits differ from the full recompute by "
            f"{worst.deviation[step]:.4g}"
        ) + worst.detail.size(step, self.logits_format)

    def format(self) -> str:
        """The full readable report: the verdict line, two lines of what it means, each scenario's summary, the
        notes, the worst scenario's table and the logic check's report."""
        lines = [self.verdict_line(), *([self.skipped_line()] if self.skipped else [])]
        if not self.ran:  # nothing was checked: the verdict line and the line naming the scenarios and why
            return "\n".join(lines)
        lines += self.detail_lines()
        lines.append(self.headline())
        lines += [s.summary() for s in self.scenarios.values()]
        lines += [f"note: {n}" for n in self.notes]
        worst = self.worst
        lines.append(f"per-step table ({worst.name!r}):")
        lines.append(worst.table())
        floor = worst.detail.floor_line(self.formats, self.passed)
        if floor is not None:
            lines.append(floor)
        if self.promoted is not None:
            ran = self.promoted.logits_format  # the format it actually ran in, never a claim of float64
            lines.append(f"logic check in {ran} (same tokens): {self.promoted.verdict.upper()}")
            lines += ["  " + line for line in self.promoted.format().splitlines()[1:]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


#: A divergence of at most this many units in the last place of the logits' format is the size of order noise; an
#: exact-mode failure that small says so on its first line.
FEW_ULPS = 4.0
#: ... and a step this many units off, beside it, is far beyond any order noise (the admission ceiling of order noise).
MANY_ULPS = 64.0


def deciding(native: str, promoted: CheckReport | None) -> str:
    """The verdict that decides a check whose native verdict is ``native``: the logic check's (``promoted``) where
    it fails (it found what the native format could not resolve) or where it settles a native ``inconclusive``;
    else ``native``."""
    if promoted is None or native in (UNCHECKED, LENGTH_DEPENDENT):
        return native
    if not promoted.passed or native == "inconclusive":
        return promoted.verdict
    return native


def skipped(name: str, prompt: np.ndarray, tokens: np.ndarray, why: str) -> ScenarioReport:
    """Scenario ``name``'s report when it cannot run on this model: ``skipped``, ``why`` as its note."""
    return ScenarioReport(name, prompt, tokens, np.zeros(0), (), "skipped", None, None, notes=(why,))
