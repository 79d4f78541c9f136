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

The pipeline. A check is: choose the scenarios, run each, judge each, report.
This module is that pipeline and nothing else: the options, one validated
object (:mod:`kvfast.check.options`), are resolved against the model and the
prompt (:mod:`kvfast.check.subject`); every model call returns validated
logits (:class:`kvfast.check.protocol.ModelCalls`); each scenario is a unit in
:mod:`kvfast.check.scenarios` that says whether it can run and runs its cache
path; the reference and the order noise are found in
:mod:`kvfast.check.reference`; the judge, chosen once from the options
(:mod:`kvfast.check.judge`), judges every scenario the same way (a lossy cache
is then re-judged as one, :mod:`kvfast.check.lossy`); :mod:`kvfast.check.check_report`
holds the report and its rendering. The float64 logic check (``promote``) is a
second run of this same pipeline on the promoted model.

Skipped is never passed. A scenario that cannot run on the model (a missing
hook, a hook that raises ``NotImplementedError``, a one-token prompt for
``resume``) is reported ``skipped`` with the reason; the check then passes
only on the scenarios that ran, and its report says which were skipped in its
first lines. A check in which no requested scenario ran is ``unchecked``
(:data:`~kvfast.check.check_report.UNCHECKED`), which never passes; with
``strict=True`` any skipped scenario makes it ``unchecked``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kvfast.check import control as C
from kvfast.check.check_report import LENGTH_DEPENDENT, UNCHECKED, CheckReport, ScenarioReport, deciding, skipped
from kvfast.check.formats import formats_of
from kvfast.check.judge import Judge, Part, judge_for
from kvfast.check.lossy import lossy_format, rejudge
from kvfast.check.options import SCENARIOS, CheckOptions
from kvfast.check.protocol import CheckPlan, ModelUnderTestError, watched
from kvfast.check.reference import OwnReference, Reference, SharedReference
from kvfast.check.scenarios import REGISTRY, Run, Scenario, Unsupported
from kvfast.check.subject import CheckSubject, as_model_under_test, resolve  # noqa: F401 - the check study's name


def check_cache(
    model,
    prompt,
    steps: int | None = None,
    mode: str = "auto",
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
    strict: bool = False,
) -> CheckReport:
    """Compare a model's cache path with its full recompute at every step; return a :class:`CheckReport`.

    - ``model``: see :mod:`kvfast.check.protocol`; a Hugging Face causal LM is
      wrapped in :class:`kvfast.check.hf.HFModel` (order-noise variants included).
    - ``prompt``: a non-empty 1-D sequence of token ids in ``[0, V)``.
    - every other argument is a field of :class:`~kvfast.check.options.CheckOptions`
      (documented there): ``steps`` (decode steps, optional with a
      ``continuation``), ``mode`` (``exact`` or ``control``), ``scenarios``
      (``decode``, ``resume``), ``fast``, ``split``, ``margin``, ``decisive``,
      ``continuation``, ``promote`` (the float64 logic check), ``follow``
      (``recompute`` or ``cache``), ``keep_logits``, ``strict`` and ``timeout`` (seconds;
      a model call still running then ends with :class:`CheckTimeout` naming
      it). :func:`check_cache_with` takes them as one object.

    Bad input (a missing method, logits of the wrong shape or not finite, a
    token out of range, an empty prompt, an unknown mode) raises ``ValueError``.
    Anything the model's own code raises, ``SystemExit`` and ``KeyboardInterrupt``
    included, raises :class:`ModelUnderTestError` chained from it.
    """
    # the signature above is the front door (every option visible to help() and an editor), hence one more list
    options = CheckOptions(
        steps, mode, scenarios, fast=fast, split=split, margin=margin, decisive=decisive,
        continuation=continuation, promote=promote, follow=follow, keep_logits=keep_logits, timeout=timeout,
        strict=strict,
    )  # fmt: skip
    return check_cache_with(model, prompt, options)


def check_cache_with(model, prompt, options: CheckOptions) -> CheckReport:
    """:func:`check_cache` with its options as one validated :class:`~kvfast.check.options.CheckOptions`
    (what the ``kv_check`` fixture, ``kvfast check`` and the check study build)."""
    if not isinstance(options, CheckOptions):
        raise ValueError(f"options: {type(options).__name__} is not allowed; allowed: a CheckOptions")
    with watched(options.timeout):
        return _check(model, prompt, options)


def _check(model, prompt, options: CheckOptions) -> CheckReport:
    """:func:`check_cache_with`'s work (inside its watch): the check of the model, and with ``promote`` the logic
    check, a second check of the promoted model on the same tokens, joined to it (:func:`_joined`)."""
    subject = resolve(model, prompt, options)
    judge = judge_for(options)
    native, advice = _judged(subject, judge)
    if options.promote is None or options.follow == "cache" or not native.ran:  # follow="cache": no logic check
        return _joined(native, None, advice, options)
    inner = options.logic_check(judge.logic_check_mode, native.tokens, subject.split)
    promoted, skipped_note = _logic_check(subject, inner)
    if promoted is None:
        return _joined(native, None, [skipped_note, *advice], options)
    notes = []
    if promoted.logits_format != options.promote:
        notes.append(
            f"the model promoted to {options.promote} returned {promoted.logits_format} logits: the logic check "
            f"ran in {promoted.logits_format}, with {promoted.logits_format}'s resolution"
        )
    return _joined(native, promoted, notes, options)


def _judged(subject: CheckSubject, judge: Judge) -> tuple[CheckReport, list[str]]:
    """The check of ``subject`` as ``judge`` judges (the reference, the scenarios, their reports), and the advice
    its verdict gives where no logic check follows (:meth:`~kvfast.check.judge.Judge.advice`)."""
    options = subject.options
    prepared = []  # the model's own set-up for this check (its notes head the report's); its plan, only if it asks
    if subject.calls.has("prepare_check"):
        plan = CheckPlan(subject.prompt.copy(), subject.split, subject.steps, options.scenarios, judge.measures_noise)
        prepared = subject.calls.prepare(plan)
    lossy = lossy_format(subject.calls)  # a quantized cache (kvfast.check.lossy), its declaration read before any work
    prompt_rows, fmt = subject.calls.recompute(subject.prompt, "of the prompt", with_format=True)
    formats = formats_of(subject.calls.model, fmt)  # the noise model's formats: declared, measured or assumed
    kind = OwnReference if options.follow == "cache" else SharedReference  # whose tokens each scenario is fed
    reference = kind(subject, judge, prompt_rows, formats)
    parts = run_scenarios(subject, reference)
    judge = judge.settled([p for found in parts.values() if isinstance(found, list) for p in found])
    noise = judge.noise(reference)  # measured now, where the judge needs it (auto: only if not bit-exact)
    formats = formats.after_probe(noise)  # a measured rounding probe replaces the lowest format's ulp
    reports = judge_parts(parts, judge, noise, formats.floor)  # every bound >= 1 ulp of the floor format
    if lossy is not None:  # judged as a lossy cache's: verdict "lossy"
        reports = rejudge(subject, reference, reports, formats.floor, judge, lossy)
    ran = [r for r in reports.values() if r.verdict != "skipped"]
    verdict = judge.overall(ran) if ran else UNCHECKED
    notes = prepared + reference.notes + judge.noise_notes(formats)
    report = CheckReport(
        options.mode, subject.prompt, reference.tokens, reports, verdict, reference.path, tuple(notes), fmt,
        length_dependence=reference.length, formats=formats, strict=options.strict, how=judge.how,
    )  # fmt: skip
    return report, judge.advice(verdict, fmt)


def _joined(report: CheckReport, promoted: CheckReport | None, notes: list[str], options: CheckOptions) -> CheckReport:
    """``report`` with its logic check's report ``promoted`` (``None``: none ran) and ``notes`` joined: the deciding
    verdict (:func:`~kvfast.check.check_report.deciding`), the native one beside it, a length dependence either found;
    with ``strict``, a pass on part of what was asked is none."""
    length = report.length_dependence
    if promoted is not None and length is None and promoted.length_dependence is not None:
        length = replace(promoted.length_dependence, by=f"the logic check in {options.promote}")
    native = report.verdict
    verdict = deciding(native, promoted)
    if length is not None and report.ran:
        native = verdict = LENGTH_DEPENDENT
    # nothing to join in a check without a logic check, as the sweeps' are
    if promoted is not None or notes or length is not None or verdict != report.verdict or report.native is not None:
        report = replace(
            report, verdict=verdict, notes=report.notes + tuple(notes), promoted=promoted, length_dependence=length,
            native=None if native == verdict else native,
        )  # fmt: skip
    if options.strict and report.skipped and report.passed:  # strict: a pass on part of what was asked is none
        report = replace(report, verdict=UNCHECKED)  # (a failure stays the failure it found)
    return report


def run_scenarios(subject: CheckSubject, reference: Reference) -> dict[str, list[Part] | ScenarioReport]:
    """Each of the subject's scenarios run against ``reference``: ``{scenario: its parts}`` to judge (its path
    against the reference rows, and a second path's, :func:`_parts`), or its ``skipped`` report with the reason
    when it cannot run on this model."""
    found: dict[str, list[Part] | ScenarioReport] = {}
    for name in subject.options.scenarios:
        scenario = REGISTRY[name]
        why = scenario.skip_reason(subject.calls, subject.prompt)
        if why is None:
            try:
                run = reference.cache_run(scenario)
            except Unsupported as exc:
                why = str(exc)
        if why is not None:
            found[name] = skipped(name, subject.prompt, reference.skipped_tokens, why)
        else:
            found[name] = _parts(subject, reference, scenario, run)
    return found


def judge_parts(
    found: dict[str, list[Part] | ScenarioReport], judge: Judge, noise: dict[str, np.ndarray] | None, fmt: str
) -> dict[str, ScenarioReport]:
    """``{report name: report}``: every part of :func:`run_scenarios` judged by ``judge``, with the order
    ``noise`` around the reference rows (``None``: not measured) and ``fmt``, the format whose 1 ulp is the
    least bound of a step; a second path's noise is the run's pooled relative noise at its magnitudes."""
    reports: dict[str, ScenarioReport] = {}
    for name, parts in found.items():
        if isinstance(parts, ScenarioReport):
            reports[name] = parts
            continue
        main, *branches = parts
        reports[main.name] = judge.judge(main if main.noise is noise else replace(main, noise=noise), fmt)
        for part in branches:
            branch_noise = None
            if noise is not None:  # control mode: each source's largest relative draw over the run, at its magnitudes
                scale = np.abs(main.rows).max(axis=1)
                safe = np.where(scale > 0, scale, np.inf)
                branch_noise = {k: float((v / safe).max()) * np.abs(part.rows).max(axis=1) for k, v in noise.items()}
                note = (
                    part.notes[0] + "; its order noise is the run's pooled relative noise at this branch's magnitudes"
                )
                part = replace(part, notes=(note, *part.notes[1:]))
            reports[part.name] = judge.judge(replace(part, noise=branch_noise), fmt)
    return reports


def _parts(subject: CheckSubject, reference: Reference, scenario: Scenario, run: Run) -> list[Part]:
    """What ``scenario``'s ``run`` is judged as: its path against the reference rows, and its second path
    (:attr:`~kvfast.check.scenarios.Scenario.branch`) against the recompute of its own sequence (their order
    noise is set when they are judged: :func:`judge_parts`)."""
    split = scenario.first_row(subject.split) or None
    notes = scenario.judged_notes(subject.calls, subject.prompt, subject.split) + run.notes
    rows = reference.rows_for(scenario.name, run)
    keep = subject.options.keep_logits
    parts = [Part(scenario.name, subject.prompt, run.path, rows, None, split, notes, keep)]
    if run.branch is not None:
        prompt = scenario.branch_prompt(subject.prompt, subject.vocab)
        rows_b = reference.branch_rows(prompt, run.branch)
        note = scenario.branch_note(run)
        parts.append(Part(scenario.branch, prompt, run.branch, rows_b, None, None, (note,), keep))
    return parts


def _logic_check(subject, inner: CheckOptions) -> tuple[CheckReport | None, str]:
    """The logic check's report, or ``(None, note)`` when the promoted model cannot run (six MoE families and
    XGLM have no float64 kernels): the note names the call and the error, and the native verdict stands.
    ``promote`` itself raising is the model's failure (:class:`ModelUnderTestError`), and a timeout is never
    skipped."""
    dtype = subject.options.promote
    promoted = subject.calls.model.promote(dtype)
    try:
        report = _check(promoted, subject.prompt, inner)
    except (ModelUnderTestError, ValueError) as exc:
        why = " ".join(str(exc).split())
        return None, f"the logic check in {dtype} was skipped: the promoted model cannot run in {dtype} ({why})"
    if report.verdict == UNCHECKED:  # the promoted model declines every scenario: nothing to judge by
        why = "; ".join(f"{name}: {reason}" for name, reason in report.skipped.items())
        return None, f"the logic check in {dtype} was skipped: the promoted model ran no scenario ({why})"
    return report, ""


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
