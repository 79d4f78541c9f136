"""The exactness study: greedy generation with and without the cache, compared at every step with ``==``.

A run is one :func:`kvfast.check.check_cache` of :class:`kvfast.check.KvfastModel`
(exact mode, the ``decode`` scenario, ``follow="cache"``), so the study proves the
tool users get. The cache generates ``steps`` tokens greedily (its own choices:
``steps - 1`` decode steps, the last token chosen from the last decode's
logits); each step is compared with ``==`` with a full recompute of the same
sequence (the check's fast path: one recompute of the final sequence, after
verifying that appending a token moves no earlier row). Step 0 is the prompt
(every prompt row), step ``i >= 1`` decode step ``i``. ``tokens_equal``: the
recompute's greedy choice equals the cache's at every step, which is exactly
"a generation without the cache gives the same tokens" (the two agree up to
their first differing token, so the first differing token is the same in
both views). A one-token generation (``steps = 1``) has no decode step; the
check then runs one (``max_pos`` has room) and the run keeps step 0 only.

Version 2: a run's model is its seed's and shape's whatever its length (the position embeddings are
drawn after every other parameter, :func:`model_for`); version 1 drew them second, so every length
had a model of its own.
"""

from __future__ import annotations

import functools
import operator
import threading

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.check import CheckOptions, KvfastModel, check_cache_with
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.model.config import ModelConfig, init_params
from kvfast.numerics import PRESETS, Numerics
from kvfast.studies.common import (
    MODEL_SHAPE_FIELDS,
    model_config,
    ok_rows,
    require_config_choice,
    require_model_shape,
)
from kvfast.studies.criteria import EXACT, judged
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Claim, Figure, Study
from kvfast.validation import require_int

VERSION = "2"

CONFIG_FIELDS = {
    "seed": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "prompt_len": pa.int64(),
    "steps": pa.int64(),
    "order": pa.string(),
    "preset": pa.string(),
}
RESULT_FIELDS = {
    "storage": pa.string(),
    "accum": pa.string(),
    "max_abs_dev": pa.float64(),
    "first_bad_step": pa.int64(),
    "tokens_equal": pa.bool_(),
    "tokens": pa.string(),
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_model_shape(config)
    for name in ("prompt_len", "steps"):
        require_int(config.get(name), name, 1, 4096)
    require_config_choice(config, "order", tuple(ORDER_CODES))
    require_config_choice(config, "preset", tuple(PRESETS))


def model_for(config: dict) -> tuple[ModelConfig, dict]:
    """The model a run's config names: one per seed and shape, whatever the run's length.

    Its parameters are :func:`~kvfast.model.config.init_params` of the seed with the position embeddings
    drawn last (``positions_last``), so no weight depends on ``max_pos``: a run of any length sees the same
    model, row ``p`` of ``wpe`` included. Its ``max_pos`` is :func:`positions` of the run's length, so the
    runs of a seed and shape share one parameter set (no shape depends on ``n_head`` either), drawn once per
    process and never written to (read-only: every run's :class:`~kvfast.check.KvfastModel` reuses its
    prepared weights, :func:`kvfast.check.adapters.prepared_weights`). Validation happened when the grid
    was planned.
    """
    return _model(config["seed"], _shape_of(config), positions(config["prompt_len"] + config["steps"]))


_shape_of = operator.itemgetter(*MODEL_SHAPE_FIELDS)  # a config's model shape, as a tuple (one C call a run)

MIN_POSITIONS = 32


def positions(length: int) -> int:
    """The ``max_pos`` of a run of ``length`` tokens: the smallest power of two that holds them, at least
    :data:`MIN_POSITIONS` (every run of the built-in grid: one model per seed and shape). The model's rows
    past the run's length are never read: they change no result."""
    return max(MIN_POSITIONS, 1 << (length - 1).bit_length())


@functools.lru_cache(maxsize=256)
def _model(seed: int, shape: tuple[int, ...], max_pos: int) -> tuple[ModelConfig, dict]:
    cfg = model_config(dict(zip(MODEL_SHAPE_FIELDS, shape, strict=True)), max_pos)
    return cfg, _params(seed, cfg.vocab, cfg.d_model, cfg.n_layer, cfg.d_ff, max_pos)


@functools.lru_cache(maxsize=64)
def _params(seed: int, vocab: int, d_model: int, n_layer: int, d_ff: int, max_pos: int) -> dict:
    """The parameters of these sizes (any ``n_head``: one stands for all), once per process; read-only arrays."""
    params = init_params(ModelConfig(vocab, d_model, 1, n_layer, d_ff, max_pos), seed, positions_last=True)
    for array in params.values():
        array.flags.writeable = False
    return params


def prompt_for(config: dict) -> np.ndarray:
    """The run's prompt: ``prompt_len`` tokens in ``[0, vocab)`` drawn from ``(seed, prompt_len)``; read-only
    (drawn once per process)."""
    return _prompt(config["seed"], config["prompt_len"], config["vocab"])


@functools.lru_cache(maxsize=64)
def _prompt(seed: int, prompt_len: int, vocab: int) -> np.ndarray:
    rng = np.random.default_rng([seed, prompt_len, 7])
    prompt = rng.integers(0, vocab, size=prompt_len).astype(np.int64)
    prompt.flags.writeable = False
    return prompt


@functools.lru_cache(maxsize=64)
def _options(steps: int) -> CheckOptions:
    """The check a run of ``steps`` tokens makes (options are immutable: one object per step count)."""
    return CheckOptions(max(1, steps - 1), "exact", scenarios="decode", follow="cache", keep_logits=True)


def model_under_test(config: dict) -> KvfastModel:
    """The :class:`~kvfast.check.KvfastModel` a run checks: :func:`model_for`'s model in the run's numerics.

    One per model, numerics and thread, kept for the process: the check's prefill gives it a fresh cache, its
    only state, so the runs of one model and numerics reuse it (its prepared weights included) and compute the
    same bits as with a model of their own; one per thread, since a check fills the model's cache while it runs
    (a sweep's threads run side by side).
    """
    max_pos = positions(config["prompt_len"] + config["steps"])
    return _model_under_test(
        config["seed"], _shape_of(config), max_pos, config["preset"], config["order"], threading.get_ident()
    )


@functools.lru_cache(maxsize=64)
def _model_under_test(
    seed: int, shape: tuple[int, ...], max_pos: int, preset: str, order: str, thread: int
) -> KvfastModel:
    cfg, params = _model(seed, shape, max_pos)
    return KvfastModel(cfg, params, Numerics.preset(preset, order))


def clear_caches() -> None:
    """Forget what the study keeps between runs in this process (models, the models under test and their
    parameter sets, prompts, check options): a fresh process's state (the benchmarks time runs from
    it)."""
    for cached in (_model, _params, _prompt, _options, _model_under_test):
        cached.cache_clear()


def run(config: dict) -> dict:
    """One run (see the module doc). Columns: :data:`RESULT_FIELDS`."""
    model = model_under_test(config)
    numerics = model.numerics
    prompt = prompt_for(config)
    steps, T = config["steps"], config["prompt_len"]
    report = check_cache_with(model, prompt, _options(steps)).scenarios["decode"]
    first_bad = report.first_divergent_step  # the first step whose deviation is not 0 (None: none)
    t_cached = report.cache_logits[T - 1 : T - 1 + steps].argmax(axis=1).tolist()  # Python ints
    # every compared row equal (==): the recompute's choices are the cache's (no second argmax to pay for)
    t_full = t_cached if first_bad is None else report.reference[T - 1 : T - 1 + steps].argmax(axis=1).tolist()
    return {
        "storage": numerics.storage,
        "accum": numerics.accum,
        # (a Python max: no reduction's set-up; every step equal: 0.0, the deviations' zeros)
        "max_abs_dev": 0.0 if first_bad is None else max(report.deviation[:steps].tolist()),
        "first_bad_step": first_bad if first_bad is not None and first_bad < steps else -1,
        "tokens_equal": t_cached == t_full,
        "tokens": ",".join(map(str, t_cached)),  # Python ints: the same text, without NumPy's str per token
    }


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset: runs, the worst deviation and the share of runs whose tokens are equal."""
    ok = ok_rows(df)
    return (
        ok.groupby("preset")
        .agg(runs=("run_id", "size"), max_abs_dev=("max_abs_dev", "max"), tokens_equal=("tokens_equal", "mean"))
        .reset_index()
    )


def claims(df: pd.DataFrame) -> list[Claim]:
    """Every run bit-exact, with equal tokens (criteria in :func:`kvfast.studies.criteria.judged`)."""
    ok = ok_rows(df)
    worst = float(ok["max_abs_dev"].max()) if len(ok) else float("nan")
    equal = int(ok["tokens_equal"].sum())
    return [
        judged(
            "cached decode == full recompute (bit-exact) over the grid",
            "1,296 runs, worst deviation 0.0, all tokens equal",
            f"{len(ok):,} runs ok of {len(df):,}, worst deviation {worst}, {equal:,} token strings equal",
            EXACT,
            [
                ("every run ok", bool(len(ok) and len(ok) == len(df))),
                ("worst deviation == 0.0", worst == 0.0),
                ("every token string equal", bool(len(ok)) and equal == len(ok)),
            ],
        )
    ]


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


def exactness_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset and order: runs, worst deviation, runs bit-exact at every step, runs with equal tokens."""
    ok = ok_rows(df)
    return (
        ok.groupby(["preset", "order"])
        .agg(
            runs=("max_abs_dev", "size"),
            worst_dev=("max_abs_dev", "max"),
            exact_runs=("max_abs_dev", lambda s: int((s == 0.0).sum())),
            tokens_equal=("tokens_equal", "sum"),
        )
        .reset_index()
    )


def _draw_exact_runs(df: pd.DataFrame, table: pd.DataFrame):
    """Per preset and order, the runs bit-exact at every step against all runs, with the worst deviation."""
    plt = pyplot()
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


FIGURES = (
    Figure(
        "exactness",
        "Exactness: the grid's worst deviation per preset",
        "Every run compares the cached logits with a full recompute at every step with ==.",
        exactness_table,
        _draw_exact_runs,
    ),
)


STUDY = Study(
    name="exactness",
    version=VERSION,
    description="greedy generation with and without the cache, logits compared with == at every step",
    run=run,
    config_fields=CONFIG_FIELDS,
    result_fields=RESULT_FIELDS,
    validate_config=validate_config,
    summarize=summarize,
    claims=claims,
    validate_groups=(("d_model", "n_head"),),  # d_model % n_head; every other field is checked alone
    figures=FIGURES,
    rank=60,
)
