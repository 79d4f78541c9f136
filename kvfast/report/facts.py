"""Figures docs/claims.md and the other docs quote beside the claims, each computed from the stored runs.

:func:`facts` returns one row per figure: a key, the figure in words, its value
and the study whose runs it comes from. Each study declares its own
(``Study.facts``, next to its run function); the report names no study.
``kvfast report DIR --markdown facts`` prints them; the report shows them under
the claims table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvfast.studies import STUDIES
from kvfast.studies.common import ok_rows

COLUMNS = ["key", "figure", "value", "study"]


def facts(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every quoted figure that the stored ``results`` (study name -> runs) allow, as rows of :data:`COLUMNS`:
    each study with ok runs and declared ``facts``, in study-name order, then the count of stored runs."""
    rows = []
    total = 0
    for name, df in sorted(results.items()):
        total += len(df)
        study = STUDIES.get(name)
        if study is not None and study.facts is not None and len(ok_rows(df)):
            rows += [{"key": k, "figure": f, "value": v, "study": name} for k, f, v in study.facts(df)]
    rows.append({"key": "runs", "figure": "runs stored over every study", "value": f"{total:,}", "study": "all"})
    out = pd.DataFrame(rows, columns=COLUMNS)
    return out.astype({"value": str}).replace({np.nan: ""})
