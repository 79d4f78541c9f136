"""The ``check`` study: sweep a model factory's arguments and the checker's options through
:func:`kvfast.check.check_cache`, one row per check.

A run calls ``factory(**args)`` -- ``factory`` is a config field naming a callable as
``"package.module:NAME"``, ``args`` are the study's factory-argument fields -- then checks the model's cache
against its full recompute on a random prompt (``prompt_len`` tokens drawn from ``prompt_seed``) for ``steps``
decode steps in ``mode`` (``auto``: exact where every step is bit-equal, else against the model's order
noise; ``exact``: ``==`` at every step; ``control``: against the model's order-noise floor), with ``promote``
(``float64``: the float64 logic check; ``none``), over ``scenarios`` (``decode``, ``resume`` or ``both``; the
cache operations ``rollback``, ``fork``, ``reorder``, ``padded``, or ``operations``: decode and all four,
those a model has no hooks for reported as skipped). Result columns: ``verdict`` (the deciding verdict: a
logic check's where it overrode the model's own format) and ``passed`` (the report's), ``native_verdict`` (the
verdict in the model's own format) beside ``logic_verdict`` (the float64 logic check's; null where none ran),
``failed_scenario`` and ``failed_step`` (where the check failed: the scenario and step of the first bug, or of
the first divergence or inconclusive step where none is a bug, in the check that decided; ``""`` and -1 when it
passed), ``first_divergent_step`` (the first step whose logits are not bit-equal, rounding included; -1 if
none), ``worst_deviation`` (largest \\|cache - recompute\\| logit over every step and scenario), ``ratio``
(the worst step's deviation over its bound where the check was judged against one; null where judged bit for
bit), ``worst_scenario`` and ``tokens`` (the checked token ids).

The built-in ``check`` study's factory arguments are those of :func:`kvfast_model` (kvfast's own
transformer: shape, seed, preset, order, attention kernel, catalogue bug). A package sweeps its own
model by building its own study with :func:`check_study` and naming it in a grid::

    # mypkg/sweeps.py
    STUDY = check_study("mymodel_check", {"width": pa.int64(), "dtype": pa.string()})
    # grid.toml: study = "mypkg.sweeps:STUDY", factory = "mypkg.models:make", [axes] width = [...]

A factory that cannot be imported is refused before any run (exit 2); a factory that raises for
some arguments is an ``error`` row for that run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.bugs.kvfast_model import BUGS, kvfast_model  # noqa: F401 - kvfast_model: the built-in study's factory
from kvfast.check import CheckOptions, check_cache_with
from kvfast.check.checker import as_model_under_test
from kvfast.check.options import MODES, PROMOTE
from kvfast.check.protocol import vocab_of
from kvfast.kernels.attention import ATTENTION_CODES
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.numerics import PRESETS
from kvfast.runtime import load_object
from kvfast.studies.common import (
    MODEL_SHAPE_FIELDS,
    NO_BUG,
    declared_order,
    ok_rows,
    require_config_choice,
    require_model_shape,
    step_range,
)
from kvfast.studies.criteria import EXACT, judged
from kvfast.studies.plotting import SYMLOG_FLOOR, pyplot
from kvfast.sweep.study import Claim, Figure, Study
from kvfast.validation import require_int

VERSION = "3"  # 2: failed_scenario and failed_step; 3: native_verdict and logic_verdict
SCENARIO_CHOICES = {
    "decode": ("decode",), "resume": ("resume",), "both": ("decode", "resume"),
    # the cache operations (kvfast.check.scenarios): a grid axis value each, or all with decode
    "rollback": ("rollback",), "fork": ("fork",), "reorder": ("reorder",), "padded": ("padded",),
    "operations": ("decode", "rollback", "fork", "reorder", "padded"),
}  # fmt: skip

CHECK_FIELDS: dict[str, pa.DataType] = {
    "prompt_seed": pa.int64(),
    "prompt_len": pa.int64(),
    "steps": pa.int64(),
    "mode": pa.string(),
    "scenarios": pa.string(),
    "promote": pa.string(),
}
RESULT_FIELDS: dict[str, pa.DataType] = {
    "verdict": pa.string(),
    "passed": pa.bool_(),
    "first_divergent_step": pa.int64(),
    "worst_deviation": pa.float64(),
    "ratio": pa.float64(),
    "worst_scenario": pa.string(),
    "tokens": pa.string(),
    "failed_scenario": pa.string(),
    "failed_step": pa.int64(),
    "native_verdict": pa.string(),
    "logic_verdict": pa.string(),
}


@functools.lru_cache(maxsize=64)
def load_factory(ref: str) -> Callable:
    """The callable ``"package.module:NAME"`` names (:func:`kvfast.runtime.load_object`'s rules and messages:
    ``ValueError`` if it cannot be found, :class:`kvfast.runtime.UserCodeError` if its module raises or exits)."""
    return load_object(ref, "factory", accept=callable, allowed="a callable that returns a model")


def _validate_check(config: dict) -> None:
    load_factory(config.get("factory"))
    require_int(config.get("prompt_seed"), "prompt_seed", 0)
    require_int(config.get("prompt_len"), "prompt_len", 1, 4096)
    require_int(config.get("steps"), "steps", 1, 4096)
    require_config_choice(config, "mode", MODES)
    require_config_choice(config, "scenarios", tuple(SCENARIO_CHOICES))
    require_config_choice(config, "promote", ("none", *PROMOTE))  # "none": no logic check
    check_options(config)  # the checker's own validation of what the fields name, before any run


def check_study(
    name: str,
    arg_fields: dict[str, pa.DataType],
    *,
    version: str = VERSION,
    validate_args: Callable[[dict], None] | None = None,
    arg_groups: tuple[tuple[str, ...], ...] = (),
    description: str = "a model factory's arguments and the checker's options, one check_cache per run",
) -> Study:
    """A check study whose factory takes the keyword arguments ``arg_fields`` (name -> Arrow type).

    Config fields: ``factory``, the argument fields, then :data:`CHECK_FIELDS`.
    ``validate_args(config)`` checks the arguments before any run (``arg_groups``:
    arguments it checks together; every other field is checked alone).
    """
    overlap = sorted(set(arg_fields) & ({"factory"} | set(CHECK_FIELDS)))
    if overlap:
        raise ValueError(f"arg_fields: {overlap[0]!r} is not allowed; allowed: names other than the check's fields")

    def validate(config: dict) -> None:
        _validate_check(config)
        if validate_args is not None:
            validate_args(config)

    def run(config: dict) -> dict:
        factory = load_factory(config["factory"])
        model = factory(**{k: config[k] for k in arg_fields})
        return check_one(model, config)

    return Study(
        name=name,
        version=version,
        description=description,
        run=run,
        config_fields={"factory": pa.string(), **arg_fields, **CHECK_FIELDS},
        result_fields=RESULT_FIELDS,
        validate_config=validate,
        summarize=summarize,
        validate_groups=arg_groups,
    )


def check_options(config: dict) -> CheckOptions:
    """The checker's options a run's ``config`` names (``steps``, ``mode``, ``scenarios``, ``promote``)."""
    promote = None if config["promote"] == "none" else config["promote"]
    return CheckOptions(config["steps"], config["mode"], SCENARIO_CHOICES[config["scenarios"]], promote=promote)


def check_one(model, config: dict) -> dict:
    """One :func:`check_cache` of ``model`` as the check's options in ``config`` name; the result columns."""
    model = as_model_under_test(model)  # a Hugging Face model gets its adapter here
    rng = np.random.default_rng([config["prompt_seed"], config["prompt_len"], 11])
    prompt = rng.integers(0, vocab_of(model), size=config["prompt_len"]).astype(np.int64)
    report = check_cache_with(model, prompt, check_options(config))
    scenarios = {k: s for k, s in report.scenarios.items() if len(s.deviation)}
    worst_name = max(scenarios, key=lambda k: float(np.max(scenarios[k].deviation)), default="")
    worst = scenarios.get(worst_name)
    first = report.first_divergent_step
    failed = report.decider().worst
    failed_step = None if failed is None or failed.passed else failed.focus_step()
    return {
        "verdict": report.verdict,
        "passed": bool(report.passed),
        "first_divergent_step": -1 if first is None else int(first),
        "worst_deviation": float(np.max(worst.deviation)) if worst is not None else 0.0,
        "ratio": report.max_ratio,
        "worst_scenario": worst_name,
        "tokens": ",".join(map(str, report.tokens)),
        "failed_scenario": "" if failed_step is None else failed.name,
        "failed_step": -1 if failed_step is None else int(failed_step),
        "native_verdict": report.native_verdict,
        "logic_verdict": None if report.promoted is None else report.promoted.verdict,
    }


def _validate_kvfast_args(config: dict) -> None:
    require_model_shape(config)
    require_config_choice(config, "preset", tuple(PRESETS))
    require_config_choice(config, "order", tuple(ORDER_CODES))
    require_config_choice(config, "attention", tuple(ATTENTION_CODES))
    require_config_choice(config, "bug", (NO_BUG, *BUGS))


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per verdict and mode: checks, and the worst deviation."""
    ok = ok_rows(df)
    if not len(ok):
        return ok
    keys = [k for k in ("bug", "mode", "verdict") if k in ok.columns]
    return ok.groupby(keys).agg(checks=("run_id", "size"), worst_deviation=("worst_deviation", "max")).reset_index()


#: The built-in study's factory (under both names a grid may give it): the claims are about its rows only.
OWN_FACTORY = ("kvfast.studies.check:kvfast_model", "kvfast.bugs.kvfast_model:kvfast_model")


def claims(df: pd.DataFrame) -> list[Claim]:
    """Clean models pass every check; bugged ones fail every exact check (kvfast's own model: the rows of the built-in
    factory; a sweep of a user's own factory through this study has no claim)."""
    if "bug" not in df.columns or "factory" not in df.columns:
        return []
    df = df[df["factory"].isin(OWN_FACTORY)]
    ok = ok_rows(df)
    if not len(ok):
        return []
    clean = ok[ok["bug"] == NO_BUG]
    bugged = ok[(ok["bug"] != NO_BUG) & (ok["mode"] == "exact")]
    passed_clean = int(clean["passed"].astype(bool).sum())
    failed_bugged = int((~bugged["passed"].astype(bool)).sum())
    return [
        judged(
            "check sweep: clean configurations pass, bugged ones are caught (exact mode)",
            "(not in the seed)",
            f"{passed_clean:,} of {len(clean):,} clean checks pass; "
            f"{failed_bugged:,} of {len(bugged):,} bugged exact checks fail",
            EXACT,
            [
                ("every check ok", len(ok) == len(df)),
                ("every clean check passes", bool(len(clean)) and passed_clean == len(clean)),
                ("every bugged exact check fails", bool(len(bugged)) and failed_bugged == len(bugged)),
            ],
        )
    ]


# --- the report: the built-in study's figure (kvfast.report shows it: see Figure) --------------------------

VERDICT_COLORS = {
    "exact": "#2ca02c",
    "rounding": "#98df8a",
    "inconclusive": "#c7c7c7",
    "divergent": "#ff9896",
    "bug": "#d62728",
    "length-dependent": "#9467bd",
    "skipped": "#7f7f7f",
    "unchecked": "#000000",
}
VERDICT_COLUMNS = ["checks", "passed", "verdicts", "first_divergent_step", "worst_deviation", "ratio_max"]


def verdict_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per catalogue bug, mode and preset (those of the columns present): checks, checks passed, each verdict's
    count (``"bug 4"``), the first divergent step's range over the checks that diverged (``-`` for none), the worst
    deviation and (control mode) the largest deviation over its floor bound."""
    ok = ok_rows(df)
    keys = [k for k in ("bug", "mode", "preset") if k in ok.columns]
    rows = []
    for key, g in ok.groupby(keys) if keys and len(ok) else ():
        counts = g["verdict"].value_counts()
        rows.append(
            {
                **dict(zip(keys, key, strict=True)),
                "checks": len(g),
                "passed": int(g["passed"].astype(bool).sum()),
                "verdicts": ", ".join(f"{v} {int(counts[v])}" for v in sorted(counts.index)),
                "first_divergent_step": step_range(g["first_divergent_step"], none="-"),
                "worst_deviation": float(g["worst_deviation"].max()),
                "ratio_max": float(g["ratio"].max()) if g["ratio"].notna().any() else np.nan,
            }
        )
    out = pd.DataFrame(rows, columns=[*keys, *VERDICT_COLUMNS])
    # bugs clean first then in catalogue order, modes and presets in their declared order
    rank = declared_order({"bug": (NO_BUG, *BUGS), "mode": MODES, "preset": tuple(PRESETS)})
    return out.sort_values(keys, key=rank, kind="stable").reset_index(drop=True) if keys else out


def _draw_verdicts(df: pd.DataFrame, table: pd.DataFrame):
    """Left: the worst deviation per bug and preset; right: per bug and mode, the checks by verdict."""
    ok = ok_rows(df)
    bugs = list(dict.fromkeys(table["bug"]))
    presets = list(dict.fromkeys(table["preset"]))
    modes = [m for m in MODES if m in set(table["mode"])]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / max(len(presets), 1)
    for i, preset in enumerate(presets):
        worst = [float(table[(table["bug"] == b) & (table["preset"] == preset)]["worst_deviation"].max()) for b in bugs]
        x = np.arange(len(bugs)) + (i - (len(presets) - 1) / 2) * width
        left.bar(x, worst, width, label=f"preset {preset}", color=("#1f77b4", "#ff7f0e", "#9467bd")[i % 3])
        for xi, w in zip(x, worst, strict=True):
            if w == 0.0:
                left.text(xi, 1e-9, "0.0", ha="center", va="bottom", fontsize=8, rotation=90)
    left.set_yscale("symlog", linthresh=SYMLOG_FLOOR)
    left.set_ylim(0, 20.0 * float(table["worst_deviation"].max() or 1.0))
    left.set_xticks(range(len(bugs)), bugs)
    left.set_xlabel("model variant (catalogue bug; none: clean)")
    left.set_ylabel("worst |cache - recompute| logit\n(symlog, 0 at bottom)")
    left.set_title("Worst deviation over every step and scenario")
    left.grid(axis="y", alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    verdicts = [v for v in VERDICT_COLORS if v in set(ok["verdict"])]
    labels = [f"{b}\n{m}" for b in bugs for m in modes]
    counts = pd.crosstab([ok["bug"], ok["mode"]], ok["verdict"])
    counts = counts.reindex(pd.MultiIndex.from_product([bugs, modes]), fill_value=0)
    bottom = np.zeros(len(labels))
    for verdict in verdicts:
        n = counts[verdict].to_numpy()
        right.bar(range(len(labels)), n, bottom=bottom, color=VERDICT_COLORS[verdict], label=verdict)
        bottom += n
    right.set_xticks(range(len(labels)), labels, fontsize=8)
    right.set(ylabel="checks", title="Checks by verdict, per model variant and mode")
    right.legend(fontsize=8, loc="upper right", ncol=len(verdicts))
    right.set_ylim(0, 1.25 * float(bottom.max() or 1.0))
    fig.tight_layout()
    return fig


FIGURES = (
    Figure(
        "check",
        "Check sweep: verdicts and deviations of clean and bugged models",
        "Each run builds kvfast's model (clean, or with a catalogue bug) and checks its cache against a full "
        "recompute at every decode step of both scenarios (decode, resume), in exact mode (== at every step) and "
        "in control mode (against the model's order-noise floor). Left: the worst deviation per model variant "
        "and preset (the y axis is symmetric-log, so exactly 0.0 is the bottom axis). Right: the checks by "
        "verdict: every clean check passes in both modes, every bugged one fails.",
        verdict_table,
        _draw_verdicts,
    ),
)


KVFAST_ARGS: dict[str, pa.DataType] = {
    "seed": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "preset": pa.string(),
    "order": pa.string(),
    "attention": pa.string(),
    "bug": pa.string(),
}

STUDY = check_study(
    "check",
    KVFAST_ARGS,
    validate_args=_validate_kvfast_args,
    arg_groups=(("d_model", "n_head"),),
    description="kvfast's model factory over shape/format/kernel/bug, each configuration through check_cache",
)


# the built-in study's claims (about kvfast's own model and its bug catalogue: no user study has them) and its place
# in the report
STUDY = dataclasses.replace(STUDY, claims=claims, figures=FIGURES, rank=90)


__all__ = ["STUDY", "check_one", "check_options", "check_study", "kvfast_model", "load_factory"]
