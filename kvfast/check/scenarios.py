"""The scenarios of one check, in one loop for both ``follow`` modes: run each scenario's cache path,
compare it with its reference rows step by step, and judge it (exact: ``==``; control: against the
order noise, :mod:`kvfast.check.control`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvfast.check import control as C
from kvfast.check.cache_path import CachePath
from kvfast.check.lossy import lossy_format, rejudge
from kvfast.check.operations import check_operation
from kvfast.check.options import OPERATIONS
from kvfast.check.reference import Reference
from kvfast.check.report import ScenarioReport, skipped_resume
from kvfast.check.subject import CheckSubject


def check_scenarios(subject: CheckSubject, reference: Reference, fmt: str) -> dict[str, ScenarioReport]:
    """Each of the subject's scenarios run and judged against ``reference`` (``fmt``: the format the
    model's logits come in); a resume scenario on a one-token prompt is reported as skipped."""
    reports: dict[str, ScenarioReport] = {}
    for name in subject.options.scenarios:
        if name == "resume" and subject.T < 2:
            reports[name] = skipped_resume(subject.options.mode, subject.prompt, reference.skipped_tokens)
            continue
        if name in OPERATIONS:  # rollback, fork: kvfast.check.operations
            reports.update(check_operation(subject, reference, name, fmt, judge_scenario))
            continue
        run = reference.cache_run(name)
        rows = reference.rows_for(name, run)
        report = judge_scenario(subject, name, run, rows, reference.noise, fmt)
        if subject.options.keep_logits:
            report = replace(report, cache_logits=run.logits(), reference=rows.copy())
        reports[name] = report
    if lossy_format(subject.calls) is not None:  # a quantized cache: kvfast.check.lossy, verdict "lossy"
        reports = rejudge(subject, reference, reports, fmt, judge_scenario)
    return reports


def deviations(run: CachePath, rows: np.ndarray, start: int = 0) -> tuple[np.ndarray, int | None]:
    """Per-step max |cache - reference| (step 0 over prompt rows ``start..T-1``) and the first differing
    prompt row (or ``None``)."""
    first, outs = run.prompt_rows, run.decoded
    T = first.shape[0]
    dev = np.empty(outs.shape[0] + 1)
    diff0 = np.abs(first[start:] - rows[start:T]).max(axis=1)
    dev[0] = diff0.max()
    dev[1:] = np.abs(outs - rows[T:]).max(axis=1)
    bad_rows = np.nonzero(diff0 > 0)[0]
    return dev, (start + int(bad_rows[0]) if bad_rows.size else None)


def judge_scenario(
    subject: CheckSubject,
    name: str,
    run: CachePath,
    rows: np.ndarray,
    noise: dict[str, np.ndarray] | None,
    fmt: str,
) -> ScenarioReport:
    """Scenario ``name``'s report: ``run`` against the reference ``rows``; control mode judges each step
    against the order ``noise`` (:func:`kvfast.check.control.judge`)."""
    prompt, split, mode = subject.prompt, subject.split, subject.options.mode
    dev, bad_row = deviations(run, rows, split if name == "resume" else 0)
    differs = np.nonzero(dev > 0)[0]
    first = int(differs[0]) if differs.size else None
    notes: tuple[str, ...] = ()
    resume_split = None
    if name == "resume":
        resume_split = split
        notes = (f"step 0 judges the resumed chunk's rows {split}-{prompt.shape[0] - 1} only (the first chunk is a "
                 "plain prefill, judged in the 'decode' scenario)",)  # fmt: skip
        if not subject.calls.has("extend"):
            notes += ("the model has no extend(); the second chunk of the prompt went through decode()",)
    tokens = run.fed
    if mode == "exact":
        verdicts = tuple("divergent" if d > 0 else "exact" for d in dev)
        return ScenarioReport(
            name, mode, prompt, tokens, dev, verdicts, "divergent" if first is not None else "exact", first, bad_row,
            split=resume_split, notes=notes,
        )  # fmt: skip
    margin, decisive = subject.options.margin, subject.options.decisive
    T = prompt.shape[0]
    start = resume_split or 0
    scale_pos = np.abs(rows).max(axis=1)
    noise_pos = np.zeros(rows.shape[0])
    for v in noise.values():
        noise_pos = np.maximum(noise_pos, v)
    scale = np.concatenate([[scale_pos[start:T].max()], scale_pos[T:]])
    floor = np.concatenate([[noise_pos[start:T].max()], noise_pos[T:]])
    rel, where = C.pooled_noise(noise, scale_pos)
    compared = T - start + dev.shape[0] - 1  # the reference rows the steps cover
    bound, ratio, verdicts, floor_source = C.judge(
        dev, scale, rel, where, fmt, margin, decisive, compared, C.noise_draws(noise)
    )
    bugs = [t for t, v in enumerate(verdicts) if v == "bug"]
    unsure = [t for t, v in enumerate(verdicts) if v == "inconclusive"]
    return ScenarioReport(
        name, mode, prompt, tokens, dev, verdicts, C.worst(verdicts), first, bad_row,
        floor=floor, bound=bound, ratio=ratio, first_bug_step=bugs[0] if bugs else None, margin=margin,
        split=resume_split, notes=notes, floor_source=floor_source,
        first_inconclusive_step=unsure[0] if unsure else None, decisive=decisive,
    )  # fmt: skip
