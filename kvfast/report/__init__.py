"""The report: the claims table, the quoted figures and the plots, computed from stored results alone.

Sits between :mod:`kvfast.sweep` and :mod:`kvfast.commands` in the one-way
import order. ``kvfast report RESULTS_DIR`` (and the end of ``kvfast
reproduce``) calls :func:`write_report`.
"""

from __future__ import annotations

from kvfast.report.claims import (
    claims_markdown,
    claims_table,
    count_line,
    counts,
    facts,
    load_results,
    markdown,
    study_dirs,
)
from kvfast.report.page import render, report_dir, summaries, write_report, write_tables

__all__ = [
    "claims_markdown",
    "claims_table",
    "count_line",
    "counts",
    "facts",
    "load_results",
    "markdown",
    "render",
    "report_dir",
    "study_dirs",
    "summaries",
    "write_report",
    "write_tables",
]
