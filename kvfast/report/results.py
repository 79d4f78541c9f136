"""The stored results a report reads: the study results directories under a root, and their runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from kvfast.studies import STUDIES
from kvfast.sweep.store import MANIFEST, ResultsDir, load


def study_dirs(root: str | os.PathLike) -> dict[str, Path]:
    """Study name -> results directory, for ``root`` itself (one study) or every folder under it that has a
    manifest, in study-name order. ``ValueError`` naming ``RESULTS_DIR`` when there is none."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"RESULTS_DIR: {str(root)!r} is not allowed; allowed: a directory of kvfast results")
    candidates = [base] if (base / MANIFEST).is_file() else sorted(p for p in base.iterdir() if p.is_dir())
    found: dict[str, Path] = {}
    for path in candidates:
        if (path / MANIFEST).is_file() and (name := _study_of(path)) in STUDIES:
            found[name] = path
    if not found:
        raise ValueError(
            f"RESULTS_DIR: {str(root)!r} is not allowed; allowed: a results directory or a folder of them "
            f"(each with {MANIFEST}, as `kvfast reproduce --out DIR` writes), of the studies {', '.join(STUDIES)}"
        )
    return dict(sorted(found.items()))


def _study_of(path: Path) -> str:
    """The study ``path``'s manifest names (``""`` for none); ``ValueError`` naming the file and the remedy when
    it is not a JSON object (truncated, a list)."""
    manifest = path / MANIFEST
    try:
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError) as exc:
        data = exc
    if not isinstance(data, dict):
        why = str(data).splitlines()[0] if isinstance(data, Exception) else f"a JSON {type(data).__name__}"
        raise ValueError(f"{manifest}: not a kvfast manifest ({why}); {ResultsDir(path).remedy()}")
    return str(data.get("study", ""))


def load_results(root: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Study name -> its stored runs (:func:`kvfast.load`), for every study under ``root``."""
    return {name: load(path) for name, path in study_dirs(root).items()}
