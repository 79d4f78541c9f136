"""The sweep engine: grids (TOML), parallel runs (joblib, Dask), Parquet results, resume.

See ``docs/sweep.md`` for the grid format and the results schema.
"""

from kvfast.sweep.engine import BACKENDS, SweepReport, run_sweep
from kvfast.sweep.grid import Grid, Run, builtin_grids, grid_from_spec, load_grid
from kvfast.sweep.ids import canonical_json, run_id
from kvfast.sweep.store import MANIFEST, ResultsDir, list_parts, load, schema_for

__all__ = [
    "BACKENDS",
    "MANIFEST",
    "Grid",
    "ResultsDir",
    "Run",
    "SweepReport",
    "builtin_grids",
    "canonical_json",
    "grid_from_spec",
    "list_parts",
    "load",
    "load_grid",
    "run_id",
    "run_sweep",
    "schema_for",
]
