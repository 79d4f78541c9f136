"""The ``check`` study: sweep a model factory's arguments and the checker's options through
:func:`kvfast.check.check_cache`, one row per check.

A run calls ``factory(**args)`` -- ``factory`` is a config field naming a callable as
``"package.module:NAME"``, ``args`` are the study's factory-argument fields -- then checks the
model's cache against its full recompute on a random prompt (``prompt_len`` tokens drawn from
``prompt_seed``) for ``steps`` decode steps in ``mode`` (``exact``: ``==`` at every step;
``control``: against the model's order-noise floor), over ``scenarios`` (``decode``,
``resume`` or ``both``). Result columns: ``verdict`` and ``passed`` (the report's),
``first_divergent_step`` (-1 if none), ``worst_deviation`` (largest \\|cache - recompute\\|
logit over every step and scenario), ``ratio`` (control mode: the worst step's deviation over its
floor bound; null in exact mode), ``worst_scenario`` and ``tokens`` (the checked token ids).

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

import functools
import importlib
import os
import sys
from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.check import CheckOptions, KvfastModel, check_cache_with
from kvfast.check.checker import as_model_under_test
from kvfast.check.protocol import vocab_of
from kvfast.kernels.attention import ATTENTION_CODES
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.model.config import ModelConfig, init_params
from kvfast.numerics import PRESETS, Numerics
from kvfast.studies.base import Claim, Study
from kvfast.studies.common import MODEL_SHAPE_FIELDS, ok_rows, require_config_choice
from kvfast.studies.criteria import EXACT, judged
from kvfast.validation import not_allowed, require_int

VERSION = "1"
MODES = ("exact", "control")
SCENARIO_CHOICES = {"decode": ("decode",), "resume": ("resume",), "both": ("decode", "resume")}
NO_BUG = "none"

CHECK_FIELDS: dict[str, pa.DataType] = {
    "prompt_seed": pa.int64(),
    "prompt_len": pa.int64(),
    "steps": pa.int64(),
    "mode": pa.string(),
    "scenarios": pa.string(),
}
RESULT_FIELDS: dict[str, pa.DataType] = {
    "verdict": pa.string(),
    "passed": pa.bool_(),
    "first_divergent_step": pa.int64(),
    "worst_deviation": pa.float64(),
    "ratio": pa.float64(),
    "worst_scenario": pa.string(),
    "tokens": pa.string(),
}


def kvfast_model(
    seed: int,
    n_layer: int,
    n_head: int,
    d_model: int,
    d_ff: int,
    vocab: int,
    preset: str,
    order: str,
    attention: str,
    bug: str,
    max_pos: int = 256,
) -> KvfastModel:
    """kvfast's transformer with random parameters from ``seed``, in ``preset``/``order``/``attention``,
    with catalogue bug ``bug`` (``"none"``: clean). The built-in ``check`` study's default factory."""
    cfg = ModelConfig(vocab=vocab, d_model=d_model, n_head=n_head, n_layer=n_layer, d_ff=d_ff, max_pos=max_pos)
    numerics = Numerics.preset(preset, order, attention)
    return KvfastModel(cfg, init_params(cfg, seed), numerics, bug=None if bug == NO_BUG else bug)


@functools.lru_cache(maxsize=64)
def load_factory(ref: str) -> Callable:
    """The callable ``"package.module:NAME"`` names (``ValueError`` if it cannot be imported)."""
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise not_allowed("factory", ref, "'package.module:NAME', a callable that returns a model")
    module_name, name = ref.split(":")
    if os.getcwd() not in sys.path:  # as `python -m` would: modules of the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is bad input
        raise ValueError(f"factory: {ref!r} cannot be imported ({type(exc).__name__}: {exc})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise not_allowed("factory", ref, f"a callable; {module_name} has no callable {name!r}")
    return factory


def _validate_check(config: dict) -> None:
    load_factory(config.get("factory"))
    require_int(config.get("prompt_seed"), "prompt_seed", 0)
    require_int(config.get("prompt_len"), "prompt_len", 1, 4096)
    require_int(config.get("steps"), "steps", 1, 4096)
    require_config_choice(config, "mode", MODES)
    require_config_choice(config, "scenarios", tuple(SCENARIO_CHOICES))


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
        claims=claims,
        validate_groups=arg_groups,
    )


def check_options(config: dict) -> CheckOptions:
    """The checker's options a run's ``config`` names (``steps``, ``mode``, ``scenarios``)."""
    return CheckOptions(config["steps"], config["mode"], SCENARIO_CHOICES[config["scenarios"]])


def check_one(model, config: dict) -> dict:
    """One :func:`check_cache` of ``model`` as the check's options in ``config`` name; the result columns."""
    model = as_model_under_test(model)  # a Hugging Face model gets its adapter here
    rng = np.random.default_rng([config["prompt_seed"], config["prompt_len"], 11])
    prompt = rng.integers(0, vocab_of(model), size=config["prompt_len"]).astype(np.int64)
    report = check_cache_with(model, prompt, check_options(config))
    scenarios = {k: s for k, s in report.scenarios.items() if len(s.deviation)}
    worst_name = max(scenarios, key=lambda k: float(np.max(scenarios[k].deviation)), default="")
    worst = scenarios.get(worst_name)
    ratios = [float(np.max(s.ratio)) for s in scenarios.values() if s.ratio is not None and len(s.ratio)]
    first = report.first_divergent_step
    return {
        "verdict": report.verdict,
        "passed": bool(report.passed),
        "first_divergent_step": -1 if first is None else int(first),
        "worst_deviation": float(np.max(worst.deviation)) if worst is not None else 0.0,
        "ratio": max(ratios) if ratios else None,
        "worst_scenario": worst_name,
        "tokens": ",".join(map(str, report.tokens)),
    }


def _validate_kvfast_args(config: dict) -> None:
    for name in ("n_layer", "n_head", "d_model", "d_ff", "vocab"):
        require_int(config.get(name), name, 1, 4096)
    require_int(config.get("seed"), "seed", 0)
    if config["d_model"] % config["n_head"]:
        raise ValueError(
            f"d_model: {config['d_model']} is not allowed with n_head={config['n_head']}; allowed: a multiple of n_head"
        )
    require_config_choice(config, "preset", tuple(PRESETS))
    require_config_choice(config, "order", tuple(ORDER_CODES))
    require_config_choice(config, "attention", tuple(ATTENTION_CODES))
    from kvfast.model.bugs import BUGS

    require_config_choice(config, "bug", (NO_BUG, *BUGS))


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per verdict and mode: checks, and the worst deviation."""
    ok = ok_rows(df)
    if not len(ok):
        return ok
    keys = [k for k in ("bug", "mode", "verdict") if k in ok.columns]
    return ok.groupby(keys).agg(checks=("run_id", "size"), worst_deviation=("worst_deviation", "max")).reset_index()


def claims(df: pd.DataFrame) -> list[Claim]:
    """Clean models pass every check; bugged ones fail every exact check (kvfast's own model)."""
    ok = ok_rows(df)
    if "bug" not in ok.columns or not len(ok):
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

__all__ = ["STUDY", "check_one", "check_options", "check_study", "kvfast_model", "load_factory"]
