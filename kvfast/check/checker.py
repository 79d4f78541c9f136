"""Every-step cache checks of a model under test: ``check_cache`` and ``assert_cache_exact``.

Steps. Step 0 is the prompt: every row of the logits the cache path returns
for the prompt (``prefill``, or ``prefill`` + ``extend`` in the resume
scenario) against the rows of ``recompute(prompt)``. Step ``t >= 1`` is the
``t``-th ``decode``: its logits (position ``len(prompt) + t - 1``) against that
position's row of a full recompute. The tokens fed to ``decode`` are greedy
choices from the RECOMPUTE path, so both paths always see the same sequence,
and a bug cannot steer the check onto another text.

The reference (per-step path). Step ``t``'s reference is the last row of
``recompute(prompt + tokens[:t])``: one recompute per step.

The reference (fast path, the default). Under a causal mask appending a token
cannot change earlier positions, so row ``p`` of ONE recompute of the final
sequence is the reference for every step. The checker does not assume this of
the model; it verifies it: the model's rows of ``recompute(prompt)`` and of
``recompute(final[:q])`` (``q`` = prompt length + a quarter of the steps)
must equal (``==``) the same rows of ``recompute(final)``. The final sequence
is found by decoding with the cache's own greedy choices, then the tokens are
checked against the recompute's greedy choices; from the first step where they
differ (only possible after a divergence) the reference continues per step,
and every scenario then runs again against the recompute's tokens. When the
recompute is not append-invariant, the per-step path runs instead (noted in
the report).

Following the cache's own tokens (``follow="cache"``, exact mode only). Each
scenario feeds ``decode`` the cache path's OWN greedy choices (the first from
its last prompt row), and its reference is the recompute of that same
sequence: one recompute of the scenario's final sequence after the same
append-invariance verification (fast path), else one recompute per step. A
deviation is still the cache's alone (both paths see one sequence), but the
text is the one the cache generates: what kvfast's bug studies measure, where
a bug may steer the generation onto another text. Each scenario then holds
its own tokens.

Modes. ``exact``: a step passes when its logits are equal (``==``) to the
reference; no tolerance anywhere. ``control``: see :mod:`kvfast.check.control`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvfast.check import control as C
from kvfast.check.protocol import (
    GuardedModel,
    call_model,
    check_logits,
    check_prompt,
    check_range,
    guard,
    has,
    logits_format,
    model_name,
    require_model,
    vocab_of,
    watched,
)
from kvfast.validation import not_allowed, require_choice, require_int

MODES = ("exact", "control")
SCENARIOS = ("decode", "resume")
FOLLOW = ("recompute", "cache")
PROMOTE = ("float64",)
PASSING = ("exact", "rounding", "skipped")


@dataclass(frozen=True)
class ScenarioReport:
    """One scenario's comparison of the cache path against the recompute, step by step.

    - ``deviation[t]``: ``max |cache - recompute|`` over the logits of step ``t``
      (step 0: the prompt rows the scenario judges: every row in ``decode``, the
      resumed chunk's rows ``split..T-1`` in ``resume``); ``0.0`` exactly when equal.
    - ``first_divergent_step``: the first step whose logits are not equal
      (``None``: none); ``first_divergent_position`` the position of its first
      differing row.
    - control mode only: ``floor[t]`` (the order noise measured at step ``t``),
      ``bound[t]`` (what the step is judged against), ``ratio[t]`` =
      ``deviation / bound`` (always finite), ``floor_source[t]`` (what set the
      bound), ``first_bug_step`` and ``first_inconclusive_step``.
    - ``step_verdicts[t]``: ``exact``/``divergent`` or ``rounding``/``inconclusive``/``bug``;
      ``verdict``: the scenario's (its worst step's, or ``skipped`` with the reason in ``notes``).
    - ``keep_logits=True`` only: ``cache_logits`` ``(T + steps, V)``, the cache
      path's logits (rows ``0..T-1`` the prompt's, row ``T + t - 1`` decode step
      ``t``'s), and ``reference``, the recompute rows they were compared with
      (same shape); else ``None``.
    """

    name: str
    mode: str
    prompt: np.ndarray
    tokens: np.ndarray
    deviation: np.ndarray
    step_verdicts: tuple[str, ...]
    verdict: str
    first_divergent_step: int | None
    first_divergent_position: int | None
    floor: np.ndarray | None = None
    bound: np.ndarray | None = None
    ratio: np.ndarray | None = None
    first_bug_step: int | None = None
    margin: float | None = None
    split: int | None = None
    notes: tuple[str, ...] = ()
    cache_logits: np.ndarray | None = field(default=None, repr=False)
    reference: np.ndarray | None = field(default=None, repr=False)
    floor_source: tuple[str, ...] | None = None
    first_inconclusive_step: int | None = None
    decisive: float | None = None

    @property
    def passed(self) -> bool:
        """``True`` for ``exact``, ``rounding`` and ``skipped``."""
        return self.verdict in PASSING

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
        if self.mode == "control":
            return self.first_bug_step if self.first_bug_step is not None else self.first_inconclusive_step
        return self.first_divergent_step

    def table(self, max_rows: int = 12) -> str:
        """A short per-step table: the first steps, and the steps around the first failure."""
        n = self.deviation.shape[0]
        focus = self.focus_step()
        show = set(range(min(n, 4)))
        if focus is not None:
            show |= set(range(max(0, focus - 2), min(n, focus + 4)))
        show |= {n - 1}
        rows = sorted(show)[:max_rows]
        head = f"{'step':>5} {'position':>9} {'fed token':>9} {'deviation':>11}"
        if self.mode == "control":
            head += f" {'floor':>10} {'bound':>10} {'ratio':>9}"
        lines = [head + "  verdict"]
        prev = -1
        for t in rows:
            if t != prev + 1:
                lines.append(f"{'...':>5}")
            prev = t
            tok = "-" if t == 0 else str(int(self.tokens[t - 1]))
            line = f"{t:>5} {self.position(t):>9} {tok:>9} {self.deviation[t]:>11.4g}"
            if self.mode == "control":
                line += f" {self.floor[t]:>10.4g} {self.bound[t]:>10.4g} {self.ratio[t]:>9.4g}"
            mark = "  <- first" if t == focus else ""
            lines.append(f"{line}  {self.step_verdicts[t]}{mark}")
        return "\n".join(lines)

    def where(self, step: int) -> str:
        """``S (position P)``; the resume scenario's step 0 says it is the resumed chunk, not a prefill."""
        if step == 0 and self.name == "resume":
            at = self._focus_position(0)
            return f"0 (the resumed chunk, prompt position {at}, after a prefill of 0-{self.first_row - 1})"
        return f"{step} (position {self._focus_position(step)})"

    def summary(self) -> str:
        """One paragraph: the verdict, the first divergent step, its deviation and the context tokens."""
        if self.verdict == "skipped":
            return f"scenario {self.name!r}: skipped ({'; '.join(self.notes)})"
        T = self.prompt.shape[0]
        head = f"scenario {self.name!r} ({self.mode}): {self.verdict}"
        if self.split is not None:
            head += f" (prompt split {self.split} + {T - self.split})"
        focus = self.focus_step()
        if focus is None:
            worst = float(self.deviation.max())
            if self.mode == "control":
                most = float(self.ratio.max())
                return (
                    f"{head}; every step within {self.margin:g}x its bound (worst deviation {worst:.4g}, "
                    f"largest ratio {most:.3g})"
                )
            return f"{head}; all {self.deviation.shape[0]} steps bit-identical to the recompute"
        if self.mode == "control":
            what = "first bug step" if self.first_bug_step is not None else "first inconclusive step"
        else:
            what = "first divergent step"
        msg = f"{head}; {what} {self.where(focus)}: max |cached - recompute| = {self.deviation[focus]:.6g}"
        if self.mode == "control":
            msg += (
                f", {self.ratio[focus]:.4g}x its bound {self.bound[focus]:.4g} (rounding <= {self.margin:g}x, "
                f"bug > {self.decisive:g}x; bound from {self.floor_source[focus]})"
            )
            if self.first_bug_step is not None and self.first_divergent_step is not None:
                msg += f"; first nonzero deviation at step {self.first_divergent_step}"
        ctx = self.context(focus)
        shown = ", ".join(map(str, ctx[-24:]))
        more = f"... ({ctx.shape[0] - 24} earlier) " if ctx.shape[0] > 24 else ""
        msg += f"\ncontext tokens up to position {ctx.shape[0] - 1}: [{more}{shown}]"
        return msg

    def _focus_position(self, step: int) -> str:
        if step == 0 and self.first_divergent_position is not None and self.mode == "exact":
            return str(self.first_divergent_position)
        return self.position(step)

    def context(self, step: int) -> np.ndarray:
        """The tokens the model had seen when step ``step``'s logits were computed."""
        if step == 0:
            return (
                self.prompt
                if self.first_divergent_position is None
                else self.prompt[: self.first_divergent_position + 1]
            )
        return np.concatenate([self.prompt, self.tokens[:step]])


@dataclass(frozen=True)
class CheckReport:
    """The result of :func:`check_cache`: one :class:`ScenarioReport` per scenario, and the overall verdict.

    ``verdict`` is ``exact`` or ``divergent`` (exact mode), ``rounding``,
    ``inconclusive`` or ``bug`` (control mode: the worst scenario's).
    ``passed``: ``exact`` or ``rounding``; with a logic check (``promoted``, the
    same check on the model in float64), an ``inconclusive`` native verdict
    passes when the logic check says ``rounding``, and a logic-check ``bug``
    fails. ``tokens`` are the tokens fed to ``decode`` (``steps`` of them).
    ``path`` is ``fast`` or ``per-step`` (``per-step`` if any scenario needed
    it). ``logits_format``: the format the model's logits came in.
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

    @property
    def passed(self) -> bool:
        if self.promoted is not None:
            if not self.promoted.passed:
                return False
            return self.verdict in ("exact", "rounding", "inconclusive")
        return self.verdict in ("exact", "rounding")

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def first_divergent_step(self) -> int | None:
        """The earliest first divergent step over the scenarios (``None``: every step equal)."""
        found = [s.first_divergent_step for s in self.scenarios.values() if s.first_divergent_step is not None]
        return min(found) if found else None

    @property
    def first_bug_step(self) -> int | None:
        """Control mode: the earliest step judged a bug over the scenarios."""
        found = [s.first_bug_step for s in self.scenarios.values() if s.first_bug_step is not None]
        return min(found) if found else None

    @property
    def worst(self) -> ScenarioReport:
        """The scenario a failure message is about (the earliest failure; else the first scenario run)."""
        ran = [s for s in self.scenarios.values() if s.verdict != "skipped"]
        failing = [s for s in ran if not s.passed]
        bugs = [s for s in failing if s.verdict == "bug"] or failing
        if bugs:
            return min(bugs, key=lambda s: s.focus_step())
        return ran[0]

    @property
    def deviation(self) -> np.ndarray:
        """Per-step deviation of :attr:`worst`."""
        return self.worst.deviation

    @property
    def max_deviation(self) -> float:
        """The largest deviation over every step of every scenario that ran."""
        return max(float(s.deviation.max()) for s in self.scenarios.values() if s.verdict != "skipped")

    @property
    def max_ratio(self) -> float:
        """Control mode: the largest ratio over every step of every scenario that ran."""
        return max(float(s.ratio.max()) for s in self.scenarios.values() if s.ratio is not None)

    def headline(self) -> str:
        """Which scenario diverged (or failed) first, and each scenario's first step on its own."""
        ran = [s for s in self.scenarios.values() if s.verdict != "skipped"]
        parts = [
            f"{s.name}: {s.verdict}" + ("" if s.focus_step() is None else f" from step {s.where(s.focus_step())}")
            for s in ran
        ]
        failing = [s for s in ran if s.focus_step() is not None]
        if not failing:
            return "; ".join(parts)
        first = self.worst if not self.worst.passed else min(failing, key=lambda s: s.focus_step())
        return f"first in scenario {first.name!r}, step {first.where(first.focus_step())}; " + "; ".join(parts)

    def format(self) -> str:
        """The full readable report: a verdict line, each scenario's summary, the worst scenario's table."""
        names = ", ".join(self.scenarios)
        lines = [
            f"kvfast check ({self.mode} mode, {self.path} reference, {self.steps} decode steps, "
            f"prompt of {self.prompt.shape[0]} tokens, {self.logits_format} logits, scenarios: {names}): "
            f"{self.verdict.upper()}",
            self.headline(),
        ]
        lines += [s.summary() for s in self.scenarios.values()]
        lines += [f"note: {n}" for n in self.notes]
        worst = self.worst
        lines.append(f"per-step table ({worst.name!r}):")
        lines.append(worst.table())
        if self.promoted is not None:
            lines.append(f"logic check in float64 (same tokens): {self.promoted.verdict.upper()}")
            lines += ["  " + line for line in self.promoted.format().splitlines()[1:]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _run_cache_path(
    model,
    scenario: str,
    prompt: np.ndarray,
    split: int,
    steps: int,
    vocab: int,
    choose: Callable[[int, np.ndarray], int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fill the cache for the prompt, then decode ``steps`` tokens.

    ``choose(t, logits)`` gives the token fed at decode step ``t + 1`` from the
    cache's logits of step ``t``. Returns the prompt rows ``(T, V)``, the decode
    logits ``(steps, V)`` and the fed tokens ``(steps,)``.
    """
    T = prompt.shape[0]
    if scenario == "decode":
        first = check_logits(model.prefill(prompt), "prefill", T, vocab, "of the prompt")
    else:
        a = check_logits(model.prefill(prompt[:split]), "prefill", split, vocab, "of the first chunk (resume)")
        if has(model, "extend"):
            b = check_logits(model.extend(prompt[split:]), "extend", T - split, vocab, "of the second chunk (resume)")
        else:
            b = np.stack(
                [
                    check_logits(
                        model.decode(int(tok)), "decode", None, vocab, f"of prompt position {split + i} (resume)"
                    )
                    for i, tok in enumerate(prompt[split:])
                ]
            )
        first = np.concatenate([a, b])
    outs = np.empty((steps, vocab))
    fed = np.empty(steps, dtype=np.int64)
    last = first[-1]
    for t in range(1, steps + 1):
        tok = int(choose(t - 1, last))
        fed[t - 1] = tok
        last = check_logits(model.decode(tok), "decode", None, vocab, f"at step {t} (position {T + t - 1})")
        outs[t - 1] = last
    return first, outs, fed


def _deviations(first: np.ndarray, outs: np.ndarray, rows: np.ndarray, start: int = 0) -> tuple[np.ndarray, int | None]:
    """Per-step max |cache - reference| (step 0 over prompt rows ``start..T-1``) and the first differing
    prompt row (or ``None``)."""
    T = first.shape[0]
    dev = np.empty(outs.shape[0] + 1)
    diff0 = np.abs(first[start:] - rows[start:T]).max(axis=1)
    dev[0] = diff0.max()
    dev[1:] = np.abs(outs - rows[T:]).max(axis=1)
    bad_rows = np.nonzero(diff0 > 0)[0]
    return dev, (start + int(bad_rows[0]) if bad_rows.size else None)


def _per_step_rows(
    model, prompt: np.ndarray, rows: np.ndarray, tokens: np.ndarray, start: int, vocab: int, greedy: bool = True
) -> None:
    """Fill ``rows[start:]`` by one recompute per position; with ``greedy``, also the tokens they choose
    (else ``tokens`` are given)."""
    T = prompt.shape[0]
    steps = tokens.shape[0]
    for p in range(start, T + steps):
        seq = np.concatenate([prompt, tokens[: p - T + 1]])
        rows[p] = check_logits(model.recompute(seq), "recompute", p + 1, vocab, f"of the first {p + 1} tokens")[-1]
        if greedy and p - T + 1 < steps:
            tokens[p - T + 1] = int(np.argmax(rows[p]))


def _invariance(
    model, final: np.ndarray, full: np.ndarray, ref0: np.ndarray, steps: int, vocab: int
) -> tuple[str | None, dict[int, np.ndarray]]:
    """``(None, parts)`` if the recompute is append-invariant at the checked prefixes, else ``(why, parts)``;
    ``parts`` maps each prefix length checked to its recompute's rows."""
    T = ref0.shape[0]
    parts = {T: ref0}
    why = None
    if not np.array_equal(ref0, full[:T]):
        dev = float(np.abs(ref0 - full[:T]).max())
        why = f"recompute(prompt) differs from the first {T} rows of recompute(whole sequence) by {dev:.4g}"
    q = T + max(1, steps // 4)
    if q < final.shape[0]:
        parts[q] = check_logits(model.recompute(final[:q]), "recompute", q, vocab, f"of the first {q} tokens")
        if why is None and not np.array_equal(parts[q], full[:q]):
            dev = float(np.abs(parts[q] - full[:q]).max())
            why = f"recompute(first {q} tokens) differs from the same rows of recompute(whole sequence) by {dev:.4g}"
    return why, parts


def _batch_shape_noise(
    model, final: np.ndarray, full: np.ndarray, parts: dict[int, np.ndarray], steps: int, vocab: int
) -> dict[str, np.ndarray]:
    """Batch-shape noise from a few prefix recomputes (those of the invariance check, and two more)
    against the same rows of the whole-sequence recompute ``full``; per position, 0 where not measured."""
    n = final.shape[0]
    T = min(parts)
    for q in (T + steps // 2, T + (3 * steps) // 4):
        if T < q < n and q not in parts:
            parts[q] = check_logits(model.recompute(final[:q]), "recompute", q, vocab, f"of the first {q} tokens")
    noise = np.zeros(n)
    for q, part in parts.items():
        noise[:q] = np.maximum(noise[:q], np.abs(part - full[:q]).max(axis=1))
    return {f"batch shape ({len(parts)} prefix recomputes)": noise}


# --- the public checks ---------------------------------------------------------------------


def _check_scenarios(scenarios: object) -> tuple[str, ...]:
    if isinstance(scenarios, str):
        scenarios = (scenarios,)
    if not isinstance(scenarios, Sequence) or not scenarios:
        raise not_allowed("scenarios", scenarios, f"a non-empty subset of {SCENARIOS}")
    out = []
    for s in scenarios:
        require_choice(s, "scenarios", SCENARIOS)
        if s in out:
            raise ValueError(f"scenarios: {s!r} appears twice; allowed: each scenario once")
        out.append(s)
    return tuple(out)


def as_model_under_test(model):
    """``model`` (a Hugging Face model wrapped in :class:`kvfast.check.hf.HFModel`) seen through
    :class:`kvfast.check.protocol.GuardedModel`: its own exceptions and exits become
    :class:`~kvfast.check.protocol.ModelUnderTestError`. ``ValueError`` if it is not a model under test."""
    from kvfast.check.hf import is_hf_model

    if isinstance(model, GuardedModel):
        return model
    if is_hf_model(model):
        from kvfast.check.hf import HFModel

        adapter = call_model("kvfast.check.hf.HFModel(model)", HFModel, model, passthrough=(ValueError,))
        return guard(adapter, passthrough=(ValueError,))  # the adapter's ValueErrors are bad input
    require_model(model)
    return guard(model)


def _check_continuation(continuation: object, steps: int | None) -> tuple[np.ndarray | None, int]:
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


def check_cache(
    model,
    prompt,
    steps: int | None = None,
    mode: str = "exact",
    scenarios: Sequence[str] | str = SCENARIOS,
    *,
    fast: bool = True,
    split: int | None = None,
    margin: float = C.DEFAULT_MARGIN,
    decisive: float = C.DEFAULT_DECISIVE,
    continuation=None,
    promote: str | None = None,
    follow: str = "recompute",
    keep_logits: bool = False,
    timeout: float | None = None,
) -> CheckReport:
    """Compare a model's cache path with its full recompute at every step; return a :class:`CheckReport`.

    - ``model``: see :mod:`kvfast.check.protocol`; a Hugging Face causal LM is
      wrapped in :class:`kvfast.check.hf.HFModel` (order-noise variants included).
    - ``prompt``: a non-empty 1-D sequence of token ids in ``[0, V)``.
    - ``steps``: decode steps to check (>= 1); the model sees
      ``len(prompt) + steps`` positions. Optional with ``continuation``.
    - ``mode``: ``"exact"`` (``==`` at every step) or ``"control"`` (rounding,
      inconclusive or bug against the model's order noise; ``margin`` and
      ``decisive`` as documented in :mod:`kvfast.check.control`).
    - ``scenarios``: ``"decode"`` (prefill the prompt, then decode) and/or
      ``"resume"`` (prefill ``prompt[:split]``, then ``extend`` with the rest,
      or feed the rest through ``decode`` if the model has no ``extend``; then
      decode). ``split`` defaults to ``len(prompt) // 2``; a one-token prompt
      cannot be split: the resume scenario is then reported as skipped beside
      ``decode``, and asking for it alone is bad input.
    - ``continuation``: the tokens to feed ``decode`` (at least ``steps``)
      instead of greedy ones (random-weight models repeat one token greedily).
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
      recompute of that same sequence; exact mode only). See the module doc.
    - ``keep_logits``: keep each scenario's cache logits and reference rows in
      its report (``cache_logits``, ``reference``).

    - ``timeout``: seconds the whole check may take (``None``: no limit); a
      model call still running then ends with :class:`CheckTimeout` naming it
      (a ``SIGALRM`` timer: main thread only; see
      :func:`kvfast.check.protocol.watched`).

    Bad input (a missing method, logits of the wrong shape or not finite, a
    token out of range, an empty prompt, an unknown mode) raises ``ValueError``.
    Anything the model's own code raises, ``SystemExit`` and ``KeyboardInterrupt``
    included, raises :class:`ModelUnderTestError` chained from it.
    """
    with watched(timeout):
        return _check_cache(
            model, prompt, steps, mode, scenarios, fast=fast, split=split, margin=margin, decisive=decisive,
            continuation=continuation, promote=promote, follow=follow, keep_logits=keep_logits,
        )  # fmt: skip


def _check_cache(
    model, prompt, steps, mode, scenarios, *, fast, split, margin, decisive, continuation, promote, follow, keep_logits
) -> CheckReport:
    """:func:`check_cache`'s work (inside its watch)."""
    model = as_model_under_test(model)
    prompt = check_prompt(prompt)
    given, steps = _check_continuation(continuation, steps)
    mode = require_choice(mode, "mode", MODES)
    scenarios = _check_scenarios(scenarios)
    for name, flag in (("fast", fast), ("keep_logits", keep_logits)):
        if not isinstance(flag, bool):
            raise not_allowed(name, flag, "True or False")
    if follow not in FOLLOW:
        raise not_allowed("follow", follow, ", ".join(FOLLOW))
    if follow == "cache" and mode != "exact":
        raise ValueError(f"follow: 'cache' is not allowed with mode={mode!r}; allowed: mode='exact'")
    if follow == "cache" and given is not None:
        raise ValueError("follow: 'cache' is not allowed with a continuation; allowed: follow='recompute'")
    if promote is not None:
        require_choice(promote, "promote", PROMOTE)
        if not has(model, "promote"):
            raise not_allowed("promote", promote, f"None for {model_name(model)} (it has no promote(dtype) method)")
    margin = C.check_margin(margin)
    decisive = C.check_margin(decisive, "decisive", margin)
    T = prompt.shape[0]
    if T == 1 and scenarios == ("resume",):
        raise ValueError(
            "scenarios: ('resume',) cannot run on a one-token prompt (nothing to split); "
            "allowed: a prompt of 2 or more tokens, or the 'decode' scenario"
        )
    if split is None:
        split = T // 2
    elif T == 1:
        raise not_allowed("split", split, "None (a one-token prompt cannot be split)")
    else:
        split = require_int(split, "split", 1, T - 1)
    vocab = vocab_of(model)
    check_range(prompt, vocab)
    limit = getattr(model, "max_positions", None)
    if isinstance(limit, int) and T + steps > limit:
        raise not_allowed(
            "steps", steps, f"at most {limit - T} (the model has {limit} positions; the prompt takes {T})"
        )
    if given is not None:
        check_range(given, vocab, "continuation")
    if follow == "cache":
        return _check_following_cache(model, prompt, steps, scenarios, fast, split, vocab, keep_logits)

    notes: list[str] = []
    rows = np.empty((T + steps, vocab))
    tokens = np.empty(steps, dtype=np.int64)
    raw = model.recompute(prompt)
    fmt = logits_format(raw)
    rows[:T] = check_logits(raw, "recompute", T, vocab, "of the prompt")
    if given is not None:
        tokens[:] = given
    else:
        tokens[0] = int(np.argmax(rows[T - 1]))
    path = "per-step"
    reuse = None  # the fast path's decode-scenario run, when its tokens are the ones every scenario gets
    known = T
    batch_shape = None
    if fast:
        first_tok = int(tokens[0])

        def choose(t: int, out: np.ndarray) -> int:
            if given is not None:
                return int(given[t])
            return first_tok if t == 0 else int(np.argmax(out))

        spec = _run_cache_path(model, "decode", prompt, split, steps, vocab, choose)
        final = np.concatenate([prompt, spec[2]])
        full = check_logits(model.recompute(final), "recompute", T + steps, vocab, "of the whole sequence")
        why, parts = _invariance(model, final, full, rows[:T], steps, vocab)
        if why is None or mode == "control":
            path = "fast"
            if why is not None:
                # control mode's fast path: the whole-sequence recompute is the reference; the rows it would
                # have had in a shorter batch are order noise, measured from a few prefix recomputes
                batch_shape = _batch_shape_noise(model, final, full, parts, steps, vocab)
                notes.append(
                    f"recompute is not append-invariant ({why}); the reference is one recompute of the final "
                    f"sequence and its batch-shape noise comes from {len(parts)} prefix recomputes"
                )
                rows[:] = full
                tokens[:] = spec[2]
                known, reuse = T + steps, spec
            else:
                greedy = spec[2] if given is not None else np.argmax(full[T - 1 : T + steps - 1], axis=1)
                wrong = np.nonzero(greedy != spec[2])[0]
                j = steps if wrong.size == 0 else int(wrong[0])
                rows[T : T + j] = full[T : T + j]
                n_ok = min(j + 1, steps)  # tokens chosen from valid rows
                tokens[:n_ok] = greedy[:n_ok]
                known = T + j
                if j == steps:
                    reuse = spec
                else:
                    notes.append(
                        f"the cache's greedy token differs from the recompute's at step {j}; the reference "
                        "continues per step from there and the scenarios ran again on the recompute's tokens"
                    )
        else:
            notes.append(f"recompute is not append-invariant ({why}); used one recompute per step")
    if known < T + steps:
        _per_step_rows(model, prompt, rows, tokens, known, vocab, greedy=given is None)
    final = np.concatenate([prompt, tokens])

    sources = None
    if mode == "control":
        if batch_shape is None and path == "per-step":
            full = check_logits(model.recompute(final), "recompute", T + steps, vocab, "of the whole sequence")
            batch_shape = {"batch shape (whole-sequence recompute)": np.abs(full - rows).max(axis=1)}
        sources, floor_notes = C.order_noise(model, prompt, final, rows, vocab, batch_shape)
        notes += floor_notes
        scale = np.where(np.abs(rows).max(axis=1) > 0, np.abs(rows).max(axis=1), np.inf)
        if sources:
            listed = ", ".join(f"{k} (up to {float((v / scale).max()):.3g} relative)" for k, v in sources.items())
            notes.append(f"order noise measured from: {listed}; pooled over the run")

    reports: dict[str, ScenarioReport] = {}
    for name in scenarios:
        if name == "resume" and T < 2:
            reports[name] = ScenarioReport(
                name, mode, prompt, tokens, np.zeros(0), (), "skipped", None, None,
                notes=("the prompt has one token and cannot be split in two chunks",),
            )  # fmt: skip
            continue
        if name == "decode" and reuse is not None:
            first, outs, _ = reuse
        else:
            first, outs, _ = _run_cache_path(model, name, prompt, split, steps, vocab, lambda t, out: int(tokens[t]))
        start = split if name == "resume" else 0
        dev, bad_row = _deviations(first, outs, rows, start)
        judged = (sources, rows, fmt, margin, decisive) if mode == "control" else None
        reports[name] = _judge(name, mode, prompt, tokens, dev, bad_row, judged, split, model)
        if keep_logits:
            reports[name] = replace(reports[name], cache_logits=np.concatenate([first, outs]), reference=rows.copy())
    verdict = _overall(mode, reports)
    promoted = None
    if promote is not None:
        promoted = _check_cache(
            model.promote(promote), prompt, steps, "control", scenarios, fast=fast, split=split, margin=margin,
            decisive=decisive, continuation=tokens, promote=None, follow="recompute", keep_logits=False,
        )  # fmt: skip
    elif mode == "control" and verdict == "inconclusive" and fmt in ("bfloat16", "float16"):
        notes.append(
            f"the {fmt} verdict is inconclusive: run the logic check in float64 (promote='float64', "
            "--promote on the command line), where a cache logic bug stands far above rounding"
        )
    elif mode == "control" and verdict == "rounding" and fmt in ("bfloat16", "float16"):
        notes.append(
            f"{fmt} logits resolve only a few significant digits: a cache logic bug can hide below {margin:g} "
            "units in their last place; the logic check in float64 (promote='float64') rules it out"
        )
    return CheckReport(mode, prompt, tokens, reports, verdict, path, tuple(notes), fmt, promoted)


def _overall(mode: str, reports: dict[str, ScenarioReport]) -> str:
    ran = [r for r in reports.values() if r.verdict != "skipped"]
    if mode == "exact":
        return "exact" if all(r.verdict == "exact" for r in ran) else "divergent"
    return C.worst([r.verdict for r in ran])


def _check_following_cache(model, prompt, steps, scenarios, fast, split, vocab, keep_logits) -> CheckReport:
    """:func:`check_cache` with ``follow="cache"`` (exact mode): each scenario decodes its own greedy
    tokens and is compared with the recompute of its own sequence (see the module doc)."""
    T = prompt.shape[0]
    notes: list[str] = []
    raw = model.recompute(prompt)
    ref0 = check_logits(raw, "recompute", T, vocab, "of the prompt")
    reports: dict[str, ScenarioReport] = {}
    paths = []
    for name in scenarios:
        if name == "resume" and T < 2:
            reports[name] = ScenarioReport(
                name, "exact", prompt, np.zeros(0, dtype=np.int64), np.zeros(0), (), "skipped", None, None,
                notes=("the prompt has one token and cannot be split in two chunks",),
            )  # fmt: skip
            continue
        first, outs, fed = _run_cache_path(model, name, prompt, split, steps, vocab, lambda t, out: int(np.argmax(out)))
        final = np.concatenate([prompt, fed])
        why = "fast=False"
        if fast:
            rows = check_logits(model.recompute(final), "recompute", T + steps, vocab, "of the whole sequence")
            why, _ = _invariance(model, final, rows, ref0, steps, vocab)
            if why is not None:
                notes.append(
                    f"scenario {name!r}: recompute is not append-invariant ({why}); used one recompute per step"
                )
        if why is not None:
            rows = np.empty((T + steps, vocab))
            rows[:T] = ref0
            _per_step_rows(model, prompt, rows, fed, T, vocab, greedy=False)
        paths.append("fast" if why is None else "per-step")
        dev, bad_row = _deviations(first, outs, rows, split if name == "resume" else 0)
        report = _judge(name, "exact", prompt, fed, dev, bad_row, None, split, model)
        if keep_logits:
            report = replace(report, cache_logits=np.concatenate([first, outs]), reference=rows)
        reports[name] = report
    ran = [r for r in reports.values() if r.verdict != "skipped"]
    path = "fast" if all(p == "fast" for p in paths) else "per-step"
    return CheckReport(
        "exact", prompt, ran[0].tokens, reports, _overall("exact", reports), path, tuple(notes), logits_format(raw)
    )


def _judge(name, mode, prompt, tokens, dev, bad_row, judged, split, model) -> ScenarioReport:
    differs = np.nonzero(dev > 0)[0]
    first = int(differs[0]) if differs.size else None
    notes: tuple[str, ...] = ()
    resume_split = None
    if name == "resume":
        resume_split = split
        notes = (f"step 0 judges the resumed chunk's rows {split}-{prompt.shape[0] - 1} only (the first chunk is a "
                 "plain prefill, judged in the 'decode' scenario)",)  # fmt: skip
        if not has(model, "extend"):
            notes += ("the model has no extend(); the second chunk of the prompt went through decode()",)
    if mode == "exact":
        verdicts = tuple("divergent" if d > 0 else "exact" for d in dev)
        return ScenarioReport(
            name, mode, prompt, tokens, dev, verdicts, "divergent" if first is not None else "exact", first, bad_row,
            split=resume_split, notes=notes,
        )  # fmt: skip
    sources, rows, fmt, margin, decisive = judged
    T = prompt.shape[0]
    start = resume_split or 0
    scale_pos = np.abs(rows).max(axis=1)
    noise_pos = np.zeros(rows.shape[0])
    for v in sources.values():
        noise_pos = np.maximum(noise_pos, v)
    scale = np.concatenate([[scale_pos[start:T].max()], scale_pos[T:]])
    floor = np.concatenate([[noise_pos[start:T].max()], noise_pos[T:]])
    rel, where = C.pooled_noise(sources, scale_pos)
    bound, ratio, verdicts, floor_source = C.judge(dev, scale, rel, where, fmt, margin, decisive)
    bugs = [t for t, v in enumerate(verdicts) if v == "bug"]
    unsure = [t for t, v in enumerate(verdicts) if v == "inconclusive"]
    return ScenarioReport(
        name, mode, prompt, tokens, dev, verdicts, C.worst(verdicts), first, bad_row,
        floor=floor, bound=bound, ratio=ratio, first_bug_step=bugs[0] if bugs else None, margin=margin,
        split=resume_split, notes=notes, floor_source=floor_source,
        first_inconclusive_step=unsure[0] if unsure else None, decisive=decisive,
    )  # fmt: skip


def assert_cache_exact(model, prompt, steps: int, **kwargs) -> CheckReport:
    """:func:`check_cache` in exact mode; raise ``AssertionError`` with the report unless every step is equal.

    The message names the first divergent step, its deviation and the context
    tokens, followed by a short per-step table. Returns the report on success.
    """
    if kwargs.get("mode", "exact") != "exact":
        raise ValueError(f"mode: {kwargs['mode']!r} is not allowed here; allowed: 'exact' (use check_cache)")
    kwargs.pop("mode", None)
    report = check_cache(model, prompt, steps, mode="exact", **kwargs)
    if not report.passed:
        raise AssertionError(report.format())
    return report
