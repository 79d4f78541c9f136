"""The bug study: every catalogue bug on the real cached path against a full recompute, at every step.

One run = one bug (or ``"none"``, the clean control) x one case (model kind,
seed, depth, head count, prompt length). The run generates ``steps`` tokens
greedily with the bugged cache and compares each step's logits with a full
recompute of *the same* sequence (the prompt plus the tokens the bugged run
chose so far), so that a deviation is the cache's alone. The comparison is
:func:`kvfast.check.check_cache` on :class:`kvfast.check.KvfastModel` with the
bug (exact mode, the ``decode`` scenario, ``steps - 1`` decode steps), the tool
users get, with ``follow="cache"``: the bugged cache's own greedy tokens are
fed, as a bugged deployment would generate them (the check's default would
feed the recompute's tokens and never let a bug change the text). Step 0 is the
prompt (every prompt row; the prefill carries no bug), step ``i >= 1`` decode
step ``i``. The check's fast path makes the reference one recompute of the
final sequence, after verifying that appending a token moves no earlier row.
The clean cached run is checked the same way in every run (``clean_dev``,
expected exactly 0.0) and its tokens are the reference for "the output
changed". A run's tokens are the cache's greedy choices: the fed ones plus the
last, chosen from the last decode's logits.

Models (``model``):

- ``random``: :func:`kvfast.init_params` with the case's ``seed``;
- ``trained``: the same architecture trained by :func:`kvfast.studies.toytask.train`
  on the ``cycle`` task (the first :data:`TASK_PREFIX` tokens repeated; vocab
  from the config, sequences of ``MAX_POS + 1`` tokens) for :data:`TRAIN_STEPS`
  Adam steps of :data:`TRAIN_BATCH` sequences at learning rate :data:`TRAIN_LR`,
  from seed :data:`TRAIN_SEED` (one trained model per architecture; the case
  seed only picks the prompt).

Prompts (both models): :data:`TASK_PREFIX` uniformly random tokens drawn from
``seed`` and ``prompt_len``, continued by the cycle task to ``prompt_len``
tokens, so the trained model sees in-distribution prompts and both model
kinds see the same ones. Every model has ``max_pos = MAX_POS``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.bugs.kvfast_model import BUGS, EVICT_WINDOW, VISIBLE_AT_STEP_1
from kvfast.check import KvfastModel, check_cache
from kvfast.model.config import ModelConfig, init_params
from kvfast.numerics import PRESETS, Numerics
from kvfast.studies.common import (
    MODEL_SHAPE_FIELDS,
    NO_BUG,
    aggregated,
    declared_order,
    first_index,
    listed,
    model_config,
    ok_rows,
    require_config_choice,
    require_model_shape,
    stacked,
    step_range,
    study_of,
    tabled,
)
from kvfast.studies.criteria import EXACT, VS_SEED, judged
from kvfast.studies.plotting import COLORS, SYMLOG_FLOOR, pyplot
from kvfast.studies.toytask import CycleTask, train
from kvfast.sweep.study import Claim, Fact, Figure
from kvfast.validation import require_int

VERSION = "1"

CONTROL = NO_BUG  # the clean control run
BUG_CHOICES = (*BUGS, CONTROL)
MODEL_KINDS = ("random", "trained")
MAX_POS = 32
TASK_PREFIX = 4
TRAIN_SEED = 0
TRAIN_STEPS = 200
TRAIN_LR = 0.01
TRAIN_BATCH = 8

# The seed's table (its five named bugs): step-1 deviation, all-steps deviation, output changed (%).
SEED_BUG_TABLE: dict[str, tuple[float, float, float]] = {
    "stale": (0.146, 0.448, 0.0),
    "posoff": (24.9, 24.9, 100.0),
    "freeze": (0.0, 24.6, 96.0),
    "evict": (0.0, 0.254, 0.0),
    "posfrozen": (0.0, 25.5, 100.0),
}

CONFIG_FIELDS = {
    "bug": pa.string(),
    "model": pa.string(),
    "seed": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "prompt_len": pa.int64(),
    "steps": pa.int64(),
    "preset": pa.string(),
}
RESULT_FIELDS = {
    "dev_step1": pa.float64(),
    "dev_all": pa.float64(),
    "dev_per_step": pa.list_(pa.float64()),
    "first_bad_step": pa.int64(),
    "tokens_changed": pa.bool_(),
    "first_changed_token": pa.int64(),
    "clean_dev": pa.float64(),
    "clean_margin_min": pa.float64(),
    "tokens": pa.string(),
    "clean_tokens": pa.string(),
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_config_choice(config, "bug", BUG_CHOICES)
    require_config_choice(config, "model", MODEL_KINDS)
    require_config_choice(config, "preset", tuple(PRESETS))
    require_model_shape(config, max_layers=16, max_width=1024, min_vocab=2)
    require_int(config.get("prompt_len"), "prompt_len", 1, EVICT_WINDOW - 1)
    require_int(config.get("steps"), "steps", 2, MAX_POS + 1 - config["prompt_len"])


def task_for(vocab: int) -> CycleTask:
    """The toy task of the trained models: the cycle task with period :data:`TASK_PREFIX`."""
    return CycleTask(vocab=vocab, length=MAX_POS + 1, prefix=TASK_PREFIX)


def model_for(config: dict) -> tuple[ModelConfig, dict]:
    """The model a config names (random from ``seed``, or trained once per architecture)."""
    cfg = model_config(config, MAX_POS)
    if config["model"] == "random":
        return cfg, init_params(cfg, config["seed"])
    return cfg, train(cfg, task_for(cfg.vocab), TRAIN_SEED, TRAIN_STEPS, TRAIN_LR, TRAIN_BATCH)


def prompt_for(config: dict) -> np.ndarray:
    """``prompt_len`` tokens of the cycle task, its free prefix drawn from ``seed`` and ``prompt_len``."""
    rng = np.random.default_rng([config["seed"], config["prompt_len"], 0xB065])
    head = rng.integers(0, config["vocab"], size=TASK_PREFIX)
    return task_for(config["vocab"]).complete(head, config["prompt_len"])


def check_run(
    cfg: ModelConfig, params: dict, numerics: Numerics, prompt: np.ndarray, steps: int, bug: str | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One generation of ``steps`` tokens by the (bugged) cache, checked by :func:`kvfast.check.check_cache`
    (see the module docstring). Returns the tokens ``(steps,)``, the cache's logits that chose them
    ``(steps, V)`` (row 0 the prompt's last, row ``i`` decode step ``i``), the check's per-step deviation
    ``(steps,)`` and its first divergent step (``-1`` if none)."""
    model = KvfastModel(cfg, params, numerics, bug=bug)
    report = check_cache(model, prompt, steps - 1, mode="exact", scenarios="decode", follow="cache", keep_logits=True)
    scen = report.scenarios["decode"]
    logits = scen.cache_logits[prompt.shape[0] - 1 :]
    first = scen.first_divergent_step
    return np.argmax(logits, axis=1), logits, scen.deviation, -1 if first is None else first


def run(config: dict) -> dict:
    """One bug x case; see the module docstring. Columns: :data:`RESULT_FIELDS`."""
    cfg, params = model_for(config)
    numerics = Numerics.preset(config["preset"])
    prompt = prompt_for(config)
    steps = config["steps"]
    clean_t, clean_l, clean_dev, clean_first = check_run(cfg, params, numerics, prompt, steps, None)
    if config["bug"] != CONTROL:
        bug_t, _, dev, first_bad = check_run(cfg, params, numerics, prompt, steps, config["bug"])
    else:
        bug_t, dev, first_bad = clean_t, clean_dev, clean_first
    top2 = np.sort(clean_l, axis=1)[:, -2:]
    return {
        "dev_step1": float(dev[1]),
        "dev_all": float(dev.max()),
        "dev_per_step": [float(x) for x in dev],
        "first_bad_step": first_bad,
        "tokens_changed": bool((bug_t != clean_t).any()),
        "first_changed_token": first_index(bug_t != clean_t),
        "clean_dev": float(clean_dev.max()),
        "clean_margin_min": float((top2[:, 1] - top2[:, 0]).min()),
        "tokens": ",".join(map(str, bug_t)),
        "clean_tokens": ",".join(map(str, clean_t)),
    }


def bug_key(model: str, bug: str) -> dict[str, object]:
    """The first columns of a row per model kind and bug: ``model``, ``bug`` and ``visible_at_step_1``
    (whether the bug shows at the first decode step; ``False`` for the clean control)."""
    return {"model": model, "bug": bug, "visible_at_step_1": VISIBLE_AT_STEP_1.get(bug, False)}


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """The seed's table per model kind and bug: max deviation at step 1 and over all steps, % of runs
    whose tokens changed, the first deviating step's range; the seed's figures beside them."""
    out = aggregated(
        ok_rows(df),
        ["model", "bug"],
        cases=("dev_step1", "size"),
        step_1=("dev_step1", "max"),
        all_steps=("dev_all", "max"),
        output_changed_pct=("tokens_changed", lambda changed: 100.0 * float(changed.mean())),
        first_bad_step=("first_bad_step", step_range),
    )
    if out.empty:
        return out
    out.insert(2, "visible_at_step_1", [VISIBLE_AT_STEP_1.get(bug, False) for bug in out["bug"]])
    seed = [SEED_BUG_TABLE.get(bug, (np.nan, np.nan, np.nan)) for bug in out["bug"]]
    out[["seed_step_1", "seed_all_steps", "seed_output_changed_pct"]] = np.array(seed, dtype=np.float64)
    return out.sort_values(["model", "bug"], key=declared_order({"bug": BUG_CHOICES})).reset_index(drop=True)


def _pct(x: float) -> str:
    return f"{x:.0f}%"


@listed
def claims(df: pd.DataFrame) -> Iterator[Claim]:
    """The seed's bug-table claims, as measured on every model kind in ``df``."""
    ok = ok_rows(df)
    if ok.empty:
        return
    growth = [b for b in BUGS if not VISIBLE_AT_STEP_1[b]]
    g = ok[ok["bug"].isin(growth)]
    if len(g):
        worst1 = float(g["dev_step1"].max())
        bitten = g.groupby("bug")["dev_all"].max()
        yield judged(
            "growth bugs are exactly 0.0 at step 1 (" + ", ".join(growth) + ")",
            "0.0 (freeze, evict, posfrozen)",
            f"max {worst1!r} over {len(g)} runs; later max " + ", ".join(f"{b} {bitten[b]:.3g}" for b in bitten.index),
            EXACT,
            [
                ("step-1 deviation of every growth-bug run == 0.0", worst1 == 0.0),
                ("each growth bug deviates at a later step in some run", bool((bitten > 0).all())),
            ],
        )
    v = ok[ok["bug"].isin([b for b in BUGS if VISIBLE_AT_STEP_1[b]])]
    if len(v):
        yield judged(
            "step-1-visible bugs deviate at step 1 in every run",
            "stale 0.146, posoff 24.9",
            f"{int((v['dev_step1'] > 0).sum())} of {len(v)} runs, min {float(v['dev_step1'].min()):.3g}",
            EXACT,
            [
                (
                    "step-1 deviation > 0.0 in every run of stale, posoff, kvswap, noscale",
                    bool((v["dev_step1"] > 0).all()),
                )
            ],
        )
    c = ok[ok["bug"] == CONTROL]
    clean = ok["clean_dev"]
    yield judged(
        "clean cached path equals a full recompute (every run's control)",
        "0.0",
        f"max {float(clean.max())!r} over {len(ok)} runs" + (f" ({len(c)} clean-control rows)" if len(c) else ""),
        EXACT,
        [("clean run's deviation == 0.0 in every run", bool((clean == 0.0).all()))],
    )
    for bug, (_, _, seed_pct) in SEED_BUG_TABLE.items():
        b = ok[ok["bug"] == bug]
        if b.empty:
            continue
        per_model = b.groupby("model")["tokens_changed"].mean() * 100.0
        figure = ", ".join(f"{m} {_pct(p)}" for m, p in per_model.items())
        yield judged(
            f"{bug} changes the generated tokens",
            f"{_pct(seed_pct)} of runs",
            figure,
            VS_SEED,
            [
                (f"{m} models: {_pct(p)} == {_pct(seed_pct)} (whole percents)", round(p) == seed_pct)
                for m, p in per_model.items()
            ],
        )


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


@tabled(["model", "bug", "step", "runs", "max_dev", "median_dev"])
def bug_deviation_table(df: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """Per model kind, bug and step: max and median over runs of the deviation at that step."""
    ok = ok_rows(df)
    for (model, bug), g in ok[ok["bug"] != "none"].groupby(["model", "bug"]):
        dev = stacked(g["dev_per_step"])
        steps = np.arange(dev.shape[1])
        stats = {"max_dev": dev.max(axis=0), "median_dev": np.median(dev, axis=0)}
        yield pd.DataFrame({"model": model, "bug": bug, "step": steps, "runs": dev.shape[0], **stats})


def _draw_deviation_per_step(df: pd.DataFrame, table: pd.DataFrame):
    """Per bug, a panel of the max and median deviation per step, for each model kind."""
    bugs = [b for b in BUGS if b in set(table["bug"])]
    nrow = -(-len(bugs) // 4)  # four panels a row
    fig, axes = pyplot().subplots(nrow, 4, figsize=(13, 3.4 * nrow), sharex=True, sharey=True, squeeze=False)
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
            f"{bug}: {kind}\n" + (f"seed: {seed[0]:g} at step 1, {seed[1]:g} over all" if seed else "(not in the seed)")
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


@listed
def facts(df: pd.DataFrame) -> Iterator[Fact]:
    """The quoted figures: each model kind's median clean top-2 margin, then how often evict changes the output
    per model kind and depth, and at which prompt lengths."""
    ok = ok_rows(df)
    for model, g in ok.groupby("model"):
        yield Fact(
            f"margin_median_{model}",
            f"{model} models: median over runs of the smallest top-1 minus top-2 logit margin of the clean generation",
            f"{float(g['clean_margin_min'].median()):.3g} ({len(g)} runs)",
        )
    for (model, n_layer), runs in ok[ok["bug"] == "evict"].groupby(["model", "n_layer"]):
        changed = runs[runs["tokens_changed"]]
        prompts = ", ".join(str(p) for p in sorted(set(changed["prompt_len"].astype(int))))
        yield Fact(
            f"evict_changed_{model}_{int(n_layer)}layer",
            f"evict changes the output: {model} models with {int(n_layer)} layer(s)",
            f"{100 * float(runs['tokens_changed'].mean()):.0f}% of {len(runs)} runs"
            + (f" (prompt lengths {prompts})" if len(changed) else ""),
        )


FIGURES = (
    Figure(
        "bugs",
        "Each bug's deviation from a full recompute, per step",
        "Max and median over runs (48 per bug and model kind) of the largest |logit difference| between the bugged "
        "cache and a full recompute of the same tokens, at each step. Step 0 is the prompt, step 1 the first "
        "decode (dotted). The y axis is symmetric-log so that a deviation of exactly 0.0 sits on the bottom "
        "axis: the growth bugs are 0.0 at step 1 and deviate from step 2 (evict when the cache passes 16).",
        bug_deviation_table,
        _draw_deviation_per_step,
    ),
)


STUDY = study_of(
    globals(),
    "bugs",
    "each catalogue bug's logit deviation from a full recompute at step 1 and at every step",
    rank=10,
)
