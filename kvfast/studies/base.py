"""What a study is: a run function over a config, its columns, and how to summarise it.

The sweep engine knows studies only through this interface: it expands a grid
of configs, calls ``study.run(config)`` for each, and stores the returned
columns. A run's numbers depend only on its config (seeds derive from it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Study:
    """A run function plus its schema.

    - ``run(config) -> dict``: one run; returns the result columns (``result_fields``).
    - ``config_fields`` / ``result_fields``: column name -> Arrow type, in order.
    - ``validate_config(config)``: raise ``ValueError`` naming the field, the value and
      what is allowed, before any run starts.
    - ``summarize(df) -> DataFrame``: the printed table; ``claims(df) -> list[Claim]``.
    - ``version``: part of every run's id; bump it when the run's numbers change.
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
