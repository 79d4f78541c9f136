"""Running a grid in this process, for library users and tests: :func:`run_inline`, and detector scoring
over the detector study's grid (:func:`score_detector`, :func:`compare_detectors`).

Everything goes through :mod:`kvfast.sweep.grid`, the parser and validation
that ``kvfast run`` uses: the same ``[[union]]`` expansion, the same checks
before any run, the same run ids. Nothing is stored; for Parquet results, a
resumable sweep and several workers use :func:`kvfast.sweep.run_sweep`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import pandas as pd

from kvfast.check import score
from kvfast.studies.detector import DetectorCase
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


# --- detector scoring over the detector study's grid ---------------------------------------------


def default_cases() -> list[DetectorCase]:
    """The detector study's cases (grid ``detector.toml``): 240 bugged, then 30 clean controls.

    8 bugs and a clean control x 3 depths x 2 head counts x 5 (seed, prompt
    length) pairs on random float64 models (d_model 16, d_ff 32, vocab 32),
    16 generated tokens (15 decode steps).
    """
    return [DetectorCase(config) for config in load_grid("detector").configs if config["model"] == "random"]


def _cases(cases: Iterable | None) -> list:
    if cases is None:
        return default_cases()
    return [DetectorCase(c) if isinstance(c, dict) else c for c in cases]


def score_detector(detector: Callable, cases: Sequence | None = None) -> pd.DataFrame:
    """:func:`kvfast.check.score_detector` over ``cases`` (default :func:`default_cases`; config dicts allowed)."""
    return score.score_detector(detector, _cases(cases))


def compare_detectors(detectors: dict[str, Callable] | None = None, cases: Sequence | None = None) -> pd.DataFrame:
    """:func:`kvfast.check.compare_detectors` (default :data:`kvfast.check.DETECTORS`) over ``cases``
    (default :func:`default_cases`; config dicts allowed)."""
    return score.compare_detectors(detectors, _cases(cases))
