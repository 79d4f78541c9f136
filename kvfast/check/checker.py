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

Layout. This module only orchestrates: the options, one validated object
(:mod:`kvfast.check.options`), are resolved against the model and the prompt
(:mod:`kvfast.check.subject`); every model call returns validated logits
(:mod:`kvfast.check.calls`); the cache path runs in :mod:`kvfast.check.cache_path`;
the reference and the order noise are found in :mod:`kvfast.check.reference`;
the scenarios run in one loop for both follow modes (:mod:`kvfast.check.scenarios`);
:mod:`kvfast.check.report` holds the report and its rendering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvfast.check import control as C
from kvfast.check.calls import as_model_under_test
from kvfast.check.formats import formats_of
from kvfast.check.options import MODES, SCENARIOS, CheckOptions
from kvfast.check.protocol import ModelUnderTestError, watched
from kvfast.check.reference import OwnReference, SharedReference
from kvfast.check.report import LENGTH_DEPENDENT, CheckReport, ScenarioReport, overall
from kvfast.check.scenarios import check_scenarios
from kvfast.check.subject import resolve


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
    - every other argument is a field of :class:`~kvfast.check.options.CheckOptions`
      (documented there): ``steps`` (decode steps, optional with a
      ``continuation``), ``mode`` (``exact`` or ``control``), ``scenarios``
      (``decode``, ``resume``), ``fast``, ``split``, ``margin``, ``decisive``,
      ``continuation``, ``promote`` (the float64 logic check), ``follow``
      (``recompute`` or ``cache``), ``keep_logits`` and ``timeout`` (seconds;
      a model call still running then ends with :class:`CheckTimeout` naming
      it). :func:`check_cache_with` takes them as one object.

    Bad input (a missing method, logits of the wrong shape or not finite, a
    token out of range, an empty prompt, an unknown mode) raises ``ValueError``.
    Anything the model's own code raises, ``SystemExit`` and ``KeyboardInterrupt``
    included, raises :class:`ModelUnderTestError` chained from it.
    """
    options = CheckOptions(
        steps, mode, scenarios, fast=fast, split=split, margin=margin, decisive=decisive,
        continuation=continuation, promote=promote, follow=follow, keep_logits=keep_logits, timeout=timeout,
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
    """:func:`check_cache_with`'s work (inside its watch): the reference, the scenarios, the logic check."""
    subject = resolve(model, prompt, options)
    prompt_rows, fmt = subject.calls.recompute_with_format(subject.prompt, "of the prompt")
    formats = formats_of(subject.calls.model, fmt)  # the noise model's formats: declared, measured or assumed
    if options.follow == "cache":
        reference = OwnReference(subject, prompt_rows, fmt, formats)
    else:
        reference = SharedReference.build(subject, prompt_rows, fmt, formats)
    formats = formats.after_probe(reference.noise)  # a measured rounding probe replaces the lowest format's ulp
    reports = check_scenarios(subject, reference, formats.floor)  # every bound >= 1 ulp of the floor format
    verdict = overall(options.mode, reports)
    length = reference.length
    notes = reference.notes
    if options.mode == "control":
        notes += [n for n in (formats.note(), formats.cache_note()) if n is not None]
    promoted = None
    if options.promote is not None and options.follow == "recompute":  # follow="cache" runs no logic check
        inner = replace(
            options, mode="control", continuation=tuple(reference.tokens.tolist()), promote=None,
            follow="recompute", keep_logits=False, timeout=None, split=subject.split,
        )  # fmt: skip
        promoted, skipped = _logic_check(subject, inner)
        if promoted is None:
            notes += [skipped] + _format_notes(options, verdict, fmt)
        elif promoted.logits_format != options.promote:
            notes.append(
                f"the model promoted to {options.promote} returned {promoted.logits_format} logits: the logic check "
                f"ran in {promoted.logits_format}, with {promoted.logits_format}'s resolution"
            )
        if promoted is not None and length is None and promoted.length_dependence is not None:
            length = replace(promoted.length_dependence, by=f"the logic check in {options.promote}")
    else:
        notes += _format_notes(options, verdict, fmt)
    if length is not None:
        verdict = LENGTH_DEPENDENT
    return CheckReport(
        options.mode, subject.prompt, reference.tokens, reports, verdict, reference.path, tuple(notes), fmt, promoted,
        length, formats,
    )  # fmt: skip


def _logic_check(subject, inner: CheckOptions) -> tuple[CheckReport | None, str]:
    """The logic check's report, or ``(None, note)`` when the promoted model cannot run (six MoE families and
    XGLM have no float64 kernels): the note names the call and the error, and the native verdict stands.
    ``promote`` itself raising is the model's failure (:class:`ModelUnderTestError`), and a timeout is never
    skipped."""
    dtype = subject.options.promote
    promoted = subject.calls.model.promote(dtype)
    try:
        return _check(promoted, subject.prompt, inner), ""
    except (ModelUnderTestError, ValueError) as exc:
        why = " ".join(str(exc).split())
        return None, f"the logic check in {dtype} was skipped: the promoted model cannot run in {dtype} ({why})"


def _format_notes(options: CheckOptions, verdict: str, fmt: str) -> list[str]:
    """Control mode on bfloat16/float16 logits: what the verdict cannot see, and the logic check that can."""
    if options.mode != "control" or fmt not in ("bfloat16", "float16"):
        return []
    if verdict == "inconclusive":
        return [
            f"the {fmt} verdict is inconclusive: run the logic check in float64 (promote='float64', "
            "--promote on the command line), where a cache logic bug stands far above rounding"
        ]
    if verdict == "rounding":
        return [
            f"{fmt} logits resolve only a few significant digits: a cache logic bug can hide below "
            f"{options.margin:g} units in their last place; the logic check in float64 (promote='float64') rules it out"
        ]
    return []


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


__all__ = [
    "MODES",
    "SCENARIOS",
    "CheckOptions",
    "CheckReport",
    "ScenarioReport",
    "as_model_under_test",
    "assert_cache_exact",
    "check_cache",
    "check_cache_with",
]
