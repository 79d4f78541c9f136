"""The detector study: the one-step and the every-step exact cache check, scored against the catalogue.

Cases (the grid ``detector.toml``): 8 bugs x 30 cases =
240 bugged runs, plus the same 30 cases with ``bug = "none"`` as clean
controls = 270 runs, for each model kind (``model``: ``random``, and
``trained``, the cycle-task model of :mod:`kvfast.studies.bugs`): 540 runs,
scored per model kind. The 30 cases are 3 depths x 2 head counts x 5 (seed,
prompt length) pairs, 16 greedy tokens each (15 decode steps), float64. The
seed's claims are judged on the random models (its first configuration); the
trained model is the closer configuration (large top-2 margins), and its
every-step figure, the one that comes closer to the seed's, is a row of its
own. Each run is a :mod:`kvfast.studies.bugs` run (same columns):
its per-step deviations are those of :func:`kvfast.check.check_cache` on
:class:`kvfast.check.KvfastModel` with the bug, so the every-step detector
scored here is the check users run.

Two detectors, no tolerance anywhere:

- **one-step**: flags a run if the cached logits differ (``!=``) from the
  recompute at the prefill (step 0: its rows) or decode step 1 (what a test
  with a one-token decode checks); its score is the max abs deviation there;
- **every-step**: flags a run if they differ at any step; its score is the
  max abs deviation over all steps.

Two labels: **output changed** (the generated tokens differ from the clean
run's; scored over the 240 bugged runs, the seed's population) and **bug
present** (scored over all 270 runs: 240 positives, 30 negatives). Metrics:
recall, precision, FPR (:func:`kvfast.bugs.score.confusion`) and ROC AUC
(Mann-Whitney, ties counted half: :func:`kvfast.bugs.score.roc_auc`).
Steps-to-detection of a run: its first deviating step (what a test's
generation length must reach to see the bug).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvfast.bugs import score
from kvfast.bugs.kvfast_model import BUGS, VISIBLE_AT_STEP_1
from kvfast.bugs.score import confusion, detector_metrics
from kvfast.check import KvfastModel
from kvfast.numerics import Numerics
from kvfast.studies import bugs as bugstudy
from kvfast.studies.common import listed, ok_rows, step_range, study_of, tabled
from kvfast.studies.criteria import EXACT, VS_SEED, judged, within
from kvfast.studies.plotting import COLORS, pyplot
from kvfast.sweep.grid import load_grid
from kvfast.sweep.study import Claim, Fact, Figure

VERSION = f"1.{bugstudy.VERSION}"  # its runs are bug-study runs

DETECTORS = ("one-step", "every-step")
LABELS = ("output changed", "bug present")

# The seed's figures (label "output changed", 240 cases of which 180 changed the output).
SEED_FIGURES: dict[str, dict[str, float]] = {
    "one-step": {"recall": 0.500, "auc": 0.605},
    "every-step": {"recall": 1.000, "auc": 1.000},
}
SEED_CASES = 240
SEED_CHANGED = 180
# The one-step claim holds when kvfast's recall and AUC are each within this of the seed's (stated a priori:
# about two binomial standard errors of a recall of 0.5 over 180 positives, sqrt(0.25 / 180) = 0.037).
SEED_TOLERANCE = 0.075
# The model kind the seed's claims are judged on (the configuration they were first measured on), and the
# closer configuration reported beside it.
CLAIMS_MODEL = "random"
CLOSER_MODEL = "trained"


@dataclass(frozen=True)
class DetectorCase:
    """One case for :func:`kvfast.bugs.score.score_detector`: a run config of this study (:mod:`kvfast.studies.bugs`
    keys).

    The config names the bug (``"none"``: a clean control), the model
    (``model``, ``seed``, ``n_layer``, ``n_head``, ``d_model``, ``d_ff``,
    ``vocab``, ``preset``), the prompt (``seed``, ``prompt_len``) and ``steps``,
    the number of greedy tokens generated (``steps - 1`` decode steps).
    Models and prompts come from :func:`kvfast.studies.bugs.model_for` and
    :func:`kvfast.studies.bugs.prompt_for`, as in the study. The study's own
    cases are its grid's random-model configs (``detector.toml``; :func:`default_cases`).
    """

    config: dict = field(hash=False)

    @property
    def bug(self) -> str | None:
        bug = self.config.get("bug", bugstudy.CONTROL)
        return None if bug in (None, bugstudy.CONTROL) else bug

    @property
    def steps(self) -> int:
        """Decode steps (the study's ``steps`` counts generated tokens, the first from the prefill)."""
        return int(self.config["steps"]) - 1

    @property
    def prompt(self) -> np.ndarray:
        return bugstudy.prompt_for(self.config)

    def model(self) -> KvfastModel:
        """A fresh kvfast model under test with this case's bug."""
        cfg, params = _model(tuple(sorted((k, v) for k, v in self.config.items() if k != "bug")))
        return KvfastModel(cfg, params, Numerics.preset(self.config["preset"]), bug=self.bug)


@functools.lru_cache(maxsize=64)
def _model(key: tuple) -> tuple:
    return bugstudy.model_for(dict(key))


def default_cases() -> list[DetectorCase]:
    """The detector study's cases: the random-model configs of its grid ``detector.toml``, in the grid's order
    (240 bugged, then 30 clean controls).

    8 bugs and a clean control x 3 depths x 2 head counts x 5 (seed, prompt
    length) pairs on random float64 models (d_model 16, d_ff 32, vocab 32),
    16 generated tokens (15 decode steps).
    """
    return [DetectorCase(c) for c in load_grid("detector").configs if c["model"] == "random"]


def _cases(cases: Iterable | None) -> list:
    return default_cases() if cases is None else [DetectorCase(c) if isinstance(c, dict) else c for c in cases]


def score_detector(detector: Callable, cases: Sequence | None = None) -> pd.DataFrame:
    """:func:`kvfast.bugs.score.score_detector` over ``cases`` (default :func:`default_cases`; config dicts allowed).
    ``kvfast.score_detector`` is this."""
    return score.score_detector(detector, _cases(cases))


def compare_detectors(detectors: dict[str, Callable] | None = None, cases: Sequence | None = None) -> pd.DataFrame:
    """:func:`kvfast.bugs.score.compare_detectors` (default :data:`kvfast.bugs.score.DETECTORS`) over ``cases``
    (default :func:`default_cases`; config dicts allowed). ``kvfast.compare_detectors`` is this."""
    return score.compare_detectors(detectors, _cases(cases))


def scored(df: pd.DataFrame) -> pd.DataFrame:
    """The ok runs of ``df`` with each detector's flag and score and each label, as columns:
    ``one_step_flag``, ``one_step_score``, ``every_step_flag``, ``every_step_score``,
    ``output_changed``, ``bug_present``, ``steps_to_detection`` (first deviating step, -1 if none)."""
    out = ok_rows(df).copy()
    first = out["first_bad_step"].astype(np.int64)
    dev = out["dev_per_step"].map(lambda d: np.asarray(d, dtype=np.float64))
    out["one_step_flag"] = (first >= 0) & (first <= 1)
    out["one_step_score"] = dev.map(lambda d: float(d[:2].max()))
    out["every_step_flag"] = first >= 0
    out["every_step_score"] = out["dev_all"].astype(np.float64)
    out["output_changed"] = out["tokens_changed"].astype(bool)
    out["bug_present"] = out["bug"] != bugstudy.CONTROL
    out["steps_to_detection"] = first
    return out


def model_kinds(s: pd.DataFrame) -> list[str]:
    """The model kinds present in scored runs ``s``, in :data:`kvfast.studies.bugs.MODEL_KINDS` order."""
    present = set(s["model"])
    return [m for m in bugstudy.MODEL_KINDS if m in present]


def _population(s: pd.DataFrame, label: str) -> pd.DataFrame:
    return s[s["bug_present"]] if label == "output changed" else s


@tabled()
def summarize(df: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """Per model kind (``model``): headline rows (``scope = "all"``: each detector under each label) then per-bug
    rows (``scope`` = the bug, label "bug present": the share of its runs each detector flags and the steps it
    needs)."""
    s = scored(df)
    for model in model_kinds(s):
        yield _summarize_model(s[s["model"] == model], model)


def _metrics_row(model: str, det: str, scope: str, label: str, metrics: dict, steps: str, seed: dict) -> dict:
    """A summary row: a detector's metrics (``auc`` NaN where not measured) over one model kind, scope and label."""
    counts = {k: metrics[k] for k in ("positives", "flagged", "recall", "precision", "fpr")}
    return {
        "model": model,
        "detector": det,
        "scope": scope,
        "label": label,
        "cases": metrics["n"],
        **counts,
        "auc": metrics.get("auc", np.nan),
        "steps_to_detection": steps,
        "seed_recall": seed.get("recall", np.nan),
        "seed_auc": seed.get("auc", np.nan),
    }


@tabled()
def _summarize_model(s: pd.DataFrame, model: str) -> Iterator[dict]:
    for det, label in itertools.product(DETECTORS, LABELS):
        pop, key = _population(s, label), det.replace("-", "_")
        if pop.empty:
            continue
        y = pop[label.replace(" ", "_")].to_numpy(bool)
        m = detector_metrics(pop[f"{key}_flag"].to_numpy(bool), pop[f"{key}_score"].to_numpy(), y)
        flagged = pop.loc[pop[f"{key}_flag"], "steps_to_detection"]
        steps = step_range(flagged, median=True) if det == "every-step" else "1"
        yield _metrics_row(model, det, "all", label, m, steps, SEED_FIGURES[det] if label == "output changed" else {})
    for bug, det in itertools.product([*BUGS, bugstudy.CONTROL], DETECTORS):
        g, key = s[s["bug"] == bug], det.replace("-", "_")
        if g.empty:
            continue
        c = confusion(g[f"{key}_flag"].to_numpy(bool), g["bug_present"].to_numpy(bool)).as_dict()
        flagged = g.loc[g[f"{key}_flag"], "steps_to_detection"]
        yield _metrics_row(model, det, bug, "bug present", c, step_range(flagged, median=True), {})


@tabled()
def steps_to_detection(df: pd.DataFrame) -> Iterator[dict]:
    """Per model kind and bug: runs, how many changed the output, the every-step check's first firing step (min,
    median, max over the runs where it fires) and the share of runs the one-step check flags."""
    s = scored(df)
    for model, bug in itertools.product(model_kinds(s), [*BUGS, bugstudy.CONTROL]):
        g = s[(s["model"] == model) & (s["bug"] == bug)]
        if g.empty:
            continue
        f = g.loc[g["every_step_flag"], "steps_to_detection"]
        yield {
            **bugstudy.bug_key(model, bug),
            "runs": len(g),
            "output_changed": int(g["output_changed"].sum()),
            "one_step_flagged": int(g["one_step_flag"].sum()),
            "every_step_flagged": int(g["every_step_flag"].sum()),
            "steps_min": int(f.min()) if len(f) else -1,
            "steps_median": float(f.median()) if len(f) else np.nan,
            "steps_max": int(f.max()) if len(f) else -1,
        }


def _row(summary: pd.DataFrame, det: str, label: str, model: str = CLAIMS_MODEL) -> pd.Series | None:
    """The summary row of detector ``det`` over every run of ``model`` under ``label`` (``None`` if absent)."""
    if summary.empty:
        return None
    r = summary[(summary[["model", "detector", "scope", "label"]] == [model, det, "all", label]).all(axis=1)]
    return None if r.empty else r.iloc[0]


@listed
def claims(df: pd.DataFrame) -> Iterator[Claim]:
    """The seed's detector claims as measured on the :data:`CLAIMS_MODEL` runs (label "output changed" unless
    said otherwise), then the closer configuration's (:data:`CLOSER_MODEL`) every-step row.

    The one-step figures are compared with the seed's within :data:`SEED_TOLERANCE`; the every-step
    figures must equal 1.000 exactly (and FPR 0 on "bug present")."""
    summary = summarize(df)
    yield from _claims_model(df, summary)
    closer = _row(summary, "every-step", "output changed", CLOSER_MODEL)
    if closer is not None:
        s = scored(df)
        margin = float(s.loc[s["model"] == CLOSER_MODEL, "clean_margin_min"].median())
        figure = (
            f"recall {closer['recall']:.3f}, AUC {closer['auc']:.4f} ({int(closer['positives'])} of "
            f"{int(closer['cases'])} bugged runs changed the output; median top-2 margin {margin:.3g})"
        )
        yield _every_step_claim(closer, f'{CLOSER_MODEL} "cycle" model: ', figure)


def _claims_model(df: pd.DataFrame, summary: pd.DataFrame) -> Iterator[Claim]:
    s = scored(df)
    s = s[s["model"] == CLAIMS_MODEL]
    if s.empty:
        return
    bugged = s[s["bug_present"]]
    changed = int(bugged["output_changed"].sum())
    yield judged(
        "bugged runs whose generated output changed",
        f"{SEED_CHANGED} of {SEED_CASES}",
        f"{changed} of {len(bugged)}",
        VS_SEED,
        [
            (f"bugged runs == {SEED_CASES}", len(bugged) == SEED_CASES),
            (f"changed == {SEED_CHANGED}", changed == SEED_CHANGED),
        ],
    )
    found = [
        (_row(summary, "one-step", "output changed"), _one_step_claim),
        (_row(summary, "every-step", "output changed"), _every_step_claim),
        (_row(summary, "every-step", "bug present"), _bug_present_claim),
    ]
    yield from (claim(row) for row, claim in found if row is not None)
    growth = s[s["bug"].isin([b for b in BUGS if not VISIBLE_AT_STEP_1[b]])]
    if len(growth):
        caught = int(growth["one_step_flag"].sum())
        yield judged(
            "the one-step check catches none of the growth bugs",
            "0.0 at step 1 for freeze, evict, posfrozen",
            f"{caught} of {len(growth)} growth-bug runs flagged",
            EXACT,
            [("no growth-bug run flagged", caught == 0)],
        )


def _one_step_claim(one: pd.Series) -> Claim:
    """The one-step check's recall and AUC (``one``: its summary row) against the seed's, within tolerance."""
    seed = SEED_FIGURES["one-step"]
    tol = SEED_TOLERANCE
    return judged(
        "one-step exact check: recall and AUC as in the seed",
        f"recall {seed['recall']:.3f}, AUC {seed['auc']:.3f}",
        f"recall {one['recall']:.3f}, AUC {one['auc']:.3f}",
        VS_SEED,
        [
            (f"|recall - {seed['recall']:.3f}| <= {tol}", within(one["recall"], seed["recall"], tol)),
            (f"|AUC - {seed['auc']:.3f}| <= {tol}", within(one["auc"], seed["auc"], tol)),
        ],
    )


def _every_step_claim(every: pd.Series, about: str = "", figure: str = "") -> Claim:
    """The every-step check on the label "output changed" (``every``: its summary row; ``about``: which models,
    ``figure``: kvfast's figure in words): recall and AUC 1.000."""
    return judged(
        f"{about}every-step exact check: recall 1.000 and AUC 1.000",
        "recall 1.000, AUC 1.000",
        figure or f"recall {every['recall']:.3f}, AUC {every['auc']:.3f}",
        EXACT,
        [("recall == 1.000", bool(every["recall"] == 1.0)), ("AUC == 1.000", bool(every["auc"] == 1.0))],
    )


def _bug_present_claim(present: pd.Series) -> Claim:
    """The every-step check on the label "bug present" (``present``: its summary row): every bugged run
    flagged and no clean control."""
    return judged(
        'every-step exact check on the label "bug present" (bugged runs vs clean controls)',
        "recall 1.000 (no tolerance anywhere)",
        f"recall {present['recall']:.3f} ({int(present['positives'])} bugged), AUC {present['auc']:.3f}, "
        f"FPR {present['fpr']:.3f} ({int(present['cases'] - present['positives'])} clean)",
        EXACT,
        [
            ("recall == 1.000 (every bugged run flagged)", bool(present["recall"] == 1.0)),
            ("AUC == 1.000", bool(present["auc"] == 1.0)),
            ("FPR == 0 over at least one clean control", bool(present["fpr"] == 0.0)),
        ],
    )


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


def roc_points(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    """The ROC curve of ``scores`` for boolean ``labels``: (FPR, TPR) at every threshold, from (0, 0) to (1, 1).

    Tied scores form one step (a straight segment), so the area under the points is the Mann-Whitney AUC
    with ties counted half (:func:`kvfast.bugs.score.roc_auc`)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # the last index of each distinct score
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    tpr = np.r_[0.0, tp / max(int(y.sum()), 1)]
    fpr = np.r_[0.0, fp / max(int((~y).sum()), 1)]
    return fpr, tpr


@tabled(["model", "label", "detector", "point", "fpr", "tpr", "auc"])
def roc_table(df: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """Per model kind, label and detector: the ROC curve's points (``fpr``, ``tpr``) and the AUC."""
    s = scored(df)
    summary = summarize(df)
    for model, label, name in itertools.product(model_kinds(s), LABELS, DETECTORS):
        pop = _population(s[s["model"] == model], label)
        fpr, tpr = roc_points(pop[f"{name.replace('-', '_')}_score"].to_numpy(), pop[label.replace(" ", "_")])
        auc = float(_row(summary, name, label, model)["auc"])
        point = np.arange(fpr.size)
        yield pd.DataFrame(
            {"model": model, "label": label, "detector": name, "point": point, "fpr": fpr, "tpr": tpr, "auc": auc}
        )


def _draw_roc(df: pd.DataFrame, table: pd.DataFrame):
    """Per model kind (rows) and label (columns), each detector's ROC curve and its AUC."""
    s = scored(df)
    models = model_kinds(s)
    fig, axes = pyplot().subplots(len(models), 2, figsize=(11, 4.8 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        m = s[s["model"] == model]
        for ax, label in zip(axes[row], LABELS, strict=True):
            pop = _population(m, label)
            pos = int(pop[label.replace(" ", "_")].sum())
            for name in DETECTORS:
                g = table[(table["model"] == model) & (table["label"] == label) & (table["detector"] == name)]
                auc = g["auc"].iloc[0]
                ax.plot(g["fpr"], g["tpr"], "-o", ms=3, color=COLORS[name], label=f"{name} (AUC {auc:.4g})")
            ax.plot([0, 1], [0, 1], ":", color="grey", label="chance (AUC 0.500)")
            ax.set(xlabel="false-positive rate", ylabel="true-positive rate (recall)", aspect="equal")
            ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02))
            ax.set_title(f'{model} models, label "{label}":\n{pos} positives of {len(pop)} runs')
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _draw_steps_to_detection(df: pd.DataFrame, table: pd.DataFrame):
    """Per bug, the steps at which the every-step check first fires (marker area: runs); one-step flags beside."""
    s = scored(df)
    models = model_kinds(s)
    bugs = [b for b in dict.fromkeys(table["bug"]) if b != "none"]
    fig, ax = pyplot().subplots(figsize=(10.5, 0.55 * len(bugs) + 1.8))
    offsets = np.linspace(-0.18, 0.18, len(models)) if len(models) > 1 else [0.0]
    for i, bug in enumerate(bugs):
        flagged = []
        for off, model in zip(offsets, models, strict=True):
            g = s[(s["model"] == model) & (s["bug"] == bug) & s["every_step_flag"]]
            steps, n = np.unique(g["steps_to_detection"].to_numpy(), return_counts=True)
            style = {"color": COLORS[model], "alpha": 0.7, "zorder": 3, "label": f"{model} models" if i == 0 else None}
            ax.scatter(steps, np.full(steps.size, i + off), s=12 + 8 * n, **style)
            row = table[(table["model"] == model) & (table["bug"] == bug)].iloc[0]
            flagged.append(f"{row['one_step_flagged']}/{row['runs']}")
        ax.text(16.3, i, "one-step: " + " | ".join(flagged), va="center", fontsize=9, color=COLORS["one-step"])
    ax.axvline(1, color="grey", lw=1, ls=":")
    ax.set_yticks(range(len(bugs)), bugs)
    ax.set(ylim=(len(bugs) - 0.5, -0.5), xlim=(-0.5, 21.5))
    ax.set_xticks(range(0, 16))
    ax.set_xlabel("first decode step at which the every-step check fires (marker area: runs)")
    ax.set_title("Steps to detection per bug (every-step check); one-step flags at right (" + " | ".join(models) + ")")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 0.01), ncol=len(models), fontsize=9, markerscale=0.6)
    fig.tight_layout()
    return fig


@listed
def facts(df: pd.DataFrame) -> Iterator[Fact]:
    """The quoted figures, per model kind: the deviation boundary between changed and unchanged outputs, the
    clean margin, and (closer configuration) how many outputs changed and the one-step check's recall and AUC."""
    s = scored(df)
    summary = summarize(df)
    for model in model_kinds(s):
        m = s[s["model"] == model]
        suffix = "" if model == CLAIMS_MODEL else f"_{model}"
        words = f"{model} models" if model == "random" else f"the {model} model"
        about = f" ({words})" if suffix else ""
        bugged = m[m["bug_present"]]
        same = bugged[~bugged["output_changed"]]
        changed = bugged[bugged["output_changed"]]
        if len(same) and len(changed):
            hi = same.loc[same["every_step_score"].idxmax()]
            lo = changed.loc[changed["every_step_score"].idxmin()]
            for key, run, change in (("largest_unchanged", hi, "did not change"), ("smallest_changed", lo, "changed")):
                what = f"{key.split('_')[0]} all-steps deviation of a bugged run whose output {change}{about}"
                yield Fact(f"{key}_dev{suffix}", what, f"{run['every_step_score']:.2g} ({run['bug']})")
        yield Fact(
            f"margin_median_detector{suffix}",
            f"detector runs{about}: median of the clean generation's smallest top-1 minus top-2 margin",
            f"{float(m['clean_margin_min'].median()):.3g} ({len(m)} runs)",
        )
        if suffix:
            seed = SEED_FIGURES["one-step"]
            one = _row(summary, "one-step", "output changed", model)
            per_bug = ", ".join(
                f"{bug} {int(bugged.loc[bugged['bug'] == bug, 'output_changed'].sum())}"
                for bug in BUGS
                if (bugged["bug"] == bug).any()
            )
            yield Fact(
                f"detector_changed{suffix}",
                f"detector study, {words}: bugged runs whose output changed (of 30 per bug)",
                f"{len(changed)} of {len(bugged)} ({per_bug})",
            )
            yield Fact(
                f"detector_one_step{suffix}",
                f'detector study, {words}: one-step exact check on "output changed" (seed: recall '
                f"{seed['recall']:.3f}, AUC {seed['auc']:.3f})",
                f"recall {one['recall']:.3f}, AUC {one['auc']:.3f}",
            )


FIGURES = (
    Figure(
        "roc",
        "ROC curves of the one-step and the every-step exact check",
        "Scores: the largest deviation at the prompt and decode step 1 (one-step) or at any step (every-step). "
        'Left: label "output changed" over the 240 bugged runs (the seed\'s population). Right: label "bug present" '
        "over all runs (bugged vs clean controls). Top: random models (nearly tied: a small deviation can flip a "
        "token); bottom: the trained cycle-task model (top-2 margins of several logits), the configuration closer "
        "to the seed's. Ties are one straight segment, so each area is the printed AUC.",
        roc_table,
        _draw_roc,
    ),
    Figure(
        "steps",
        "Steps to detection per bug",
        "For each bug and model kind, the first step at which the every-step check fires in each run (a test's "
        "generation must be at least this long to see the bug), and how many runs the one-step check flags at all.",
        steps_to_detection,
        _draw_steps_to_detection,
    ),
)


STUDY = study_of(
    globals(),
    "detector",
    "one-step vs every-step exact cache checks as detectors: recall, precision, FPR, ROC AUC",
    run=bugstudy.run,
    config_fields=bugstudy.CONFIG_FIELDS,
    result_fields=bugstudy.RESULT_FIELDS,
    validate_config=bugstudy.validate_config,
    tables=(("detector_steps", steps_to_detection),),
    rank=20,
)
