"""Stored results of a reproduce: one results directory per study under a root, read back from Parquet."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from kvfast.studies import STUDIES
from kvfast.sweep.store import MANIFEST, ResultsDir, load


def study_dirs(root: str | os.PathLike) -> dict[str, Path]:
    """Study name -> results directory, for ``root`` itself (one study) or every folder under it that has a
    manifest, in study-name order. ``ValueError`` naming ``RESULTS_DIR`` when there is none, and naming the
    manifest and the remedy when one is broken (:meth:`~kvfast.sweep.store.ResultsDir.manifest`)."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"RESULTS_DIR: {str(root)!r} is not allowed; allowed: a directory of kvfast results")
    candidates = [base] if (base / MANIFEST).is_file() else sorted(p for p in base.iterdir() if p.is_dir())
    found: dict[str, Path] = {}
    for path in candidates:
        if (path / MANIFEST).is_file() and (name := ResultsDir(path).manifest()["study"]) in STUDIES:
            found[name] = path
    if not found:
        raise ValueError(
            f"RESULTS_DIR: {str(root)!r} is not allowed; allowed: a results directory or a folder of them "
            f"(each with {MANIFEST}, as `kvfast reproduce --out DIR` writes), of the studies {', '.join(STUDIES)}"
        )
    return dict(sorted(found.items()))


def load_results(root: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Study name -> its stored runs (:func:`kvfast.load`), for every study under ``root``."""
    return {name: load(path) for name, path in study_dirs(root).items()}
