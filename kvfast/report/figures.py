"""The report's figures: every study's declared :class:`~kvfast.sweep.study.Figure` s, computed from its runs.

The report knows no study by name: it walks the registry
(:data:`kvfast.studies.STUDIES`) in each study's declared ``rank`` (ties in
registry order) and turns each figure a study declares into a
:class:`Section`: the table of the numbers plotted (always computed; the page
shows it when matplotlib is absent) and a ``draw`` that returns a matplotlib
Figure (only called when matplotlib, the ``plot`` extra, is installed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from kvfast.studies import STUDIES
from kvfast.studies.common import ok_rows
from kvfast.studies.plotting import matplotlib_available
from kvfast.sweep.study import Figure, Study

__all__ = ["Section", "matplotlib_available", "ordered_studies", "section", "sections"]


@dataclass
class Section:
    """One figure of the report: ``table`` holds what ``draw()`` plots; ``note`` says what is not stored."""

    key: str
    title: str
    caption: str
    table: pd.DataFrame
    draw: Callable[[], object] | None = None
    note: str = ""


def ordered_studies(studies: dict[str, Study] | None = None) -> list[Study]:
    """The registered studies (default :data:`kvfast.studies.STUDIES`) in page order: by ``rank``, ties in
    registry order."""
    registry = enumerate((STUDIES if studies is None else studies).values())
    return [study for _, study in sorted(registry, key=lambda pair: (pair[1].rank, pair[0]))]


def section(figure: Figure, df: pd.DataFrame) -> Section:
    """``figure`` of a study computed on its stored runs ``df``: its table now, its plot when drawn."""
    table = figure.table(df)
    draw = None if figure.draw is None else (lambda: figure.draw(df, table))
    return Section(figure.key, figure.title, figure.caption, table, draw, figure.note)


def sections(results: dict[str, pd.DataFrame]) -> list[Section]:
    """Every section the stored ``results`` (study name -> runs) allow, in page order: each registered study
    with ok runs, its declared figures in order."""
    out = []
    for study in ordered_studies():
        df = results.get(study.name)
        if df is None or not len(ok_rows(df)):
            continue
        out += [section(figure, df) for figure in study.figures]
    return out
