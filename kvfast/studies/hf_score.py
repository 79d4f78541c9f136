"""The ``hf_score`` study: the anchors' cache tests scored on Hugging Face models, which detector finds which
injected cache bug (extra ``kvfast[hf]``).

One run is one case: a tiny random model (:mod:`kvfast.studies.hf_common`: ``family``, ``dtype``,
``attention``, weight ``seed``), the ``prompt``-th random prompt of the seed's stream (4 or 5 tokens,
``default_rng(2000 + seed)``) with a random continuation of ``steps`` tokens, and one bug of
:data:`kvfast.bugs.hf.HF_BUGS` injected into the cache path (``bug = "none"``: a clean control). Every
detector of :data:`DETECTORS` tests the case, each on a fresh :class:`~kvfast.check.hf.HFModel` with the
bug; a run stores each detector's ``<name>_flag``, ``<name>_score`` and ``<name>_step`` (null: it did not
fire, or gives no step).

The summary scores the stored detections through the one scoring path
(:func:`kvfast.bugs.score.score_rows`: recall, median steps to detection, ROC AUC, and the false-positive
rate on the clean controls, as :func:`kvfast.score_detector` does for kvfast's own models), per dtype and
attention implementation (each group's bugs against its own clean controls).

Detectors (the score ranks cases for the AUC):

- ``three_token_allclose``: three greedy tokens with the cache; decode step 1's logits against the
  recompute, ``allclose(atol=1e-5, rtol=1e-5)`` (what popular generation test suites do; the detector
  :func:`kvfast.bugs.score.one_step_allclose`); score: the largest deviation at step 1;
- ``hf_logits_and_ids``: Hugging Face's own generation tests: greedy generation of ``steps`` tokens with
  and without the cache; per-step logits compared with ``allclose(atol=1e-5, rtol=1e-5)``
  (``atol=rtol=1e-3`` for bfloat16, as its tests loosen for half precision) and token ids compared, both
  up to the first near-tie (a top-two gap of the recomputed logits below ``1e-3``, after which the ids may
  legitimately differ); score: the largest deviation compared;
- ``kvfast_exact``: :func:`kvfast.check_cache`, exact mode, both scenarios, the case's continuation;
  score: the largest deviation;
- ``kvfast_control``: control mode, both scenarios; flags ``bug``; score: the largest ratio;
- ``kvfast_promoted``: control mode plus the float64 logic check; flags a ``bug`` in either; score: the
  larger of the two largest ratios.

``kvfast study hf_score`` runs the built-in grid (``hf_score.toml``: Llama, GPT-2, Mistral, Qwen2, sdpa,
float32 and bfloat16, 2 seeds x 2 prompts, 16 steps, every bug and clean: 224 runs); it is not in
``kvfast reproduce`` (``Study.reproduce``: it needs torch and takes minutes).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.bugs.hf import HF_BUGS, inject_hf_bug
from kvfast.bugs.score import Detection, as_detection, one_step_allclose, score_rows, side_by_side
from kvfast.check.checker import check_cache
from kvfast.check.hf import HFModel
from kvfast.studies import hf_common as hf
from kvfast.studies.common import ok_rows, study_of, tabled
from kvfast.studies.criteria import EXACT, judged
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Claim, Fact, Figure

VERSION = "1"
ATOL = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 1e-3}
NEAR_TIE = 1e-3
PROMPT_STREAM = 2000
PROMPT_LENGTHS = (4, 5)
GROUPS = ("dtype", "attention")  # scored apart: each group's bugs against its own clean controls


class PromptOfConfig:
    """A scored case's ``steps``, ``prompt`` and ``continuation`` from its ``config`` (``seed``, ``prompt``,
    ``steps``): the study's prompt stream. Shared with :class:`kvfast.studies.op_score.OpCase`."""

    config: dict

    @property
    def steps(self) -> int:
        return int(self.config["steps"])

    @property
    def prompt(self) -> np.ndarray:
        return self._tokens()[0]

    @property
    def continuation(self) -> np.ndarray:
        return self._tokens()[1]

    def _tokens(self) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        return hf.prompt_and_continuation(PROMPT_STREAM, c["seed"], c["prompt"], c["steps"], PROMPT_LENGTHS)


@dataclass(frozen=True, eq=False)
class HFCase(PromptOfConfig):
    """One scored case (:class:`kvfast.bugs.score.Case`) from a run's config: a tiny model, a prompt, a
    continuation, a bug or ``None``."""

    config: dict = field(hash=False)

    @property
    def bug(self) -> str | None:
        return hf.bug_of(self.config)

    def model(self) -> HFModel:
        """A fresh adapter with the case's bug over the (shared, never modified) tiny model."""
        c = self.config
        return inject_hf_bug(HFModel(hf.base_model(c["family"], c["dtype"], c["attention"], c["seed"])), self.bug)


def _np(logits) -> np.ndarray:
    return logits.detach().double().numpy() if hasattr(logits, "detach") else np.asarray(logits, dtype=np.float64)


def hf_logits_and_ids(model: HFModel, case: HFCase) -> Detection:
    """Greedy with and without the cache; per-step allclose logits and equal ids, up to the first near-tie."""
    atol = ATOL.get(model.dtype, 1e-5)
    out = _np(model.prefill(case.prompt))[-1]
    seq = list(case.prompt)
    largest = 0.0
    for t in range(1, case.steps + 1):
        full = _np(model.recompute(np.asarray(seq)))[-1]
        top = np.sort(full)[-2:]
        if top[1] - top[0] < NEAR_TIE:  # a near tie: HF stops comparing ids (and logits) here
            break
        largest = max(largest, float(np.abs(out - full).max()))
        if not np.allclose(out, full, atol=atol, rtol=atol) or int(np.argmax(out)) != int(np.argmax(full)):
            return Detection(True, largest, t - 1)
        token = int(np.argmax(full))
        seq.append(token)
        out = _np(model.decode(token))
    return Detection(False, largest, None)


def kvfast_exact(model: HFModel, case: HFCase) -> Detection:
    """:func:`kvfast.check_cache` in exact mode over both scenarios; score: the largest deviation."""
    report = check_cache(model, case.prompt, mode="exact", continuation=case.continuation)
    return Detection(not report.passed, report.max_deviation, report.first_divergent_step)


def kvfast_control(model: HFModel, case: HFCase) -> Detection:
    """Control mode over both scenarios; flags a ``bug`` verdict; score: the largest ratio."""
    report = check_cache(model, case.prompt, mode="control", continuation=case.continuation)
    return Detection(report.verdict == "bug", report.max_ratio, report.first_bug_step)


def kvfast_promoted(model: HFModel, case: HFCase) -> Detection:
    """Control mode plus the float64 logic check; flags a ``bug`` in either; score: the larger largest ratio."""
    report = check_cache(model, case.prompt, mode="control", continuation=case.continuation, promote="float64")
    both = (report, report.promoted)
    steps = [r.first_bug_step for r in both if r.first_bug_step is not None]
    return Detection(bool(steps), max(r.max_ratio for r in both), min(steps) if steps else None)


DETECTORS = {  # each under its function's name; the three-token check is kvfast.bugs.score's
    "three_token_allclose": one_step_allclose,
    **{fn.__name__: fn for fn in (hf_logits_and_ids, kvfast_exact, kvfast_control, kvfast_promoted)},
}

CONFIG_FIELDS: dict[str, pa.DataType] = {**hf.MODEL_FIELDS, **hf.CASE_FIELDS}
DETECTION = {"flag": pa.bool_(), "score": pa.float64(), "step": pa.int64()}  # a detector's columns, each
RESULT_FIELDS: dict[str, pa.DataType] = {f"{name}_{col}": kind for name in DETECTORS for col, kind in DETECTION.items()}


def validate_config(config: dict) -> None:
    """``ValueError`` naming the field (or the missing torch) before any run."""
    hf.validate_model_and_case(config, "hf_score")


def run(config: dict) -> dict:
    """Every detector of :data:`DETECTORS` on the config's case, each on a fresh adapter: flag, score, step."""
    case = HFCase(dict(config))
    out = {}
    for name, detector in DETECTORS.items():
        det = as_detection(detector(case.model(), case), name)
        out.update({f"{name}_flag": det.flag, f"{name}_score": det.score, f"{name}_step": det.step})
    return out


def detections(runs: pd.DataFrame, name: str) -> pd.DataFrame:
    """One detector's stored detections as :func:`kvfast.bugs.score.score_rows` takes them (``bug``, ``flag``,
    ``score``, ``step``)."""
    return runs.rename(columns={f"{name}_{col}": col for col in DETECTION})[["bug", *DETECTION]]


@tabled()
def score_table(df: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """Per dtype and attention implementation (in the runs' order), :func:`kvfast.bugs.score.side_by_side` of
    every detector's :func:`~kvfast.bugs.score.score_rows` over its ok runs (its bugs against its clean
    controls): ``bug``, ``dtype``, ``attention``, ``cases``, then ``<detector>.recall/steps/auc/fpr``."""
    ok = hf.ordered_ok_rows(df)
    for key, runs in ok.groupby(list(GROUPS), sort=False) if len(ok) else ():
        if (runs["bug"] == hf.NO_BUG).all() or (runs["bug"] != hf.NO_BUG).all():
            continue  # a group needs clean controls and bugged cases to be scored
        part = side_by_side({name: score_rows(detections(runs, name), HF_BUGS) for name in DETECTORS})
        for i, (col, value) in enumerate(zip(GROUPS, key, strict=True)):
            part.insert(1 + i, col, value)
        yield part


def claims(df: pd.DataFrame) -> list[Claim]:
    """kvfast's control mode with the float64 logic check flags every injected bug and no clean control."""
    table = score_table(df)
    if not len(table):
        return []
    total = table[table["bug"] == "all"]
    recall = total["kvfast_promoted.recall"]
    fpr = total["kvfast_promoted.fpr"]
    return [
        judged(
            "Hugging Face models: control mode with the float64 logic check finds every injected cache bug",
            "(not in the seed)",
            f"recall {recall.min():.3f} (lowest over {len(total)} dtype/attention groups), FPR {fpr.max():.3f}",
            EXACT,
            [
                ("every run ok", len(ok_rows(df)) == len(df)),
                ("recall 1.0 in every group", bool((recall == 1.0).all())),
                ("no clean control flagged", bool((fpr == 0.0).all())),
            ],
        )
    ]


def facts(df: pd.DataFrame) -> list[Fact]:
    """Per dtype and attention: each detector's recall over all bugs and its FPR."""
    table = score_table(df)
    return [
        Fact(
            f"hf_score_{row['dtype']}_{row['attention']}",
            f"hf_score study, {row['dtype']} {row['attention']}: recall over all {int(row['cases'])} bugged "
            "cases (FPR on the clean controls)",
            "; ".join(f"{name} {row[f'{name}.recall']:.3f} (FPR {row[f'{name}.fpr']:.3f})" for name in DETECTORS),
        )
        for _, row in (table[table["bug"] == "all"] if len(table) else table).iterrows()
    ]


def _draw_recall(df: pd.DataFrame, table: pd.DataFrame):
    """Per dtype/attention group: each detector's recall per bug (grouped bars)."""
    groups = list(dict.fromkeys(zip(table["dtype"], table["attention"], strict=True)))
    fig, axes = pyplot().subplots(1, len(groups), figsize=(6.5 * len(groups), 4.2), squeeze=False)
    width = 0.8 / len(DETECTORS)
    for ax, (dtype, attention) in zip(axes[0], groups, strict=True):
        part = table[(table["dtype"] == dtype) & (table["attention"] == attention)]
        bugs = list(part["bug"])
        for i, name in enumerate(DETECTORS):
            x = np.arange(len(bugs)) + (i - (len(DETECTORS) - 1) / 2) * width
            ax.bar(x, part[f"{name}.recall"], width, label=name)
        ax.set_xticks(range(len(bugs)), bugs)
        ax.set(ylim=(0, 1.15), ylabel="recall", title=f"{dtype}, {attention}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    return fig


FIGURES = (
    Figure(
        "hf_score",
        "Hugging Face models: which cache test finds which injected cache bug",
        "Tiny random Llama, GPT-2, Mistral (sliding window) and Qwen2, each bug of the Hugging Face catalogue "
        "injected into the cache path only. Per bug, the share of cases each detector flags (recall); the table "
        "adds the median step of detection, the AUC against the clean controls and the false-positive rate. "
        "The three-token allclose test never resumes and compares one cached step, so bugs that act later or in "
        "a resume only pass it; control mode with the float64 logic check finds every bug.",
        score_table,
        _draw_recall,
    ),
)

STUDY = study_of(
    globals(),
    "hf_score",
    "cache tests scored on tiny Hugging Face models against injected cache bugs (needs kvfast[hf])",
    summarize=score_table,
    rank=110,
    reproduce=False,
)
