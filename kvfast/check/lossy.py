"""Lossy (quantized) caches: an approximation by design, with a verdict of its own, ``lossy``.

A model whose cache stores its keys and values in a lossy format declares it: the optional attribute
``lossy_cache`` (a format name; :class:`~kvfast.check.hf.HFModel` reads it from a ``QuantizedCache``'s
layers) and the hook ``lossless()`` (the same model, bug included, with its cache unquantized). Such a
model's cache can never equal the recompute, so no scenario of it is ever ``exact`` or ``rounding``.
Each scenario is run three times on the same tokens:

- the model's own (lossy) cache path;
- the lossless twin's: judged against the recompute by the usual machinery (a logic bug of the twin is
  the model's: its step verdict stands, ``divergent`` / ``inconclusive`` / ``bug``);
- the expected error of the format: the twin with kvfast's own round trip of every stored key and value
  through the format (:func:`round_trip`; the twin's hook ``with_lossy_cache(fmt)``, built in for kvfast's
  own model and Hugging Face models).

Step ``t``'s ``deviation`` is the MEASURED error, ``max |lossy - lossless|`` over the step's logits; its
``floor`` the EXPECTED error, ``max |emulated - lossless|``; ``bound`` the larger of the expected error,
the step's order-noise bound (control mode) and one unit in the last place of the logits' format;
``ratio = deviation / bound``. Step verdicts: ``lossy`` (ratio <= margin: as good as the format allows),
``inconclusive`` (<= decisive) or ``bug`` (worse than the format allows); in exact mode ``lossy`` or
``divergent``. A model without ``with_lossy_cache`` on its twin has no expected error: every step is
then judged against the order noise and the format's resolution alone, and a note says so.

Formats (:data:`~kvfast.check.lossy_formats.LOSSY_FORMATS`): ``int8`` (symmetric, scale ``absmax / 127``,
round half to even) and ``fp8`` (float8 e4m3: 3 mantissa bits, scale ``absmax / 448``), each per row
(one position of one head, or of the whole model for kvfast's own cache) with its own scale; and
``fp8-tensor`` (transformers' fp8 ``QuantizedCache``: one scale per layer's keys and values, frozen at
the first store, so rows far below the tensor's largest value fall into fp8's subnormals). Measured on the tiny models
(``tests/check/test_check_lossy.py``): kvfast's own int8 and fp8 caches are ``lossy`` at ratio 1 (they are the
format's emulation); an "int8" cache that stores 4 bits is ``bug``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvfast.check.adapters import KvfastModel
from kvfast.check.check_report import ControlDetail, ScenarioReport
from kvfast.check.formats import ulp
from kvfast.check.judge import Judge, Part
from kvfast.check.lossy_formats import LOSSY_FORMATS, ROW_FORMATS, round_trip  # noqa: F401 - re-exported
from kvfast.check.protocol import ModelCalls, read_attribute
from kvfast.check.scenarios import REGISTRY, branches
from kvfast.check.subject import CheckSubject, as_model_under_test
from kvfast.validation import not_allowed


class LossyKvfastModel(KvfastModel):
    """kvfast's own model with a lossy cache: every key and value row it stores (prefill, extend, decode) is
    round-tripped through ``fmt`` (:data:`LOSSY_FORMATS`) once stored; the positions a call computes attend
    their fresh rows. Takes :class:`KvfastModel`'s arguments. The bugs of :mod:`kvfast.bugs.lossy` act in
    the hook ``_stored_format``."""

    def __init__(self, config, params: dict, numerics="f64", bug=None, decode_numerics=None, *,
                 fmt: str = "int8") -> None:  # fmt: skip
        super().__init__(config, params, numerics, bug, decode_numerics)
        if fmt not in ROW_FORMATS:
            raise ValueError(f"fmt: {fmt!r} is not allowed; allowed: {', '.join(ROW_FORMATS)}")
        self.lossy_cache = fmt

    def __repr__(self) -> str:
        return f"LossyKvfastModel({self.numerics.name}, {self.lossy_cache})"

    def _stored_format(self) -> str:
        """Hook: the format every stored row is round-tripped through (the declared one, ``lossy_cache``)."""
        return self.lossy_cache

    def _storing(self, call, tokens, start: int | None = None) -> np.ndarray:
        """``call(tokens)``, then the rows it stored (from ``start``, else the cache's length before it) round-
        tripped."""
        start = self._cache().length if start is None else start
        out = call(tokens)
        cache, fmt = self.cache, self._stored_format()
        for arr in (cache.k, cache.v):
            arr[:, start : cache.length] = round_trip(fmt, arr[:, start : cache.length])
        return out

    def prefill(self, tokens) -> np.ndarray:
        return self._storing(super().prefill, tokens, 0)

    def extend(self, tokens) -> np.ndarray:
        return self._storing(super().extend, tokens)

    def decode(self, token) -> np.ndarray:
        return self._storing(super().decode, token)

    def lossless(self) -> KvfastModel:
        """The same model (bug included) with an exact cache."""
        return KvfastModel(self.config, self.params, self.numerics, self.bug, self.decode_numerics)

    def promote(self, dtype: str = "float64") -> LossyKvfastModel:
        return with_lossy_cache(super().promote(dtype), self.lossy_cache)


def with_lossy_cache(model: KvfastModel, fmt: str) -> LossyKvfastModel:
    """kvfast's own model with kvfast's own round trip of ``fmt`` (the expected error of the format)."""
    return LossyKvfastModel(model.config, model.params, model.numerics, model.bug, model.decode_numerics, fmt=fmt)


#: The formats a model may declare its cache lossy in (``lossy_cache``): kvfast's emulated ones and the integer
#: formats of transformers' quantized caches (quanto, HQQ: ``int2`` to ``int7``), each one :func:`round_trip` takes.
DECLARED_FORMATS = (*LOSSY_FORMATS, *(f"int{bits}" for bits in range(2, 8)))


def lossy_format(calls: ModelCalls) -> str | None:
    """The format the model declares its cache lossy in (``lossy_cache``; ``None``: absent or ``None``), read as
    the model's code (:func:`~kvfast.check.protocol.read_attribute`). Anything but ``None`` or a name of
    :data:`DECLARED_FORMATS` is a ``ValueError`` naming ``model.lossy_cache`` (a typo never makes a lossy cache
    judged as a lossless one), and so is a lossy cache declared without ``lossless()``."""
    fmt = read_attribute(calls.model, "lossy_cache")
    if fmt is not None and not (isinstance(fmt, str) and fmt in DECLARED_FORMATS):
        raise not_allowed("model.lossy_cache", fmt, f"None or a format name: {', '.join(DECLARED_FORMATS)}")
    if fmt is not None and not calls.has("lossless"):
        raise ValueError(
            f"model.lossy_cache: {fmt!r} declared without a lossless() method; allowed: a model with "
            "lossless() (the same model with its cache unquantized), or no lossy_cache"
        )
    return fmt


def _twin_calls(calls: ModelCalls, fmt: str | None = None) -> ModelCalls | None:
    """The lossless twin's calls (``fmt``: the twin with kvfast's round trip of ``fmt``; ``None`` if the twin
    cannot take it)."""
    twin = calls.model.lossless()
    if fmt is not None:
        raw = getattr(twin, "wrapped", twin)
        if isinstance(raw, KvfastModel):
            twin = with_lossy_cache(raw, fmt)
        elif callable(getattr(raw, "with_lossy_cache", None)):
            twin = raw.with_lossy_cache(fmt)
        else:
            return None
    return ModelCalls(as_model_under_test(twin), calls.vocab)


def _runs(calls: ModelCalls, subject: CheckSubject, name: str, tokens: np.ndarray):
    """Report ``name``'s cache path on ``calls``, fed ``tokens`` (a second branch: its scenario's run's branch)."""
    owner = branches()
    scenario = REGISTRY[owner.get(name, name)]
    run = scenario.run(calls, subject.prompt, subject.split, subject.steps, lambda t, out: int(tokens[t]))
    return run.branch if name in owner else run


def _step_rows(run, first_row: int) -> list[np.ndarray]:
    return [run.prompt_rows[first_row:]] + list(run.decoded)


def _errors(a, b, first_row: int) -> np.ndarray:
    return np.array(
        [np.abs(x - y).max() for x, y in zip(_step_rows(a, first_row), _step_rows(b, first_row), strict=True)]
    )


def lossy_report(
    subject: CheckSubject,
    report: ScenarioReport,
    twin_report: ScenarioReport | None,
    runs: dict,
    fmt: str,
    cache_fmt: str,
    judge: Judge,
) -> ScenarioReport:
    """``report`` judged as a lossy cache's (see the module doc): ``runs`` holds the ``lossy``, ``lossless``
    and (optional) ``emulated`` paths; ``twin_report`` the lossless path against the recompute; ``fmt`` the
    logits' format, ``cache_fmt`` the cache's; ``judge`` the check's."""
    first = report.first_row
    measured = _errors(runs["lossy"], runs["lossless"], first)
    expected = _errors(runs["emulated"], runs["lossless"], first) if runs.get("emulated") else np.zeros_like(measured)
    scale = np.array([np.abs(r).max() for r in _step_rows(runs["lossless"], first)])
    bound = np.maximum(expected, ulp(fmt, scale))
    if twin_report is not None:  # at least the twin's order-noise bound
        bound = np.maximum(bound, twin_report.detail.noise_bound())
    ratio = measured / bound
    verdicts = judge.lossy_verdicts(ratio)
    if twin_report is not None:  # a logic bug of the lossless twin is the model's
        verdicts = [
            v if tv in ("exact", "rounding") else tv for v, tv in zip(verdicts, twin_report.step_verdicts, strict=True)
        ]
    order = ("lossy", "inconclusive", "divergent", "bug")
    worst = max(verdicts, key=order.index)
    source = tuple(
        "expected error of the format" if e >= b else "order noise or resolution"
        for e, b in zip(expected, bound, strict=True)
    )
    note = (
        f"a lossy cache ({cache_fmt}): deviation is the measured error against the same cache unquantized "
        "(lossless()), floor the expected error of the format (kvfast's own round trip of every stored key and "
        "value); never exact or rounding"
    )
    notes = report.notes + (note,)
    if runs.get("emulated") is None:
        notes += ("no expected error: the lossless twin has no with_lossy_cache(); judged against the noise alone",)
    bounds = ControlDetail(expected, bound, ratio, source, judge.margin, judge.decisive)
    return replace(
        report, deviation=measured, step_verdicts=tuple(verdicts), verdict=worst,
        detail=judge.lossy_detail(bounds, report.detail), notes=notes,
        first_divergent_step=int(np.nonzero(measured > 0)[0][0]) if (measured > 0).any() else None,
    )  # fmt: skip


def rejudge(subject: CheckSubject, reference, reports: dict, fmt: str, judge: Judge, cache_fmt: str) -> dict:
    """Every report of a model with a lossy cache judged as such (see the module doc); skipped ones stay.
    ``fmt``: the logits' format; ``judge``: the check's (the lossless twin's logic is judged by it); ``cache_fmt``:
    the cache's declared format (:func:`lossy_format`)."""
    owner = branches()
    twin, emulated = _twin_calls(subject.calls), _twin_calls(subject.calls, cache_fmt)
    out = {}
    for name, report in reports.items():
        if report.verdict == "skipped":
            out[name] = report
            continue
        tokens = reports[owner[name]].tokens if name in owner else report.tokens  # a branch is run by its op
        runs = {"lossy": _runs(subject.calls, subject, name, tokens), "lossless": _runs(twin, subject, name, tokens)}
        runs["emulated"] = None if emulated is None else _runs(emulated, subject, name, tokens)
        twin_report = None
        if name not in owner:
            rows = reference.rows_for(name, runs["lossless"])
            split = subject.split if REGISTRY[name].first_row(subject.split) else None
            part = Part(name, subject.prompt, runs["lossless"].path, rows, reference.noise, split)
            twin_report = judge.judge(part, fmt)
        out[name] = lossy_report(subject, report, twin_report, runs, fmt, cache_fmt, judge)
    return out
