"""The sweep's contract with a study: a run function over a config, its columns, how to summarise it, and how
the report shows it; and the registry studies register into.

The sweep engine knows studies only through this interface: it expands a grid
of configs, calls ``study.run(config)`` for each, and stores the returned
columns. A run's numbers depend only on its config (seeds derive from it).
The report (:mod:`kvfast.report`) knows studies only through it too: it walks
the registry and shows each study's declared :class:`Figure` s, :class:`Fact` s
and extra tables; it names no study.

A grid names its study by a name looked up in a :class:`StudyRegistry` (the command line passes
``kvfast.studies.STUDIES``; the API's default is :data:`REGISTERED`, which ``kvfast.studies`` fills with the
built-in studies when it is imported), by an entry point, or as ``"package.module:ATTR"``
(:func:`kvfast.sweep.grid.resolve_study`). The sweep imports nothing from ``kvfast.studies``: studies sit
above it (``tests/test_layering.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import pandas as pd
import pyarrow as pa


@dataclass(frozen=True)
class Claim:
    """One of the seed's claims, as a study measured it.

    ``criterion``: how ``holds`` is decided, in words, starting with its kind
    (``exact``, ``vs seed``, ``direction only``, ``test``; see
    :mod:`kvfast.studies.criteria`); ``conditions``: each condition evaluated,
    ``(words, result)``; ``holds`` is their conjunction. Build claims with
    :func:`kvfast.studies.criteria.judged`.
    """

    claim: str
    seed_figure: str
    kvfast_figure: str
    holds: bool
    criterion: str = ""
    conditions: tuple[tuple[str, bool], ...] = ()


class Fact(NamedTuple):
    """One figure the docs quote, computed from a study's stored runs: a unique ``key``, the
    ``figure`` in words and its ``value`` as text (``kvfast report DIR --markdown facts`` prints them)."""

    key: str
    figure: str
    value: str


@dataclass(frozen=True)
class Figure:
    """One figure of the report, declared by its study: one idea, its numbers and its plot.

    - ``key``: the page's anchor for it (unique over every study's figures); ``title``; ``caption``: what
      to look at.
    - ``table(runs) -> DataFrame``: the numbers plotted, from the study's stored runs (every status; keep
      the ``ok`` ones with :func:`kvfast.studies.common.ok_rows`). Always computed: the page shows it
      under the plot, or instead of it when matplotlib is absent.
    - ``draw(runs, table) -> matplotlib.figure.Figure``: the plot of ``table`` (``runs`` for what the
      table does not hold); called only when matplotlib (the ``plot`` extra) is installed, so import it
      inside, e.g. with :func:`kvfast.studies.plotting.pyplot`. ``None``: the table alone.
    - ``note``: what the stored runs do not hold, shown beside the figure.
    """

    key: str
    title: str
    caption: str
    table: Callable[[pd.DataFrame], pd.DataFrame]
    draw: Callable[[pd.DataFrame, pd.DataFrame], object] | None = None
    note: str = ""


@dataclass(frozen=True)
class Study:
    """A run function plus its schema.

    - ``run(config) -> dict``: one run; returns the result columns (``result_fields``).
    - ``config_fields`` / ``result_fields``: column name -> Arrow type, in order.
    - ``validate_config(config)``: raise ``ValueError`` naming the field, the value and
      what is allowed, before any run starts.
    - ``summarize(df) -> DataFrame``: the printed table; ``claims(df) -> list[Claim]``.
    - ``version``: part of every run's id; bump it when the run's numbers change.

    How the report shows it (all optional; a study declares them next to its run function):

    - ``figures``: its :class:`Figure` s, in page order.
    - ``facts(df) -> list[Fact]``: the figures the docs quote (``(key, figure, value)`` tuples).
    - ``tables``: more summary tables, ``(name, function of the runs)`` pairs: written as
      ``summaries/NAME.csv`` after the study's own and printed by ``--markdown tables``.
    - ``rank``: where its figures go on the page: lower first, ties in registry (name) order.

    ``reproduce``: whether ``kvfast reproduce`` runs its built-in grid (``False``: an experiment run by name,
    ``kvfast study NAME``, e.g. one that needs an optional extra or takes long).
    """

    name: str
    version: str
    description: str
    run: Callable[[dict], dict]
    config_fields: dict[str, pa.DataType]
    result_fields: dict[str, pa.DataType]
    validate_config: Callable[[dict], None]
    summarize: Callable[[pd.DataFrame], pd.DataFrame]
    claims: Callable[[pd.DataFrame], list[Claim]] = field(default=lambda df: [])
    validate_groups: tuple[tuple[str, ...], ...] | None = None
    figures: tuple[Figure, ...] = ()
    facts: Callable[[pd.DataFrame], list[Fact]] | None = None
    tables: tuple[tuple[str, Callable[[pd.DataFrame], pd.DataFrame]], ...] = ()
    rank: int = 1000
    reproduce: bool = True


class StudyRegistry(dict):
    """Study name -> :class:`Study`: the names a grid's ``study`` may use. A plain dict with :meth:`register`."""

    def register(self, studies: Study | Iterable[Study] | Mapping[str, Study]) -> None:
        """Add a study (or several, or a name -> study mapping): each under its own ``name``. ``ValueError``
        for a name already registered to another study."""
        if isinstance(studies, Study):
            studies = [studies]
        elif isinstance(studies, Mapping):
            studies = list(studies.values())
        for study in studies:
            if not isinstance(study, Study):
                raise ValueError(f"study: {study!r} is not allowed; allowed: a kvfast Study object")
            if self.get(study.name, study) is not study:
                raise ValueError(f"study: {study.name!r} is registered already, to another Study")
            self[study.name] = study


REGISTERED = StudyRegistry()  # the default registry of the sweep's API (``kvfast.studies`` fills it on import)
