"""The sweep engine: grids (TOML), parallel runs (joblib, Dask), Parquet results, resume; in-process runs.

See ``docs/sweep.md`` for the grid format and the results schema. A study's contract is imported from here:
``from kvfast.sweep import Study, Claim`` (and ``Fact``, ``Figure`` for the report). ``run_inline`` runs a
grid in this process and stores nothing (library users, tests).
"""

from kvfast.sweep.engine import BACKENDS, SweepReport, run_inline, run_sweep
from kvfast.sweep.grid import (
    DEFAULT_MAX_RUNS,
    Grid,
    GridRun,
    builtin_grids,
    grid_from_configs,
    grid_from_spec,
    load_grid,
    resolve_study,
)
from kvfast.sweep.ids import canonical_json, run_id
from kvfast.sweep.store import MANIFEST, ResultsDir, list_parts, load, schema_for
from kvfast.sweep.study import REGISTERED, Claim, Fact, Figure, Study, StudyRegistry

__all__ = [
    "BACKENDS",
    "DEFAULT_MAX_RUNS",
    "Claim",
    "Fact",
    "Figure",
    "MANIFEST",
    "REGISTERED",
    "Grid",
    "GridRun",
    "ResultsDir",
    "Study",
    "StudyRegistry",
    "SweepReport",
    "builtin_grids",
    "canonical_json",
    "grid_from_configs",
    "grid_from_spec",
    "list_parts",
    "load",
    "load_grid",
    "resolve_study",
    "run_id",
    "run_inline",
    "run_sweep",
    "schema_for",
]
