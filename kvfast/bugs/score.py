"""Scoring a cache test against a bug catalogue, in one module: the metrics, the built-in detectors,
:func:`score_detector` and :func:`compare_detectors`, and :func:`score_rows` for stored runs.

A *detector* is any function ``detector(model, case)`` that tests a model
under test (:mod:`kvfast.check.protocol`; here kvfast's own model with the
case's bug, :class:`~kvfast.check.KvfastModel`) on a case's prompt and step
count, and returns one of:

- a ``bool``: the flag (the score for ranking is 1.0 or 0.0);
- a number: the score; the flag is ``score > 0``;
- a :class:`Detection`: flag, score and the step at which it fired.

Each case is a catalogue bug (or ``None``, a clean control) on one small
model; the label is "a bug is present". :func:`score_detector` reports per bug:
recall (flagged bugged cases / bugged cases), steps-to-detection (median step
at which flagged cases fired) and ROC AUC of the scores against the clean
controls (Mann-Whitney, ties half: :func:`roc_auc`), and over all bugs also the
false-positive rate on the clean controls. The cases are always given here (the
catalogue knows no study): :func:`kvfast.score_detector` fills in the detector
study's (:func:`kvfast.studies.detector.default_cases`). The cases' bugs come from a
catalogue (``bugs=``: kvfast's :data:`~kvfast.model.bugs.BUGS` by default; the
``hf_score`` study scores Hugging Face models with :data:`kvfast.bugs.hf.HF_BUGS`).
:func:`score_rows` scores detections already made (a study's stored runs) the same way.

Built-in detectors (:data:`DETECTORS`):

- ``one_step_allclose``: what popular generation test suites do. Generate
  three tokens greedily with the cache and compare the logits of the ONE
  cached step (decode step 1) with the recompute, ``np.allclose`` with
  ``atol = rtol = 1e-5``.
- ``token_strings``: generate ``case.steps + 1`` tokens greedily with the
  cache and without, and compare the token strings.
- ``every_step_exact``: kvfast's check (:func:`kvfast.check_cache`, exact mode,
  the ``decode`` scenario) over ``case.steps`` decode steps: logits equal
  (``==``) at every step.

The metrics (:func:`roc_auc`, :func:`confusion`, :func:`median_detection_step`,
:func:`detector_metrics`) take plain sequences (lists, NumPy arrays, pandas
Series) and return floats; a rate whose denominator is zero is ``nan`` (for
example precision when nothing is flagged, FPR when there are no negatives).
ROC AUC is the Mann-Whitney statistic: the probability that a random
positive scores above a random negative, a tie counting one half,

    AUC = (#{(p, n): s_p > s_n} + 0.5 #{(p, n): s_p == s_n}) / (n_pos n_neg),

computed exactly: the numerator is counted in integers (in half units) from a
sort, and the result is one correctly rounded division. It equals the area
under the ROC curve with ties joined by straight lines (scikit-learn's
``roc_auc_score``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import pandas as pd

from kvfast.check.adapters import KvfastModel
from kvfast.check.checker import check_cache
from kvfast.check.protocol import check_logits, vocab_of
from kvfast.model.bugs import BUGS

ONE_STEP_ATOL = 1e-5
ONE_STEP_RTOL = 1e-5


# --- the metrics ------------------------------------------------------------------------------


def _as_labels(labels) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels: shape {arr.shape} is not allowed; allowed: a 1-D sequence of booleans")
    if arr.dtype != bool:
        if arr.dtype.kind not in "iu" or not np.isin(arr, (0, 1)).all():
            raise ValueError("labels: values other than True/False/0/1 are not allowed; allowed: booleans")
        arr = arr.astype(bool)
    return arr


def _as_scores(scores, n: int, field: str = "scores") -> np.ndarray:
    arr = np.asarray(scores, dtype=np.float64)
    if arr.shape != (n,):
        raise ValueError(f"{field}: shape {arr.shape} is not allowed; allowed: ({n},) like labels")
    if np.isnan(arr).any():
        raise ValueError(f"{field}: NaN is not allowed; allowed: real numbers (inf is fine)")
    return arr


def _as_flags(flags, n: int) -> np.ndarray:
    arr = np.asarray(flags)
    if arr.shape != (n,):
        raise ValueError(f"flags: shape {arr.shape} is not allowed; allowed: ({n},) like labels")
    if arr.dtype != bool:
        raise ValueError(f"flags: dtype {arr.dtype} is not allowed; allowed: booleans")
    return arr


def roc_auc(scores, labels) -> float:
    """Mann-Whitney ROC AUC of ``scores`` for ``labels`` (ties counted half); ``nan`` if a class is empty."""
    y = _as_labels(labels)
    s = _as_scores(scores, y.shape[0])
    n_pos = int(y.sum())
    n_neg = int(y.shape[0] - n_pos)
    if n_pos == 0 or n_neg == 0:
        return math.nan
    # For every distinct score value: how many negatives lie strictly below it, and how many equal it.
    neg = np.sort(s[~y])
    pos = s[y]
    below = np.searchsorted(neg, pos, side="left")
    equal = np.searchsorted(neg, pos, side="right") - below
    half_units = 2 * int(below.sum()) + int(equal.sum())
    return half_units / (2 * n_pos * n_neg)


@dataclass(frozen=True)
class Confusion:
    """Counts and rates of a flagging detector against labels."""

    n: int
    positives: int
    flagged: int
    tp: int
    fp: int
    tn: int
    fn: int
    recall: float
    precision: float
    fpr: float

    def as_dict(self) -> dict:
        return asdict(self)


def _ratio(a: int, b: int) -> float:
    return a / b if b else math.nan


def confusion(flags, labels) -> Confusion:
    """Recall ``tp/(tp+fn)``, precision ``tp/(tp+fp)`` and FPR ``fp/(fp+tn)`` of boolean ``flags``."""
    y = _as_labels(labels)
    f = _as_flags(flags, y.shape[0])
    tp = int((f & y).sum())
    fp = int((f & ~y).sum())
    fn = int((~f & y).sum())
    tn = int((~f & ~y).sum())
    return Confusion(
        n=int(y.shape[0]),
        positives=tp + fn,
        flagged=tp + fp,
        tp=tp,
        fp=fp,
        tn=tn,
        fn=fn,
        recall=_ratio(tp, tp + fn),
        precision=_ratio(tp, tp + fp),
        fpr=_ratio(fp, fp + tn),
    )


def median_detection_step(flags, steps) -> float:
    """The median of ``steps`` over the flagged cases that report a step (``None``/NaN: no step); ``nan`` if none."""
    f = np.asarray(flags, dtype=bool)
    s = np.asarray([np.nan if v is None else float(v) for v in steps], dtype=np.float64)
    if f.shape != s.shape:
        raise ValueError(f"steps: shape {s.shape} is not allowed; allowed: {f.shape} like flags")
    fired = s[f & ~np.isnan(s)]
    return float(np.median(fired)) if fired.size else math.nan


def detector_metrics(flags, scores, labels) -> dict:
    """:func:`confusion`'s fields plus ``auc`` (:func:`roc_auc` of ``scores``), as one dict."""
    out = confusion(flags, labels).as_dict()
    out["auc"] = roc_auc(scores, labels)
    return out


@dataclass(frozen=True)
class Detection:
    """A detector's answer: ``flag``, a ``score`` for ranking, and the ``step`` at which it fired (or ``None``)."""

    flag: bool
    score: float
    step: int | None = None


class Case(Protocol):
    """What a detector is given (besides the model): :class:`kvfast.studies.detector.DetectorCase` is one.

    ``config``: the case's fields (a row of the scored table); ``bug``: the
    catalogue bug, ``None`` for a clean control; ``steps``: decode steps;
    ``prompt``: int64 tokens; ``model()``: a fresh model under test with the bug.
    """

    config: dict
    bug: str | None
    steps: int
    prompt: np.ndarray

    def model(self) -> KvfastModel: ...


CASE_FIELDS = ("config", "bug", "steps", "prompt", "model")


# --- the built-in detectors ------------------------------------------------------------------


def _greedy(model, prompt: np.ndarray, n: int, vocab: int, cached: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``n`` greedy tokens, with the cache (a prefill, then a decode of each token but the last) or by recomputing
    the sequence for each; returns (tokens, logits (n, V)); logits[i] chose token i."""
    rows = np.empty((n, vocab))
    toks = np.empty(n, dtype=np.int64)
    seq = prompt
    for i in range(n):
        if not cached:
            rows[i] = check_logits(model.recompute(seq), "recompute", seq.shape[0], vocab)[-1]
        elif i == 0:
            rows[i] = check_logits(model.prefill(prompt), "prefill", prompt.shape[0], vocab)[-1]
        else:
            rows[i] = check_logits(model.decode(int(toks[i - 1])), "decode", None, vocab)
        toks[i] = int(np.argmax(rows[i]))
        seq = np.append(seq, toks[i])
    return toks, rows


def one_step_allclose(model, case) -> Detection:
    """Three greedy tokens with the cache; decode step 1's logits vs the recompute, allclose(atol=rtol=1e-5).

    The recompute is of the same sequence the cached run fed (its own tokens).
    """
    vocab = vocab_of(model)
    toks, rows = _greedy(model, case.prompt, 3, vocab)
    seq = np.append(case.prompt, toks[0])
    ref = check_logits(model.recompute(seq), "recompute", seq.shape[0], vocab)[-1]
    dev = float(np.abs(rows[1] - ref).max())
    flag = not np.allclose(rows[1], ref, atol=ONE_STEP_ATOL, rtol=ONE_STEP_RTOL)
    return Detection(flag, dev, 1 if flag else None)


def token_strings(model, case) -> Detection:
    """``case.steps + 1`` greedy tokens with the cache and without; flag when the strings differ.

    Score: the number of positions whose tokens differ; step: the first such position.
    """
    vocab = vocab_of(model)
    n = case.steps + 1
    cached, _ = _greedy(model, case.prompt, n, vocab)
    plain, _ = _greedy(model, case.prompt, n, vocab, cached=False)
    differ = np.nonzero(cached != plain)[0]
    return Detection(bool(differ.size), float(differ.size), int(differ[0]) if differ.size else None)


def every_step_exact(model, case) -> Detection:
    """kvfast's every-step exact check over ``case.steps`` decode steps (``decode`` scenario)."""
    report = check_cache(model, case.prompt, case.steps, mode="exact", scenarios=("decode",))
    return Detection(not report.passed, report.max_deviation, report.first_divergent_step)


#: The built-in detectors by name (each function's own).
DETECTORS: dict[str, Callable] = {d.__name__: d for d in (one_step_allclose, token_strings, every_step_exact)}


# --- scoring ----------------------------------------------------------------------------------


def as_detection(value: object, name: str) -> Detection:
    """A detector's return value as a :class:`Detection` (a bool: the flag; a number: the score; ``ValueError``
    naming detector ``name`` otherwise)."""
    if isinstance(value, Detection):
        return value
    if isinstance(value, bool | np.bool_):
        return Detection(bool(value), 1.0 if value else 0.0)
    if isinstance(value, int | float | np.integer | np.floating) and not np.isnan(value):
        return Detection(bool(value > 0), float(value))
    raise ValueError(f"detector {name}: returned {value!r}; allowed: a bool, a number (not NaN) or a Detection")


def _as_case(case: object) -> Case:
    if all(hasattr(case, name) for name in CASE_FIELDS):
        return case  # type: ignore[return-value]
    raise ValueError(
        f"cases: {type(case).__name__} is not allowed; allowed: cases with {', '.join(CASE_FIELDS)} "
        "(kvfast.studies.detector.DetectorCase)"
    )


def _catalogue(bugs: Sequence[str] | None) -> tuple[str, ...]:
    if bugs is None:
        return tuple(BUGS)
    if isinstance(bugs, str) or not all(isinstance(b, str) for b in bugs) or not bugs:
        raise ValueError(f"bugs: {bugs!r} is not allowed; allowed: None (kvfast.BUGS) or a sequence of bug names")
    return tuple(bugs)


def run_detector(detector: Callable, cases: Iterable, bugs: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per case: the case's fields plus ``flag``, ``score`` and ``step``.

    ``bugs``: the catalogue the cases' bugs come from (default :data:`kvfast.BUGS`; for Hugging Face
    models :data:`kvfast.bugs.hf.HF_BUGS`).
    """
    bugs = _catalogue(bugs)
    if not callable(detector):
        raise ValueError(f"detector: {detector!r} is not allowed; allowed: a function (model, case) -> result")
    name = getattr(detector, "__name__", repr(detector))
    rows = []
    for raw in cases:
        case = _as_case(raw)
        if case.bug is not None and case.bug not in bugs:
            raise ValueError(f"cases: bug {case.bug!r} is not allowed; allowed: None, {', '.join(bugs)}")
        det = as_detection(detector(case.model(), case), name)
        rows.append({**case.config, "bug": case.bug or "none", "flag": det.flag, "score": det.score,
                     "step": det.step})  # fmt: skip
    if not rows:
        raise ValueError("cases: empty; allowed: at least one bugged case and one clean case")
    return pd.DataFrame(rows)


def score_detector(detector: Callable, cases: Sequence[Case], bugs: Sequence[str] | None = None) -> pd.DataFrame:
    """Score ``detector`` over ``cases``: one row per bug, then ``all`` (:func:`score_rows` of
    :func:`run_detector`'s rows).

    :func:`kvfast.score_detector` is this with the detector study's cases as the default.

    Columns: ``bug``, ``cases``, ``recall``, ``steps_to_detection`` (median
    step at which flagged cases fired; NaN if none fired or the detector gives
    no steps), ``auc`` (the bug's scores against the clean controls'), and
    ``fpr`` (on the clean controls; on the ``all`` row). Needs clean controls
    (``bug=None``) and at least one bugged case. ``bugs``: the cases' catalogue
    (default :data:`kvfast.BUGS`), which also orders the rows.
    """
    return score_rows(run_detector(detector, cases, bugs), bugs)


def score_rows(df: pd.DataFrame, bugs: Sequence[str] | None = None) -> pd.DataFrame:
    """:func:`score_detector`'s table from detections already made: ``df`` has one row per case with
    ``bug`` (``"none"``: a clean control), ``flag``, ``score`` and ``step`` (``None``/NaN: no step).

    ``bugs``: the catalogue (default :data:`kvfast.BUGS`), which orders the rows; bugs absent from
    ``df`` get no row. Raises ``ValueError`` without both clean controls and bugged cases.
    """
    bugs = _catalogue(bugs)
    clean = df[df["bug"] == "none"]
    if clean.empty or len(clean) == len(df):
        raise ValueError("cases: need both clean controls (bug=None) and bugged cases; allowed: a mix of both")
    out = []
    groups = [(b, df[df["bug"] == b]) for b in bugs if (df["bug"] == b).any()]
    groups.append(("all", df[df["bug"] != "none"]))
    fpr = confusion(clean["flag"].to_numpy(bool), np.zeros(len(clean), bool)).fpr
    for bug, part in groups:
        both = pd.concat([part, clean])
        labels = np.r_[np.ones(len(part), bool), np.zeros(len(clean), bool)]
        out.append(
            {
                "bug": bug,
                "cases": len(part),
                "recall": confusion(part["flag"].to_numpy(bool), np.ones(len(part), bool)).recall,
                "steps_to_detection": median_detection_step(part["flag"].to_numpy(bool), part["step"].tolist()),
                "auc": roc_auc(both["score"].to_numpy(float), labels),
                "fpr": fpr if bug == "all" else float("nan"),
            }
        )
    return pd.DataFrame(out)


def compare_detectors(
    detectors: dict[str, Callable] | None, cases: Sequence[Case], bugs: Sequence[str] | None = None
) -> pd.DataFrame:
    """:func:`score_detector` for each detector (``None``: :data:`DETECTORS`) over ``cases``, side by side.

    One row per bug and ``all``; for each detector the columns
    ``<name>.recall``, ``<name>.steps`` (steps to detection) and ``<name>.auc``,
    and ``<name>.fpr`` (meaningful on the ``all`` row).
    """
    detectors = DETECTORS if detectors is None else detectors
    cases = list(cases)
    return side_by_side({name: score_detector(det, cases, bugs) for name, det in detectors.items()})


def side_by_side(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Detector name -> its :func:`score_rows` table, joined on ``bug`` as :func:`compare_detectors` shows them:
    ``bug``, ``cases``, then ``<name>.recall``, ``<name>.steps``, ``<name>.auc``, ``<name>.fpr`` per detector."""
    table = None
    for name, scored in tables.items():
        s = scored.set_index("bug")
        columns = {"recall": "recall", "steps_to_detection": "steps", "auc": "auc", "fpr": "fpr"}
        part = s[list(columns)].rename(columns={c: f"{name}.{short}" for c, short in columns.items()})
        table = part if table is None else table.join(part)
        if "cases" not in table.columns:
            table.insert(0, "cases", s["cases"])
    return table.reset_index()


def markdown(table: pd.DataFrame) -> str:
    """:func:`compare_detectors`'s table as Markdown: per detector recall / steps to detection / AUC, FPR.

    Columns before ``cases`` (``bug``, and any the caller inserted, such as a ``dtype``) are printed as they are.
    """
    names = [c[: -len(".recall")] for c in table.columns if c.endswith(".recall")]
    keys = list(table.columns[: list(table.columns).index("cases")])
    head = "| " + " | ".join(keys) + " | cases | " + " | ".join(f"{n}: recall, steps, AUC" for n in names) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1 + len(names))]

    def num(x: float, fmt: str) -> str:
        return "-" if np.isnan(x) else format(x, fmt)

    for _, row in table.iterrows():
        cells = [*(str(row[k]) for k in keys), str(int(row["cases"]))]
        for n in names:
            cell = f"{num(row[f'{n}.recall'], '.3f')}, {num(row[f'{n}.steps'], 'g')}, {num(row[f'{n}.auc'], '.3f')}"
            if row["bug"] == "all":
                cell += f" (FPR {num(row[f'{n}.fpr'], '.3f')})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
