"""What the studies share: the model-shape config fields and their validation, a config's
:class:`~kvfast.ModelConfig`, a choice among a study's values, the ok rows of a results table, and a study
module's :class:`~kvfast.sweep.study.Study` from its conventional names (:func:`study_of`).

Integers are validated with :func:`kvfast.validation.require_int` (a study's own
fields: ``require_int(config.get(name), name, lo, hi)``), so every message has
the form ``FIELD: VALUE is not allowed; allowed: WHAT``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.model.config import ModelConfig
from kvfast.sweep.study import Study
from kvfast.validation import not_allowed, require_int

#: The ``bug`` axis's value of a clean run (no bug injected), in every study with such an axis.
NO_BUG = "none"

# The config columns that size a run's transformer (every study has them, in this order).
MODEL_SHAPE_FIELDS: dict[str, pa.DataType] = {
    "n_layer": pa.int64(),
    "n_head": pa.int64(),
    "d_model": pa.int64(),
    "d_ff": pa.int64(),
    "vocab": pa.int64(),
}


def require_config_choice(config: dict, field: str, allowed: Sequence) -> None:
    """``ValueError`` unless ``config[field]`` is one of ``allowed`` (listed in that order; bools only match bools)."""
    listed = ", ".join(map(str, allowed))
    if field not in config:
        raise ValueError(f"{field}: missing; allowed: {listed}")
    value = config[field]
    if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
        raise not_allowed(field, value, listed)


def require_model_shape(config: dict, max_layers: int = 4096, max_width: int = 4096, min_vocab: int = 1) -> None:
    """``ValueError`` unless ``seed`` and the :data:`MODEL_SHAPE_FIELDS` of ``config`` are in range.

    ``seed >= 0``; ``n_layer`` in ``[1, max_layers]``; ``d_model`` in ``[1, max_width]``;
    ``n_head`` in ``[1, d_model]`` and dividing ``d_model``; ``d_ff`` in ``[1, 4096]``;
    ``vocab`` in ``[min_vocab, 4096]``.
    """
    require_int(config.get("seed"), "seed", 0)
    require_int(config.get("n_layer"), "n_layer", 1, max_layers)
    d_model = require_int(config.get("d_model"), "d_model", 1, max_width)
    n_head = require_int(config.get("n_head"), "n_head", 1, d_model)
    require_int(config.get("d_ff"), "d_ff", 1, 4096)
    require_int(config.get("vocab"), "vocab", min_vocab, 4096)
    if d_model % n_head:
        raise ValueError(f"d_model: {d_model} is not allowed with n_head={n_head}; allowed: a multiple of n_head")


def model_config(config: dict, max_pos: int) -> ModelConfig:
    """The transformer a run's config names (its :data:`MODEL_SHAPE_FIELDS`)."""
    return ModelConfig(**{name: config[name] for name in MODEL_SHAPE_FIELDS}, max_pos=max_pos)


def aggregated(runs: pd.DataFrame, keys: str | list[str], /, **named) -> pd.DataFrame:
    """``runs`` per group of ``keys`` (a categorical key in its categories' order, those present only): the keys,
    then one column per named aggregation (any name: ``runs`` and ``keys`` too); no column at all when there is no
    run (a summary of nothing)."""
    return runs.groupby(keys, observed=True).agg(**named).reset_index() if len(runs) else pd.DataFrame()


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The runs of ``df`` stored with ``status == "ok"`` (all rows when there is no ``status`` column)."""
    return df[df["status"] == "ok"] if "status" in df.columns else df


def first_index(mask: np.ndarray) -> int:
    """The index of the first true element of ``mask``, ``-1`` if none."""
    idx = np.nonzero(mask)[0]
    return int(idx[0]) if idx.size else -1


def stacked(column: pd.Series) -> np.ndarray:
    """A list column of runs as one float64 array, one row per run (a run's list of lists: its rows)."""
    return np.array([np.asarray(list(v), dtype=np.float64) for v in column])


def bits_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise bit equality of two float64 arrays (their bit patterns: ``-0.0`` is not ``0.0``, NaN is NaN)."""
    return np.ascontiguousarray(a).view(np.uint64) == np.ascontiguousarray(b).view(np.uint64)


def first_bug_step(report) -> int:
    """The earliest step at which any scenario of a check ``report`` says ``bug``, ``-1`` if none does."""
    steps = [s.first_bug_step for s in report.scenarios.values() if s.first_bug_step is not None]
    return int(min(steps)) if steps else -1


def step_range(steps: pd.Series, none: str = "never", median: bool = False) -> str:
    """The steps ``>= 0`` of ``steps`` as ``LO`` or ``LO-HI`` (with `` (median M)`` where asked); ``none`` when there
    are none."""
    s = steps[steps >= 0]
    if s.empty:
        return none
    lo, hi = int(s.min()), int(s.max())
    return str(lo) if lo == hi else f"{lo}-{hi}" + (f" (median {float(s.median()):g})" if median else "")


def listed(items: Callable[..., Iterable]) -> Callable[..., list]:
    """``items`` with what it yields collected in a list: a study's claims or facts written as a generator."""

    @functools.wraps(items)
    def collected(*args, **kwargs) -> list:
        return list(items(*args, **kwargs))

    return collected


def tabled(columns: Sequence[str] | None = None) -> Callable:
    """A function that yields a table's rows (dicts), or its parts (DataFrames, stacked in order), made one that
    returns the table (``columns``: its columns, in this order, when it has no row)."""

    def decorate(rows: Callable[..., Iterable[dict | pd.DataFrame]]) -> Callable[..., pd.DataFrame]:
        @functools.wraps(rows)
        def table(*args, **kwargs) -> pd.DataFrame:
            items = list(rows(*args, **kwargs))
            if items and isinstance(items[0], pd.DataFrame):
                return pd.concat(items, ignore_index=True)
            return pd.DataFrame(items, columns=columns)

        return table

    return decorate


def declared_order(order: Mapping[str, Sequence]) -> Callable[[pd.Series], pd.Series]:
    """A ``sort_values`` key: a column that ``order`` names ranks by its values' places there (values not
    listed last); any other column sorts as it is."""

    def rank(column: pd.Series) -> pd.Series:
        values = order.get(column.name)
        return column if values is None else column.map({v: i for i, v in enumerate(values)}).fillna(len(values))

    return rank


# Study field -> the name a study module gives it (study_of finds each that the module defines).
MODULE_NAMES = {
    "version": "VERSION",
    "run": "run",
    "config_fields": "CONFIG_FIELDS",
    "result_fields": "RESULT_FIELDS",
    "validate_config": "validate_config",
    "summarize": "summarize",
    "claims": "claims",
    "figures": "FIGURES",
    "facts": "facts",
}


def study_of(namespace: dict, name: str, description: str, **fields) -> Study:
    """The :class:`Study` ``name`` of a study module: each field of :data:`MODULE_NAMES` that its ``namespace``
    (``globals()``) defines, under that name; ``fields``: the others (``rank``, ``tables``, ...) and overrides."""
    found = {field: namespace[attr] for field, attr in MODULE_NAMES.items() if attr in namespace}
    return Study(name=name, description=description, **{**found, **fields})
