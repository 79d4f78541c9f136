"""The cached-prefix training study: in training, a reused prefix cache DOES change the answer.

The task ("successor copy"). A sequence has 12 tokens ``x[0..11]`` over the
content tokens ``1 .. vocab-1`` (token 0 is BOS): the prefix ``x[0..5]`` is
uniformly random and the suffix is its successor, ``x[6+i] = succ(x[i])`` with
``succ(t) = t % (vocab-1) + 1``. The model reads ``[BOS, x0, .., x10]`` (12
positions) and position ``t`` predicts ``x[t]``, so predicting a suffix token
needs attention from position ``6+i`` back to position ``i+1``; the prefix
predictions are irreducible (``log(vocab-1)`` each).

Training with a prefix of ``P`` positions (``prefix_len``, 0..11), for the same
budget (same initialisation, same batches, same Adam steps and learning rate):

- ``full``: the loss is the mean cross-entropy over positions ``P..11`` and the
  gradient flows everywhere;
- ``cached``: the same loss, but the keys and values of positions ``< P`` are
  constants (a cached prefix reused in fine-tuning; implemented with
  ``loss_and_grads_prepared(..., detach_kv_before=P)``). Its loss as a function of
  the parameters takes the prefix's K/V from a frozen copy of the parameters through
  a real :class:`~kvfast.KVCache`; tests/studies/test_studies_training.py checks the
  gradient against central differences of that loss.

Reported per run: the cosine between the two gradients at initialisation on a
fixed batch (``grad_cosine``), and after training each variant the held-out
loss over the trained positions ``P..11`` (``loss_*``) and over the learnable
suffix positions ``max(P, 6)..11`` (``suffix_loss_*``).

Curves during training (list columns, one value per point of ``curve_steps``:
step 0, every ``train_steps // CURVE_INTERVALS`` steps, and the last step; a
point is taken *before* that step's update, the last after the final one):

- ``curve_cosine_full`` / ``curve_cosine_cached``: the gradient cosine on the
  same fixed batch as ``grad_cosine``, at the parameters the full / the cached
  variant has reached (its first point is ``grad_cosine``, bit for bit);
- ``curve_tensor_cosine_full`` / ``..._cached``: the same per parameter tensor
  (one list per point, tensors in the order of ``tensor_names``);
- ``curve_suffix_loss_full`` / ``..._cached``: the held-out suffix loss (its last
  point is ``suffix_loss_*``, bit for bit);
- ``train_loss_full`` / ``train_loss_cached``: every step's training-batch loss
  (the loss each variant minimises, before its update).

Taking a point reads the parameters and changes nothing: every other column is
what it is without the curves. Every number depends only on the config (seeds
derive from ``seed``). Gradients use the model's hand-written float64 backward;
the optimiser is the hand-written Adam of :mod:`kvfast.studies.toytask`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.model.config import ModelConfig, init_params
from kvfast.numerics import Numerics
from kvfast.studies.common import (
    MODEL_SHAPE_FIELDS,
    aggregated,
    listed,
    model_config,
    ok_rows,
    require_model_shape,
    stacked,
    study_of,
    tabled,
)
from kvfast.studies.criteria import DIRECTION, VS_SEED, judged, within
from kvfast.studies.plotting import pyplot
from kvfast.studies.toytask import AdamState, adam_step, batch_loss_and_grads, heldout
from kvfast.sweep.study import Claim, Fact, Figure
from kvfast.validation import not_allowed, require_int

VERSION = "1"

SEQ_LEN = 12
TASK_PREFIX = 6
BOS = 0
F64 = Numerics()
CURVE_INTERVALS = 10  # curve points: every train_steps // CURVE_INTERVALS steps (and the last step)

CONFIG_FIELDS = {
    "seed": pa.int64(),
    "prefix_len": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "train_steps": pa.int64(),
    "batch": pa.int64(),
    "lr": pa.float64(),
    "grad_batch": pa.int64(),
    "eval_size": pa.int64(),
}
VARIANTS = ("full", "cached")  # trained on full recomputes / on the cached prefix
#: The curves along training, each stored per variant as ``NAME_full`` and ``NAME_cached``.
CURVE_FIELDS = {
    "curve_cosine": pa.list_(pa.float64()),
    "curve_tensor_cosine": pa.list_(pa.list_(pa.float64())),
    "curve_suffix_loss": pa.list_(pa.float64()),
    "train_loss": pa.list_(pa.float64()),
}
RESULT_FIELDS = {
    "grad_cosine": pa.float64(),
    "init_loss": pa.float64(),
    **{f"{metric}_{v}": pa.float64() for metric in ("loss", "suffix_loss", "suffix_acc") for v in VARIANTS},
    "tensor_names": pa.list_(pa.string()),
    "curve_steps": pa.list_(pa.int64()),
    **{f"{curve}_{v}": kind for curve, kind in CURVE_FIELDS.items() for v in VARIANTS},
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_model_shape(config, min_vocab=3)
    require_int(config.get("prefix_len"), "prefix_len", 0, SEQ_LEN - 1)
    for name in ("batch", "grad_batch", "eval_size"):
        require_int(config.get(name), name, 1, 4096)
    require_int(config.get("train_steps"), "train_steps", 0, 10**6)
    lr = config.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, float | int) or not 0 < lr < 1:
        raise not_allowed("lr", lr, "a float in (0, 1)")


def successor_batch(rng: np.random.Generator, n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` task sequences as ``(inputs, targets)``, both ``(n, 12)`` int64 (module docstring)."""
    head = rng.integers(1, vocab, size=(n, TASK_PREFIX))
    tail = head % (vocab - 1) + 1
    seqs = np.concatenate([head, tail], axis=1).astype(np.int64)
    inputs = np.concatenate([np.full((n, 1), BOS, dtype=np.int64), seqs[:, :-1]], axis=1)
    return inputs, seqs


def _flat(grads: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([grads[k].ravel() for k in sorted(grads)])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """``a . b / (|a| |b|)`` of two flattened gradients (NaN when either is all zero)."""
    # math.fsum: correctly rounded sums, the same on every machine (a BLAS dot or norm is not)
    norm = math.sqrt(math.fsum(a * a)) * math.sqrt(math.fsum(b * b))
    return math.fsum(a * b) / norm if norm > 0 else float("nan")


def curve_steps(train_steps: int) -> list[int]:
    """The steps at which the curves are taken: 0, every ``train_steps // CURVE_INTERVALS`` (at least 1), and
    ``train_steps``."""
    every = max(1, train_steps // CURVE_INTERVALS)
    return sorted({*range(0, train_steps + 1, every), train_steps})


def gradients(
    cfg: ModelConfig, params: dict, inputs: np.ndarray, targets: np.ndarray, prefix_len: int, cached: bool
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss over positions ``prefix_len..11`` and its gradient, full or with the prefix's K/V detached."""
    detach = prefix_len if cached else 0
    return batch_loss_and_grads(cfg, params, inputs, targets, prefix_len, F64, detach_kv_before=detach)


def train(config: dict, cached: bool, probe=None) -> tuple[dict[str, np.ndarray], list[float], list]:
    """Parameters after ``train_steps`` Adam steps on fresh batches, full or cached-prefix (module docstring).

    Returns ``(params, losses, points)``: every step's training-batch loss (before its update) and
    ``probe(params)`` at each of :func:`curve_steps` (none when ``probe`` is None). ``probe`` must not change
    the parameters."""
    cfg = model_config(config, SEQ_LEN)
    params = init_params(cfg, config["seed"])
    state = AdamState.zeros(params)
    rng = np.random.default_rng([config["seed"], 0x7124])
    steps = config["train_steps"]
    at = set(curve_steps(steps)) if probe is not None else set()
    losses, points = [], []
    for step in range(steps):
        if step in at:
            points.append(probe(params))
        inputs, targets = successor_batch(rng, config["batch"], config["vocab"])
        loss, grads = gradients(cfg, params, inputs, targets, config["prefix_len"], cached)
        losses.append(float(loss))
        adam_step(params, grads, state, float(config["lr"]))
    if steps in at:
        points.append(probe(params))
    return params, losses, points


def gradient_cosines(
    cfg: ModelConfig, params: dict, inputs: np.ndarray, targets: np.ndarray, prefix_len: int
) -> tuple[float, list[float], float]:
    """At ``params``: the cosine of the full and the cached-prefix gradient (all tensors flattened), the cosine
    per tensor (sorted names), and the full loss."""
    loss, g_full = gradients(cfg, params, inputs, targets, prefix_len, cached=False)
    _, g_cached = gradients(cfg, params, inputs, targets, prefix_len, cached=True)
    per_tensor = [cosine(g_full[k].ravel(), g_cached[k].ravel()) for k in sorted(g_full)]
    return cosine(_flat(g_full), _flat(g_cached)), per_tensor, float(loss)


def run(config: dict) -> dict:
    """One run: gradient cosine at initialisation, then both variants trained (with their curves) and evaluated."""
    validate_config(config)
    cfg = model_config(config, SEQ_LEN)
    p = config["prefix_len"]
    params0 = init_params(cfg, config["seed"])
    gx, gy = successor_batch(np.random.default_rng([config["seed"], 0x6AD]), config["grad_batch"], config["vocab"])
    cos0, _, init_loss = gradient_cosines(cfg, params0, gx, gy, p)
    ex, ey = successor_batch(np.random.default_rng([config["seed"], 0xE7A1]), config["eval_size"], config["vocab"])
    suffix_from = max(p, TASK_PREFIX)

    def probe(params: dict) -> tuple[float, list[float], float]:
        cos, per_tensor, _ = gradient_cosines(cfg, params, gx, gy, p)
        return cos, per_tensor, heldout(cfg, params, ex, ey, suffix_from)[0]

    out = {"grad_cosine": cos0, "init_loss": init_loss}
    full = train(config, cached=False, probe=probe)
    cached = full if p == 0 else train(config, cached=True, probe=probe)
    for name, (params, _, _) in (("full", full), ("cached", cached)):
        out[f"loss_{name}"], _ = heldout(cfg, params, ex, ey, p)
        out[f"suffix_loss_{name}"], out[f"suffix_acc_{name}"] = heldout(cfg, params, ex, ey, suffix_from)
    out["tensor_names"] = sorted(params0)
    out["curve_steps"] = curve_steps(config["train_steps"])
    for name, (_, losses, points) in (("full", full), ("cached", cached)):
        curves = [*map(list, zip(*points, strict=True)), losses]  # the probe's three curves, then the losses
        out.update({f"{curve}_{name}": values for curve, values in zip(CURVE_FIELDS, curves, strict=True)})
    return out


#: The summary's statistics of a cosine curve along training, each averaged over a group's runs.
CURVE_POINTS = {"min": min, "end": lambda curve: curve[-1]}


def _mean_over_runs(point):
    """An aggregation of a curve column: the mean over a group's runs of ``point(curve)``."""
    return lambda curves: float(np.mean([point(c) for c in curves]))


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per training budget and prefix length: means over seeds of the gradient cosine and held-out losses, and of
    the lowest and the last point of the cosine curve along each variant's training."""
    heldout_means = {
        f"{metric}_{v}": (f"{metric}_{v}", "mean") for metric in ("loss", "suffix_loss", "suffix_acc") for v in VARIANTS
    }
    curve_points = {
        f"curve_cosine_{point}_{v}": (f"curve_cosine_{v}", _mean_over_runs(pick))
        for v in VARIANTS
        for point, pick in CURVE_POINTS.items()
    }
    return aggregated(
        ok_rows(df),
        ["d_model", "train_steps", "prefix_len"],
        seeds=("seed", "nunique"),
        grad_cosine=("grad_cosine", "mean"),
        grad_cosine_min=("grad_cosine", "min"),
        **heldout_means,
        **curve_points,
    )


def mean_curve(runs: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, mean over runs)`` of a curve column for runs of one training budget (same ``curve_steps``)."""
    return np.asarray(runs["curve_steps"].iloc[0], dtype=np.int64), stacked(runs[column]).mean(axis=0)


SEED_COSINE = 0.857


@listed
def claims(df: pd.DataFrame) -> Iterator[Claim]:
    """The seed's training claims at a prefix of 6 of 12 (means over seeds, per training budget).

    The first two check a direction only (cosine below 1; cached loss above full), and are labelled so. The
    third is the closer configuration: the cosine *during* full training (its curve, mean over seeds), whose
    lowest point is compared with the seed's 0.857 within the seed-to-seed spread of the cosine at
    initialisation (max minus min over the runs), a tolerance computed from the runs themselves."""
    ok = ok_rows(df)
    ok = ok[ok["prefix_len"] == TASK_PREFIX]
    if not len(ok):
        return
    cos = ok["grad_cosine"]
    budgets, worse = [], []
    for (d, steps), g in ok.groupby(["d_model", "train_steps"]):
        lf, lc = float(g["suffix_loss_full"].mean()), float(g["suffix_loss_cached"].mean())
        budgets.append(f"d_model {d}, {steps} steps: {lc:.3f} vs {lf:.3f} ({len(g)} seeds)")
        worse.append((f"{steps} steps: mean cached suffix loss > mean full", lc > lf))
    yield judged(
        "cached-prefix training: gradient cosine with the full gradient at prefix 6 of 12 is below 1",
        f"{SEED_COSINE}",
        f"{float(cos.mean()):.3f} (mean of {len(ok)} runs; range {cos.min():.3f}..{cos.max():.3f})",
        DIRECTION,
        [("cosine < 1 in every run", bool((cos < 1.0).all()))],
    )
    yield judged(
        "cached-prefix training: held-out suffix loss after the same budget is worse than full training",
        "1.346 vs 0.059",
        "cached vs full: " + "; ".join(budgets),
        DIRECTION,
        worse,
    )
    if "curve_cosine_full" in ok.columns:
        spread = float(cos.max() - cos.min())
        figures, conditions = [], []
        for steps, g in ok.groupby("train_steps"):
            at, curve = mean_curve(g, "curve_cosine_full")
            i = int(np.argmin(curve))
            figures.append(f"{curve[i]:.3f} at step {int(at[i])} of {int(steps)} ({len(g)} seeds)")
            words = f"{int(steps)} steps: |lowest mean cosine - {SEED_COSINE}| <= {spread:.3f} (the seeds' spread at "
            conditions.append((words + "initialisation)", within(float(curve[i]), SEED_COSINE, spread)))
        yield judged(
            "cached-prefix training: during full training at prefix 6 of 12 the gradient cosine falls to the "
            "seed's (lowest point of the mean curve over training steps)",
            f"{SEED_COSINE}",
            "; ".join(figures) + f"; at initialisation {float(cos.mean()):.3f}",
            VS_SEED,
            conditions,
        )


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


def training_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per training budget and prefix length: mean, min and max gradient cosine and mean held-out suffix losses."""
    suffix_losses = {f"suffix_loss_{v}": (f"suffix_loss_{v}", "mean") for v in VARIANTS}
    return aggregated(
        ok_rows(df),
        ["train_steps", "prefix_len"],
        seeds=("seed", "nunique"),
        cosine=("grad_cosine", "mean"),
        cosine_min=("grad_cosine", "min"),
        cosine_max=("grad_cosine", "max"),
        **suffix_losses,
    )


def _curve_runs(df: pd.DataFrame) -> pd.DataFrame:
    ok = ok_rows(df)
    if "curve_cosine_full" not in ok.columns:
        return ok.iloc[0:0]
    return ok[ok["prefix_len"] == TASK_PREFIX]


#: The curve table's columns: the mean over seeds of each curve column, per curve point.
CURVE_TABLE_COLUMNS = {
    "cosine_full_training": "curve_cosine_full",
    "cosine_cached_training": "curve_cosine_cached",
    "suffix_loss_full": "curve_suffix_loss_full",
    "suffix_loss_cached": "curve_suffix_loss_cached",
}


@tabled(["train_steps", "step", "seeds", *CURVE_TABLE_COLUMNS])
def training_curve_table(df: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """At prefix 6, per training budget and curve point: the step and the means over seeds of the gradient cosine
    along full and along cached training, and of the held-out suffix loss of each variant."""
    for steps, g in _curve_runs(df).groupby("train_steps"):
        yield pd.DataFrame(
            {
                "train_steps": int(steps),
                "step": np.asarray(g["curve_steps"].iloc[0], dtype=np.int64),
                "seeds": len(g),
                **{name: mean_curve(g, column)[1] for name, column in CURVE_TABLE_COLUMNS.items()},
            }
        )


def _main_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The runs with curves at prefix 6 of the main (shortest) training budget."""
    runs = _curve_runs(df)
    return runs[runs["train_steps"] == runs["train_steps"].min()]


def training_tensor_table(df: pd.DataFrame) -> pd.DataFrame:
    """At prefix 6 and the main (shortest) budget, per parameter tensor: the gradient cosine (mean over seeds) at
    initialisation and at the last curve point along each variant's"""
    g = _main_runs(df)
    if not len(g):
        return pd.DataFrame(columns=["tensor", "seeds", "at_init", "end_full_training", "end_cached_training"])
    full, cached = (stacked(g[f"curve_tensor_cosine_{v}"]) for v in VARIANTS)
    return pd.DataFrame(
        {
            "tensor": list(g["tensor_names"].iloc[0]),
            "seeds": len(g),
            "at_init": full[:, 0, :].mean(axis=0),
            "end_full_training": full[:, -1, :].mean(axis=0),
            "end_cached_training": cached[:, -1, :].mean(axis=0),
        }
    )


def _columns(table, *names: str):
    """The figure table ``table`` (a function of the runs) cut to the columns ``names``."""
    return lambda df: table(df)[list(names)]


def _draw_cosine(df: pd.DataFrame, table: pd.DataFrame):
    """The cosine at initialisation against the prefix length: each seed, and their mean."""
    ok = ok_rows(df)
    fig, ax = pyplot().subplots(figsize=(8, 4.4))
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


def _budget_panels(runs: pd.DataFrame) -> tuple[object, object, list[tuple[object, int, pd.DataFrame]]]:
    """One panel per training budget, side by side, sharing the y axis: the figure, its axes, and per panel
    ``(axis, budget, the budget's runs)``."""
    budgets = sorted(int(s) for s in set(runs["train_steps"]))
    fig, axes = pyplot().subplots(1, len(budgets), figsize=(6.2 * len(budgets), 4.6), sharey=True, squeeze=False)
    panels = [(ax, steps, runs[runs["train_steps"] == steps]) for ax, steps in zip(axes[0], budgets, strict=True)]
    return fig, axes, panels


def _draw_cosine_curve(df: pd.DataFrame, table: pd.DataFrame):
    """Per budget, the cosine along full and along cached training: each seed, and their mean."""
    fig, axes, panels = _budget_panels(_curve_runs(df))
    for ax, steps, g in panels:
        for variant, color in (("full", "#2ca02c"), ("cached", "#d62728")):
            for _, r in g.iterrows():
                ax.plot(r["curve_steps"], r[f"curve_cosine_{variant}"], "-", color=color, alpha=0.25, lw=1)
            at, mean = mean_curve(g, f"curve_cosine_{variant}")
            ax.plot(at, mean, "-o", ms=4, color=color, label=f"along {variant} training (mean of {len(g)} seeds)")
        ax.axhline(SEED_COSINE, color="black", ls="--", lw=1, label=f"seed: {SEED_COSINE}")
        ax.set(xlabel="training step (Adam)", title=f"{steps} training steps, prefix 6 of 12")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("gradient cosine, cached-prefix vs full")
    axes[0, 0].legend(loc="lower left", fontsize=9)
    fig.suptitle("Gradient cosine during training (thin lines: one seed each)")
    fig.tight_layout()
    return fig


def _draw_tensor_cosine(df: pd.DataFrame, table: pd.DataFrame):
    """Per variant, a heatmap of the cosine per parameter tensor against the training step."""
    g = _main_runs(df)
    names = list(g["tensor_names"].iloc[0])
    at = list(g["curve_steps"].iloc[0])
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 6.4), sharey=True, layout="constrained")
    for ax, variant in zip(axes, ("full", "cached"), strict=True):
        grid = stacked(g[f"curve_tensor_cosine_{variant}"]).mean(axis=0).T  # tensors x curve points
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(at)), [str(a) for a in at], fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set(xlabel="training step", title=f"along {variant} training")
    axes[0].set_ylabel("parameter tensor (h0 = layer 1, h1 = layer 2)")
    fig.colorbar(im, ax=axes, shrink=0.8, label="gradient cosine, cached-prefix vs full (mean over seeds)")
    fig.suptitle(f"Gradient cosine per parameter tensor, prefix 6 of 12, {int(g['train_steps'].iloc[0])} steps")
    return fig


def _draw_suffix_loss(df: pd.DataFrame, table: pd.DataFrame):
    """The held-out suffix loss after each budget against the prefix length, full and cached."""
    fig, ax = pyplot().subplots(figsize=(8, 4.4))
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


def _draw_loss_curve(df: pd.DataFrame, table: pd.DataFrame):
    """Per budget, the training-batch loss and the held-out suffix loss along training."""
    fig, axes, panels = _budget_panels(_curve_runs(df))
    for ax, steps, g in panels:
        for variant, color in (("full", "#2ca02c"), ("cached", "#d62728")):
            batch = stacked(g[f"train_loss_{variant}"]).mean(axis=0)
            ax.plot(batch, "-", color=color, alpha=0.35, lw=1, label=f"{variant}: training batch")
            at, mean = mean_curve(g, f"curve_suffix_loss_{variant}")
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


# The curve facts: key, column, what is measured, unit, number format.
CURVE_FACTS = (
    ("cosine", "curve_cosine", "gradient cosine along {} training", "cosine", ".3f"),
    ("loss", "curve_suffix_loss", "held-out suffix loss of {} training", "loss", ".3g"),
)


@listed
def facts(df: pd.DataFrame) -> Iterator[Fact]:
    """The quoted figures: per seed at prefix 6, then the mean curves and the per-tensor cosine at initialisation."""
    ok = ok_rows(df)
    for steps, g in ok[ok["prefix_len"] == 6].groupby("train_steps"):
        yield Fact(
            f"training_per_seed_{int(steps)}",
            f"training at prefix 6 of 12, {int(steps)} steps, per seed: gradient cosine; suffix loss full / cached",
            "; ".join(
                f"seed {int(r['seed'])}: {r['grad_cosine']:.3f}; {r['suffix_loss_full']:.3f} / "
                f"{r['suffix_loss_cached']:.3f}"
                for _, r in g.sort_values("seed").iterrows()
            ),
        )
    at6 = _curve_runs(df)
    if not len(at6):
        return
    yield from (
        Fact(
            f"training_{key}_curve_{variant}_{int(steps)}",
            f"training at prefix 6 of 12, {int(steps)} steps: {what.format(variant)} (mean over seeds), step: {unit}",
            ", ".join(f"{int(a)}: {c:{fmt}}" for a, c in zip(*mean_curve(g, f"{column}_{variant}"), strict=True)),
        )
        for steps, g in at6.groupby("train_steps")
        for key, column, what, unit, fmt in CURVE_FACTS
        for variant in VARIANTS
    )
    main = _main_runs(df)
    names = list(main["tensor_names"].iloc[0])
    init = stacked(main["curve_tensor_cosine_full"])[:, 0, :].mean(axis=0)
    tensors = ", ".join(f"{names[i]} {init[i]:.3f}" for i in np.argsort(init, kind="stable"))
    what = "gradient cosine per parameter tensor at initialisation (mean over seeds), lowest first"
    yield Fact("training_tensor_cosine_init", f"training at prefix 6 of 12: {what}", tensors)


FIGURES = (
    Figure(
        "training_cosine",
        "Training: gradient cosine against the cached prefix length",
        "The cosine between the full gradient and the cached-prefix gradient (prefix K/V treated as constants), "
        "at initialisation, on a fixed batch of 32 sequences.",
        _columns(training_table, "train_steps", "prefix_len", "seeds", "cosine", "cosine_min", "cosine_max"),
        _draw_cosine,
    ),
    Figure(
        "training_curve",
        "Training: gradient cosine during training",
        "The cosine between the full and the cached-prefix gradient on the fixed batch of 32 sequences, at the "
        "parameters each variant has reached after that many Adam steps (step 0 is the cosine at initialisation). "
        "Along full training it dips while the model learns to attend back to the prefix, through the seed's "
        "0.857, and recovers once the task is learned; along cached training it keeps falling.",
        _columns(
            training_curve_table, "train_steps", "step", "seeds", "cosine_full_training", "cosine_cached_training"
        ),
        _draw_cosine_curve,
    ),
    Figure(
        "training_tensors",
        "Training: gradient cosine per parameter tensor",
        "The same cosine, tensor by tensor. The gap sits in the key and value projections (wk, wv) and the "
        "pre-attention norms and embeddings, through which the prefix's keys and values depend on the parameters. "
        "Tensors that the prefix's keys and values do not depend on (the last layer's queries, output projection, "
        "MLP and its norm, the final norm, the output head) get the same gradient either way (cosine 1.000).",
        training_tensor_table,
        _draw_tensor_cosine,
    ),
    Figure(
        "training_loss",
        "Training: held-out suffix loss, cached prefix vs full",
        "After the same Adam budget from the same initialisation: the held-out loss over the learnable suffix "
        "positions, full training against training with the prefix's K/V as constants.",
        _columns(training_table, "train_steps", "prefix_len", "seeds", "suffix_loss_full", "suffix_loss_cached"),
        _draw_suffix_loss,
    ),
    Figure(
        "training_loss_curve",
        "Training: loss curves, cached prefix vs full",
        "Thin lines: each step's training-batch loss over positions 6..11 (what each variant minimises); markers: "
        "the held-out loss over the learnable suffix positions at the curve points (the last one is the figure of "
        "the claims table). Stars: the seed's final losses, drawn at the end of each budget.",
        _columns(training_curve_table, "train_steps", "step", "seeds", "suffix_loss_full", "suffix_loss_cached"),
        _draw_loss_curve,
    ),
)


STUDY = study_of(
    globals(),
    "training",
    "cached-prefix training (prefix K/V as constants) vs full training on a 12-token successor task",
    rank=50,
)
