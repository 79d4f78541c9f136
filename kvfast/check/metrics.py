"""Detector metrics: recall, precision, false-positive rate, ROC AUC (Mann-Whitney, ties half), steps to detection.

A leaf: it imports nothing from kvfast, so the checker's scoring
(:mod:`kvfast.check.score`) and the detector study both use it.

A detector gives each case a boolean *flag* and a real *score* for ranking;
a *label* says which cases are positives. Every function here takes plain
sequences (lists, NumPy arrays, pandas Series) and returns floats; a rate
whose denominator is zero is ``nan`` (for example precision when nothing is
flagged, FPR when there are no negatives).

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
from dataclasses import asdict, dataclass

import numpy as np


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
