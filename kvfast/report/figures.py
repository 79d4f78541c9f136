"""The report's figures, each computed from stored runs: a table of the plotted numbers, and a plot of it.

Every section is a :class:`Section`: a title, a caption saying what to look at,
the table of the numbers plotted (always computed; the report shows it when
matplotlib is absent) and a ``draw`` function that returns a matplotlib
Figure (only called when matplotlib, the ``plot`` extra, is installed; the
Agg backend, no display needed). One idea per figure.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvfast.model.bugs import BUGS, VISIBLE_AT_STEP_1
from kvfast.studies import detector as det
from kvfast.studies import training as tr
from kvfast.studies.bugs import SEED_BUG_TABLE
from kvfast.studies.common import ok_rows
from kvfast.studies.training import TASK_PREFIX

SYMLOG_FLOOR = 1e-8  # deviations below this are drawn on a linear scale, so that exactly 0.0 is visible
COLORS = {"random": "#1f77b4", "trained": "#d62728", "one-step": "#ff7f0e", "every-step": "#2ca02c"}


@dataclass
class Section:
    """One figure of the report: ``table`` holds what ``draw()`` plots; ``note`` says what is not stored."""

    key: str
    title: str
    caption: str
    table: pd.DataFrame
    draw: Callable[[], object] | None = None
    note: str = ""
    extra_tables: dict[str, pd.DataFrame] = field(default_factory=dict)


def matplotlib_available() -> bool:
    """Whether the ``plot`` extra (matplotlib) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "figure.dpi": 100})
    return plt


_ok = ok_rows


# --- bugs: deviation per step ---------------------------------------------------------------------------------


def bug_deviation_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model kind, bug and step: max and median over runs of the deviation at that step."""
    ok = _ok(df)
    rows = []
    for (model, bug), g in ok[ok["bug"] != "none"].groupby(["model", "bug"]):
        dev = np.array([np.asarray(d, dtype=np.float64) for d in g["dev_per_step"]])
        for step in range(dev.shape[1]):
            rows.append(
                {
                    "model": model,
                    "bug": bug,
                    "step": step,
                    "runs": dev.shape[0],
                    "max_dev": float(dev[:, step].max()),
                    "median_dev": float(np.median(dev[:, step])),
                }
            )
    return pd.DataFrame(rows, columns=["model", "bug", "step", "runs", "max_dev", "median_dev"])


def _bug_section(df: pd.DataFrame) -> Section:
    table = bug_deviation_table(df)

    def draw():
        plt = _plt()
        bugs = [b for b in BUGS if b in set(table["bug"])]
        ncol = 4
        nrow = (len(bugs) + ncol - 1) // ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(13, 3.4 * nrow), sharex=True, sharey=True, squeeze=False)
        top = 2.0 * float(table["max_dev"].max()) if len(table) else 1.0
        for ax, bug in zip(axes.flat, bugs, strict=False):
            for model, g in table[table["bug"] == bug].groupby("model"):
                ax.plot(g["step"], g["max_dev"], "-o", ms=3, color=COLORS.get(model), label=f"{model}: max")
                ax.plot(g["step"], g["median_dev"], "--", color=COLORS.get(model), alpha=0.6, label=f"{model}: median")
            ax.axvline(1, color="grey", lw=1, ls=":")
            ax.set_yscale("symlog", linthresh=SYMLOG_FLOOR)
            ax.set_ylim(0, top)
            seed = SEED_BUG_TABLE.get(bug)
            kind = "visible at step 1" if VISIBLE_AT_STEP_1[bug] else "0.0 at step 1"
            ax.set_title(
                f"{bug}: {kind}\n"
                + (f"seed: {seed[0]:g} at step 1, {seed[1]:g} over all" if seed else "(not in the seed)")
            )
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(bugs) :]:
            ax.axis("off")
        for ax in axes[-1]:
            ax.set_xlabel("decode step (dotted line: step 1)")
        for ax in axes[:, 0]:
            ax.set_ylabel("|logit deviation|\n(symlog, 0 at bottom)")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        return fig

    return Section(
        "bugs",
        "Each bug's deviation from a full recompute, per step",
        "Max and median over runs (48 per bug and model kind) of the largest |logit difference| between the bugged "
        "cache and a full recompute of the same tokens, at each step. Step 0 is the prompt, step 1 the first "
        "decode (dotted). The y axis is symmetric-log so that a deviation of exactly 0.0 sits on the bottom "
        "axis: the growth bugs are 0.0 at step 1 and deviate from step 2 (evict when the cache passes 16).",
        table,
        draw,
    )


# --- detector: ROC curves and steps to detection ------------------------------------------------------------


def roc_points(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    """The ROC curve of ``scores`` for boolean ``labels``: (FPR, TPR) at every threshold, from (0, 0) to (1, 1).

    Tied scores form one step (a straight segment), so the area under the points is the Mann-Whitney AUC
    with ties counted half (:func:`kvfast.check.metrics.roc_auc`)."""
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


def roc_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model kind, label and detector: the ROC curve's points (``fpr``, ``tpr``) and the AUC."""
    s = det.scored(df)
    summary = det.summarize(df)
    rows = []
    for model in det.model_kinds(s):
        m = s[s["model"] == model]
        for label in det.LABELS:
            pop = m[m["bug_present"]] if label == "output changed" else m
            y = pop[label.replace(" ", "_")].to_numpy(bool)
            for name in det.DETECTORS:
                key = name.replace("-", "_")
                fpr, tpr = roc_points(pop[f"{key}_score"].to_numpy(), y)
                auc = summary[
                    (summary["model"] == model)
                    & (summary["detector"] == name)
                    & (summary["scope"] == "all")
                    & (summary["label"] == label)
                ]
                for i, (a, b) in enumerate(zip(fpr, tpr, strict=True)):
                    rows.append(
                        {
                            "model": model,
                            "label": label,
                            "detector": name,
                            "point": i,
                            "fpr": a,
                            "tpr": b,
                            "auc": float(auc["auc"].iloc[0]),
                        }
                    )
    return pd.DataFrame(rows, columns=["model", "label", "detector", "point", "fpr", "tpr", "auc"])


def _roc_section(df: pd.DataFrame) -> Section:
    table = roc_table(df)
    s = det.scored(df)
    models = det.model_kinds(s)

    def draw():
        plt = _plt()
        fig, axes = plt.subplots(len(models), 2, figsize=(11, 4.8 * len(models)), squeeze=False)
        for row, model in enumerate(models):
            m = s[s["model"] == model]
            for ax, label in zip(axes[row], det.LABELS, strict=True):
                pop = m[m["bug_present"]] if label == "output changed" else m
                pos = int(pop[label.replace(" ", "_")].sum())
                for name in det.DETECTORS:
                    g = table[(table["model"] == model) & (table["label"] == label) & (table["detector"] == name)]
                    auc = g["auc"].iloc[0]
                    ax.plot(g["fpr"], g["tpr"], "-o", ms=3, color=COLORS[name], label=f"{name} (AUC {auc:.4g})")
                ax.plot([0, 1], [0, 1], ":", color="grey", label="chance (AUC 0.500)")
                ax.set_xlabel("false-positive rate")
                ax.set_ylabel("true-positive rate (recall)")
                ax.set_title(f'{model} models, label "{label}":\n{pos} positives of {len(pop)} runs')
                ax.set_xlim(-0.02, 1.02)
                ax.set_ylim(-0.02, 1.02)
                ax.set_aspect("equal")
                ax.grid(alpha=0.3)
                ax.legend(loc="lower right")
        fig.tight_layout()
        return fig

    return Section(
        "roc",
        "ROC curves of the one-step and the every-step exact check",
        "Scores: the largest deviation at the prompt and decode step 1 (one-step) or at any step (every-step). "
        'Left: label "output changed" over the 240 bugged runs (the seed\'s population). Right: label "bug present" '
        "over all runs (bugged vs clean controls). Top: random models (nearly tied: a small deviation can flip a "
        "token); bottom: the trained cycle-task model (top-2 margins of several logits), the configuration closer "
        "to the seed's. Ties are one straight segment, so each area is the printed AUC.",
        table,
        draw,
    )


def _steps_section(df: pd.DataFrame) -> Section:
    table = det.steps_to_detection(df)
    s = det.scored(df)
    models = det.model_kinds(s)

    def draw():
        plt = _plt()
        bugs = [b for b in dict.fromkeys(table["bug"]) if b != "none"]
        fig, ax = plt.subplots(figsize=(10.5, 0.55 * len(bugs) + 1.8))
        offsets = np.linspace(-0.18, 0.18, len(models)) if len(models) > 1 else [0.0]
        for i, bug in enumerate(bugs):
            flagged = []
            for off, model in zip(offsets, models, strict=True):
                g = s[(s["model"] == model) & (s["bug"] == bug) & s["every_step_flag"]]
                steps, n = np.unique(g["steps_to_detection"].to_numpy(), return_counts=True)
                ax.scatter(
                    steps,
                    np.full(steps.size, i + off),
                    s=12 + 8 * n,
                    color=COLORS[model],
                    alpha=0.7,
                    zorder=3,
                    label=f"{model} models" if i == 0 else None,
                )
                row = table[(table["model"] == model) & (table["bug"] == bug)].iloc[0]
                flagged.append(f"{row['one_step_flagged']}/{row['runs']}")
            ax.text(16.3, i, "one-step: " + " | ".join(flagged), va="center", fontsize=9, color=COLORS["one-step"])
        ax.axvline(1, color="grey", lw=1, ls=":")
        ax.set_yticks(range(len(bugs)), bugs)
        ax.set_ylim(len(bugs) - 0.5, -0.5)
        ax.set_xlim(-0.5, 21.5)
        ax.set_xticks(range(0, 16))
        ax.set_xlabel("first decode step at which the every-step check fires (marker area: runs)")
        ax.set_title(
            "Steps to detection per bug (every-step check); one-step flags at right (" + " | ".join(models) + ")"
        )
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 0.01), ncol=len(models), fontsize=9, markerscale=0.6)
        fig.tight_layout()
        return fig

    return Section(
        "steps",
        "Steps to detection per bug",
        "For each bug and model kind, the first step at which the every-step check fires in each run (a test's "
        "generation must be at least this long to see the bug), and how many runs the one-step check flags at all.",
        table,
        draw,
    )


# --- precision: agreement heatmaps ----------------------------------------------------------------------------

FORMATS = ("f64", "f32", "bf16")


def precision_table(df: pd.DataFrame) -> pd.DataFrame:
    """Standard attention, same decode kernel: per d_model, storage, accumulator and comparison, the share of
    positions whose every value agrees bit for bit (mean over runs)."""
    ok = _ok(df)
    ok = ok[(ok["attention"] == "standard") & (ok["decode_attention"] == "same")]
    rows = []
    for (d, storage, accum), g in ok.groupby(["d_model", "storage", "accum"]):
        seq = g[g["prefill_order"] == "sequential"]
        pair = g[g["prefill_order"] == "pairwise"]
        for comparison, values in (
            ("forward: sequential vs pairwise", g["fwd_pos_agree"]),
            ("cache: prefill sequential, decode pairwise", seq["cache_pos_agree"]),
            ("cache: prefill pairwise, decode sequential", pair["cache_pos_agree"]),
        ):
            rows.append(
                {
                    "d_model": int(d),
                    "storage": storage,
                    "accum": accum,
                    "comparison": comparison,
                    "runs": len(values),
                    "positions_agree": float(values.mean()) if len(values) else np.nan,
                }
            )
    return pd.DataFrame(rows, columns=["d_model", "storage", "accum", "comparison", "runs", "positions_agree"])


def _precision_section(df: pd.DataFrame) -> Section:
    table = precision_table(df)

    def draw():
        plt = _plt()
        dims = sorted(set(table["d_model"]))
        comps = list(dict.fromkeys(table["comparison"]))
        fig, axes = plt.subplots(
            len(dims), len(comps), figsize=(4.3 * len(comps) + 1.2, 3.5 * len(dims) + 0.6), squeeze=False,
            layout="constrained",
        )  # fmt: skip
        for r, d in enumerate(dims):
            for c, comp in enumerate(comps):
                ax = axes[r, c]
                g = table[(table["d_model"] == d) & (table["comparison"] == comp)]
                grid = np.full((3, 3), np.nan)
                for _, row in g.iterrows():
                    grid[FORMATS.index(row["storage"]), FORMATS.index(row["accum"])] = row["positions_agree"]
                im = ax.imshow(100 * grid, vmin=0, vmax=100, cmap="viridis")
                for i in range(3):
                    for j in range(3):
                        v = grid[i, j]
                        text = "" if np.isnan(v) else f"{100 * v:.1f}%"
                        ax.text(j, i, text, ha="center", va="center", color="white" if v < 0.6 else "black")
                ax.set_xticks(range(3), FORMATS)
                ax.set_yticks(range(3), FORMATS)
                ax.set_xlabel("accumulator")
                ax.set_ylabel(f"d_model {d}: storage" if c == 0 else "storage")
                if r == 0:
                    ax.set_title(comp.replace(": ", ":\n"), fontsize=10)
        fig.colorbar(im, ax=axes, shrink=0.8, label="% of positions agreeing bit for bit")
        fig.suptitle("Share of positions whose every value agrees bit for bit (standard attention)")
        return fig

    return Section(
        "precision",
        "Summation order: share of positions that agree bit for bit",
        "Storage format (rows) x accumulator format (columns) x comparison (panels): the forward in sequential vs "
        "pairwise order, and a cache whose prefill and decode use different orders against a full recompute. "
        "Standard attention; 8 models per cell and order.",
        table,
        draw,
    )


# --- near-tied: flips vs tie gap --------------------------------------------------------------------------------


def neartied_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model kind, storage/accumulator pair and twin gap: runs, flips of the mixed-order cached run and of the
    control, and the median top-2 margin."""
    ok = _ok(df)
    rows = []
    for (model, storage, accum, exp), g in ok.groupby(["model", "storage", "accum", "twin_exp"]):
        rows.append(
            {
                "model": model,
                "storage": storage,
                "accum": accum,
                "twin_exp": int(exp),
                "runs": len(g),
                "flips_cached": int(g["flip_cached"].sum()),
                "flips_control": int(g["flip_control"].sum()),
                "margin_median": float(g["margin_median"].median()),
            }
        )
    return pd.DataFrame(
        rows,
        columns=["model", "storage", "accum", "twin_exp", "runs", "flips_cached", "flips_control", "margin_median"],
    )


def _neartied_section(df: pd.DataFrame) -> Section:
    table = neartied_table(df)
    models = [m for m in ("random", "trained") if m in set(table["model"])]

    def draw():
        plt = _plt()
        fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.8), sharey=True, squeeze=False)
        styles = {"bf16": "-", "f32": "--", "f64": ":"}
        runs = int(table["runs"].max()) if len(table) else 0
        exps = sorted(set(table["twin_exp"]))
        for ax, model in zip(axes[0], models, strict=True):
            mine = table[(table["model"] == model) & (table["storage"] == "bf16")]
            for accum, g in mine.groupby("accum"):
                ls = styles[accum]
                ax.plot(g["twin_exp"], g["flips_cached"], ls, marker="o", color="#9467bd", label=f"cached, {accum} acc")
                ax.plot(
                    g["twin_exp"], g["flips_control"], ls, marker="s", color="#8c564b", label=f"control, {accum} acc"
                )
            ax.axhline(3, color="#9467bd", lw=0.8, alpha=0.5)
            ax.axhline(2, color="#8c564b", lw=0.8, alpha=0.5)
            ax.text(0.02, 3.3, "seed: cached 3 / 24", fontsize=8, color="#9467bd", transform=ax.get_yaxis_transform())
            ax.text(0.02, 1.0, "seed: control 2 / 24", fontsize=8, color="#8c564b", transform=ax.get_yaxis_transform())
            ax.set_xticks(exps, [f"$2^{{-{e}}}$" for e in exps])
            ax.set_xlabel("twin gap (smaller = closer tie)")
            ax.set_ylim(-0.5, runs + 0.5)
            ax.set_title(f"twin head on the {model} model{'s' if model == 'random' else ''}")
            ax.grid(alpha=0.3)
        axes[0, 0].set_ylabel(f"runs whose tokens flip (of {runs})")
        axes[0, -1].legend(loc="center right", fontsize=9)
        fig.suptitle("Near-tied model, bf16 storage: cached (mixed orders) vs no-cache control")
        fig.tight_layout()
        return fig

    return Section(
        "neartied",
        "Near-tied flips against the tie gap, cached vs control",
        "A twin-head model makes every step nearly tied. Cached: prefill in sequential order, every decode step in "
        "pairwise; control: a full recompute in pairwise order, no cache. Both against a sequential recompute. "
        "Left: the twin head on random models; right: on the trained cycle-task model (in-distribution prompts). "
        "With an f32 or f64 accumulator no run flips; with a bf16 accumulator the cache flips about as often as the "
        "control at every gap, on both.",
        table,
        draw,
    )


# --- training ---------------------------------------------------------------------------------------------------


def training_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per training budget and prefix length: mean, min and max gradient cosine and mean held-out suffix losses."""
    ok = _ok(df)
    out = (
        ok.groupby(["train_steps", "prefix_len"])
        .agg(
            seeds=("seed", "nunique"),
            cosine=("grad_cosine", "mean"),
            cosine_min=("grad_cosine", "min"),
            cosine_max=("grad_cosine", "max"),
            suffix_loss_full=("suffix_loss_full", "mean"),
            suffix_loss_cached=("suffix_loss_cached", "mean"),
        )
        .reset_index()
    )
    return out


def _training_cosine_section(df: pd.DataFrame) -> Section:
    table = training_table(df)
    ok = _ok(df)

    def draw():
        plt = _plt()
        fig, ax = plt.subplots(figsize=(8, 4.4))
        main = table[table["train_steps"] == table["train_steps"].min()]
        runs = ok[ok["train_steps"] == table["train_steps"].min()]
        ax.scatter(runs["prefix_len"], runs["grad_cosine"], s=14, color="grey", alpha=0.6, label="one seed")
        ax.plot(main["prefix_len"], main["cosine"], "-o", color="#1f77b4", label="mean over seeds")
        ax.plot([TASK_PREFIX], [0.857], "*", ms=14, color="#d62728", label="seed: 0.857 at 6 of 12")
        ax.set_xlabel("cached prefix length P (positions whose K/V are constants), of 12")
        ax.set_ylabel("gradient cosine, cached vs full")
        ax.set_title("Gradient cosine at initialisation against prefix length")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
        fig.tight_layout()
        return fig

    return Section(
        "training_cosine",
        "Training: gradient cosine against the cached prefix length",
        "The cosine between the full gradient and the cached-prefix gradient (prefix K/V treated as constants), "
        "at initialisation, on a fixed batch of 32 sequences.",
        table[["train_steps", "prefix_len", "seeds", "cosine", "cosine_min", "cosine_max"]],
        draw,
    )


def _training_loss_section(df: pd.DataFrame) -> Section:
    table = training_table(df)

    def draw():
        plt = _plt()
        fig, ax = plt.subplots(figsize=(8, 4.4))
        for steps, g in table.groupby("train_steps"):
            marker = "-o" if len(g) > 1 else "D"
            ax.plot(g["prefix_len"], g["suffix_loss_full"], marker, color="#2ca02c", label=f"full, {steps} steps")
            ax.plot(g["prefix_len"], g["suffix_loss_cached"], marker, color="#d62728", label=f"cached, {steps} steps")
        ax.plot([TASK_PREFIX], [1.346], "*", ms=14, color="#d62728", mec="black", label="seed cached: 1.346")
        ax.plot([TASK_PREFIX], [0.059], "*", ms=14, color="#2ca02c", mec="black", label="seed full: 0.059")
        ax.set_xlabel("cached prefix length P, of 12")
        ax.set_ylabel("held-out suffix loss (mean over seeds)")
        ax.set_title("Held-out suffix loss after the same budget: cached prefix vs full")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        return fig

    return Section(
        "training_loss",
        "Training: held-out suffix loss, cached prefix vs full",
        "After the same Adam budget from the same initialisation: the held-out loss over the learnable suffix "
        "positions, full training against training with the prefix's K/V as constants.",
        table[["train_steps", "prefix_len", "seeds", "suffix_loss_full", "suffix_loss_cached"]],
        draw,
    )


def _curve_runs(df: pd.DataFrame) -> pd.DataFrame:
    ok = _ok(df)
    if "curve_cosine_full" not in ok.columns:
        return ok.iloc[0:0]
    return ok[ok["prefix_len"] == TASK_PREFIX]


def training_curve_table(df: pd.DataFrame) -> pd.DataFrame:
    """At prefix 6, per training budget and curve point: the step and the means over seeds of the gradient cosine
    along full and along cached training, and of the held-out suffix loss of each variant."""
    runs = _curve_runs(df)
    rows = []
    for steps, g in runs.groupby("train_steps"):
        at, cos_full = tr.mean_curve(g, "curve_cosine_full")
        _, cos_cached = tr.mean_curve(g, "curve_cosine_cached")
        _, loss_full = tr.mean_curve(g, "curve_suffix_loss_full")
        _, loss_cached = tr.mean_curve(g, "curve_suffix_loss_cached")
        for i, step in enumerate(at):
            rows.append(
                {
                    "train_steps": int(steps),
                    "step": int(step),
                    "seeds": len(g),
                    "cosine_full_training": float(cos_full[i]),
                    "cosine_cached_training": float(cos_cached[i]),
                    "suffix_loss_full": float(loss_full[i]),
                    "suffix_loss_cached": float(loss_cached[i]),
                }
            )
    return pd.DataFrame(
        rows,
        columns=[
            "train_steps",
            "step",
            "seeds",
            "cosine_full_training",
            "cosine_cached_training",
            "suffix_loss_full",
            "suffix_loss_cached",
        ],
    )


def _budgets(runs: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in set(runs["train_steps"]))


def _training_curve_section(df: pd.DataFrame) -> Section:
    table = training_curve_table(df)
    runs = _curve_runs(df)

    def draw():
        plt = _plt()
        budgets = _budgets(runs)
        fig, axes = plt.subplots(1, len(budgets), figsize=(6.2 * len(budgets), 4.6), sharey=True, squeeze=False)
        for ax, steps in zip(axes[0], budgets, strict=True):
            g = runs[runs["train_steps"] == steps]
            for variant, color in (("full", "#2ca02c"), ("cached", "#d62728")):
                for _, r in g.iterrows():
                    ax.plot(r["curve_steps"], r[f"curve_cosine_{variant}"], "-", color=color, alpha=0.25, lw=1)
                at, mean = tr.mean_curve(g, f"curve_cosine_{variant}")
                ax.plot(at, mean, "-o", ms=4, color=color, label=f"along {variant} training (mean of {len(g)} seeds)")
            ax.axhline(tr.SEED_COSINE, color="black", ls="--", lw=1, label=f"seed: {tr.SEED_COSINE}")
            ax.set_xlabel("training step (Adam)")
            ax.set_title(f"{steps} training steps, prefix 6 of 12")
            ax.grid(alpha=0.3)
        axes[0, 0].set_ylabel("gradient cosine, cached-prefix vs full")
        axes[0, 0].legend(loc="lower left", fontsize=9)
        fig.suptitle("Gradient cosine during training (thin lines: one seed each)")
        fig.tight_layout()
        return fig

    return Section(
        "training_curve",
        "Training: gradient cosine during training",
        "The cosine between the full and the cached-prefix gradient on the fixed batch of 32 sequences, at the "
        "parameters each variant has reached after that many Adam steps (step 0 is the cosine at initialisation). "
        "Along full training it dips while the model learns to attend back to the prefix, through the seed's "
        "0.857, and recovers once the task is learned; along cached training it keeps falling.",
        table[["train_steps", "step", "seeds", "cosine_full_training", "cosine_cached_training"]],
        draw,
    )


def training_tensor_table(df: pd.DataFrame) -> pd.DataFrame:
    """At prefix 6 and the main (shortest) budget, per parameter tensor: the gradient cosine (mean over seeds) at
    initialisation and at the last curve point along each variant's training."""
    runs = _curve_runs(df)
    if not len(runs):
        return pd.DataFrame(columns=["tensor", "seeds", "at_init", "end_full_training", "end_cached_training"])
    g = runs[runs["train_steps"] == min(_budgets(runs))]
    names = list(g["tensor_names"].iloc[0])
    full = np.array([np.asarray(list(c), dtype=np.float64) for c in g["curve_tensor_cosine_full"]])
    cached = np.array([np.asarray(list(c), dtype=np.float64) for c in g["curve_tensor_cosine_cached"]])
    return pd.DataFrame(
        {
            "tensor": names,
            "seeds": len(g),
            "at_init": full[:, 0, :].mean(axis=0),
            "end_full_training": full[:, -1, :].mean(axis=0),
            "end_cached_training": cached[:, -1, :].mean(axis=0),
        }
    )


def _training_tensor_section(df: pd.DataFrame) -> Section:
    table = training_tensor_table(df)
    runs = _curve_runs(df)

    def draw():
        plt = _plt()
        g = runs[runs["train_steps"] == min(_budgets(runs))]
        names = list(g["tensor_names"].iloc[0])
        at = list(g["curve_steps"].iloc[0])
        fig, axes = plt.subplots(1, 2, figsize=(12, 6.4), sharey=True, layout="constrained")
        for ax, variant in zip(axes, ("full", "cached"), strict=True):
            cube = np.array([np.asarray(list(c), dtype=np.float64) for c in g[f"curve_tensor_cosine_{variant}"]])
            grid = cube.mean(axis=0).T  # tensors x curve points
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(at)), [str(a) for a in at], fontsize=8)
            ax.set_yticks(range(len(names)), names, fontsize=8)
            ax.set_xlabel("training step")
            ax.set_title(f"along {variant} training")
        axes[0].set_ylabel("parameter tensor (h0 = layer 1, h1 = layer 2)")
        fig.colorbar(im, ax=axes, shrink=0.8, label="gradient cosine, cached-prefix vs full (mean over seeds)")
        fig.suptitle(f"Gradient cosine per parameter tensor, prefix 6 of 12, {int(g['train_steps'].iloc[0])} steps")
        return fig

    return Section(
        "training_tensors",
        "Training: gradient cosine per parameter tensor",
        "The same cosine, tensor by tensor. The gap sits in the key and value projections (wk, wv) and the "
        "pre-attention norms and embeddings, through which the prefix's keys and values depend on the parameters. "
        "Tensors that the prefix's keys and values do not depend on (the last layer's queries, output projection, "
        "MLP and its norm, the final norm, the output head) get the same gradient either way (cosine 1.000).",
        table,
        draw,
    )


def _training_loss_curve_section(df: pd.DataFrame) -> Section:
    table = training_curve_table(df)
    runs = _curve_runs(df)

    def draw():
        plt = _plt()
        budgets = _budgets(runs)
        fig, axes = plt.subplots(1, len(budgets), figsize=(6.2 * len(budgets), 4.6), sharey=True, squeeze=False)
        for ax, steps in zip(axes[0], budgets, strict=True):
            g = runs[runs["train_steps"] == steps]
            for variant, color in (("full", "#2ca02c"), ("cached", "#d62728")):
                batch = np.array([np.asarray(v, dtype=np.float64) for v in g[f"train_loss_{variant}"]]).mean(axis=0)
                ax.plot(
                    np.arange(batch.size), batch, "-", color=color, alpha=0.35, lw=1, label=f"{variant}: training batch"
                )
                at, mean = tr.mean_curve(g, f"curve_suffix_loss_{variant}")
                ax.plot(at, mean, "-o", ms=4, color=color, label=f"{variant}: held-out suffix")
            ax.plot([steps], [1.346], "*", ms=13, color="#d62728", mec="black", label="seed cached: 1.346")
            ax.plot([steps], [0.059], "*", ms=13, color="#2ca02c", mec="black", label="seed full: 0.059")
            ax.set_yscale("log")
            ax.set_xlabel("training step (Adam)")
            ax.set_title(f"{steps} training steps, prefix 6 of 12 (mean of {len(g)} seeds)")
            ax.grid(alpha=0.3, which="both")
        axes[0, 0].set_ylabel("loss (log scale)")
        axes[0, -1].legend(fontsize=8, loc="lower left", ncol=2)
        fig.suptitle("Loss during training: cached prefix vs full")
        fig.tight_layout()
        return fig

    return Section(
        "training_loss_curve",
        "Training: loss curves, cached prefix vs full",
        "Thin lines: each step's training-batch loss over positions 6..11 (what each variant minimises); markers: "
        "the held-out loss over the learnable suffix positions at the curve points (the last one is the figure of "
        "the claims table). Stars: the seed's final losses, drawn at the end of each budget.",
        table[["train_steps", "step", "seeds", "suffix_loss_full", "suffix_loss_cached"]],
        draw,
    )


# --- exactness -------------------------------------------------------------------------------------------------


def exactness_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset and order: runs, worst deviation, runs bit-exact at every step, runs with equal tokens."""
    ok = _ok(df)
    out = (
        ok.groupby(["preset", "order"])
        .agg(
            runs=("max_abs_dev", "size"),
            worst_dev=("max_abs_dev", "max"),
            exact_runs=("max_abs_dev", lambda s: int((s == 0.0).sum())),
            tokens_equal=("tokens_equal", "sum"),
        )
        .reset_index()
    )
    return out


def _exactness_section(df: pd.DataFrame) -> Section:
    table = exactness_table(df)

    def draw():
        plt = _plt()
        fig, ax = plt.subplots(figsize=(8, 3.6))
        labels = [f"{p}\n{o}" for p, o in zip(table["preset"], table["order"], strict=True)]
        x = np.arange(len(table))
        ax.bar(x, table["runs"], color="#dddddd", label="runs")
        ax.bar(x, table["exact_runs"], width=0.5, color="#2ca02c", label="bit-exact at every step")
        for i, (_, row) in enumerate(table.iterrows()):
            ax.text(i, row["runs"] * 1.02, f"worst dev {row['worst_dev']:g}", ha="center", fontsize=9)
        ax.set_xticks(x, labels)
        ax.set_xlabel("preset and summation order")
        ax.set_ylabel("runs")
        ax.set_ylim(0, table["runs"].max() * 1.45 if len(table) else 1)
        ax.set_title("Cached decode vs full recompute: runs bit-exact, and the worst deviation")
        ax.legend(loc="upper center", ncol=2, fontsize=9)
        fig.tight_layout()
        return fig

    return Section(
        "exactness",
        "Exactness: the grid's worst deviation per preset",
        "Every run compares the cached logits with a full recompute at every step with ==.",
        table,
        draw,
    )


# --- gradient check ------------------------------------------------------------------------------------------


def gradcheck_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per tensor name (over every run): runs, worst and median relative error."""
    ok = _ok(df)
    rows = []
    for _, r in ok.iterrows():
        for name, err in zip(r["tensor_names"], r["rel_err"], strict=True):
            rows.append({"n_layer": int(r["n_layer"]), "tensor": name, "rel_err": float(err)})
    long = pd.DataFrame(rows, columns=["n_layer", "tensor", "rel_err"])
    return (
        long.groupby(["n_layer", "tensor"], sort=False)
        .agg(runs=("rel_err", "size"), worst=("rel_err", "max"), median=("rel_err", "median"))
        .reset_index()
    )


def _gradcheck_section(df: pd.DataFrame) -> Section:
    table = gradcheck_table(df)

    def draw():
        plt = _plt()
        two = table[table["n_layer"] == (2 if (table["n_layer"] == 2).any() else table["n_layer"].max())]
        fig, ax = plt.subplots(figsize=(10, 3.8))
        x = np.arange(len(two))
        ax.bar(x, two["worst"], color="#1f77b4", label="worst over runs")
        ax.plot(x, two["median"], "o", color="black", ms=4, label="median")
        ax.axhline(3.2e-8, color="#d62728", ls="--", lw=1, label="seed's worst: 3.2e-8")
        ax.axhline(1e-6, color="grey", ls=":", lw=1, label="bound: 1e-6")
        ax.set_yscale("log")
        ax.set_ylim(top=1e-4)
        ax.set_xticks(x, two["tensor"], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("relative error vs central differences")
        ax.set_xlabel(f"parameter tensor ({len(two)} in a {int(two['n_layer'].iloc[0])}-layer model)")
        ax.set_title("Hand-written gradient vs central differences, per tensor")
        ax.legend(fontsize=8, loc="upper right", ncol=2)
        fig.tight_layout()
        return fig

    return Section(
        "gradcheck",
        "Gradient check per tensor",
        "The hand-written float64 backward against central differences (h = 1e-5) of an independently written "
        "loss, every element of every tensor. kvfast's model has 4 + 8 per layer tensors (no biases): 20 at two "
        "layers, where the seed reports 24 without listing them.",
        table,
        draw,
    )


SECTIONS: dict[str, list[Callable[[pd.DataFrame], Section]]] = {
    "bugs": [_bug_section],
    "detector": [_roc_section, _steps_section],
    "precision": [_precision_section],
    "neartied": [_neartied_section],
    "training": [
        _training_cosine_section,
        _training_curve_section,
        _training_tensor_section,
        _training_loss_section,
        _training_loss_curve_section,
    ],
    "exactness": [_exactness_section],
    "gradcheck": [_gradcheck_section],
}
ORDER = ("bugs", "detector", "precision", "neartied", "training", "exactness", "gradcheck")


def sections(results: dict[str, pd.DataFrame]) -> list[Section]:
    """Every section the stored ``results`` allow, in the report's order."""
    out = []
    for name in ORDER:
        df = results.get(name)
        if df is None or not len(_ok(df)):
            continue
        out += [make(df) for make in SECTIONS[name]]
    return out
