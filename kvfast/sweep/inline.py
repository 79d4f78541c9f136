"""Running a grid in this process, for library users and tests: :func:`run_inline`.

Everything goes through :mod:`kvfast.sweep.grid`, the parser and validation
that ``kvfast run`` uses: the same ``[[union]]`` expansion, the same checks
before any run, the same run ids. Nothing is stored; for Parquet results, a
resumable sweep and several workers use :func:`kvfast.sweep.run_sweep`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import pandas as pd

from kvfast.sweep.grid import Grid, grid_from_configs, grid_from_spec, load_grid


def as_grid(grid: Grid | str | os.PathLike | dict | Iterable[dict], study: str | None = None) -> Grid:
    """A :class:`Grid` from a grid, a built-in grid name or TOML path, a parsed spec (dict), or configs of ``study``."""
    if isinstance(grid, Grid):
        return grid
    if isinstance(grid, str | os.PathLike):
        return load_grid(str(grid))
    if isinstance(grid, dict):
        return grid_from_spec(grid)
    if study is None:
        raise ValueError("study: None is not allowed with a list of configs; allowed: a study name")
    return grid_from_configs(study, grid)


def run_inline(grid: Grid | str | os.PathLike | dict | Iterable[dict], study: str | None = None) -> pd.DataFrame:
    """Run every run of ``grid`` (see :func:`as_grid`) here, in grid order; one row per run.

    Columns: the study's config fields, its result fields, ``run_id`` and
    ``status`` (``"ok"``), as :func:`kvfast.load` gives them for a sweep. A run
    that raises stops the call with its exception.
    """
    g = as_grid(grid, study)
    rows = [{**run.config, **g.study.run(dict(run.config)), "run_id": run.run_id, "status": "ok"} for run in g.runs]
    return pd.DataFrame(rows, columns=[*g.study.config_fields, *g.study.result_fields, "run_id", "status"])
