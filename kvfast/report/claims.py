"""Stored results read back (:func:`load_results`: one results directory per study under a root), the claims
table computed end to end from them, the verifier count, and the figures the docs quote beside the claims
(:func:`facts`).

Every row is a :class:`kvfast.studies.Claim` returned by a study's ``claims``
on its stored runs: the claim, the seed's figure, kvfast's figure, whether it
holds, and its criterion in words (its kind, then its conditions). The
verifier count is the number of conditions evaluated over every claim, and
how many hold (the seed's counterpart: "133 verifier assertions").
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from kvfast.studies import STUDIES
from kvfast.studies.common import ok_rows
from kvfast.sweep.store import MANIFEST, ResultsDir, load
from kvfast.sweep.study import Study

COLUMNS = ["study", "claim", "seed", "kvfast", "holds", "criterion"]
COUNT_COLUMNS = ["conditions", "conditions_hold"]


def study_claims(study: str | Study, df: pd.DataFrame) -> pd.DataFrame:
    """One study's claims on its runs ``df``, as rows of :data:`COLUMNS` + :data:`COUNT_COLUMNS`.

    ``study`` is a built-in study's name or a :class:`Study` (a user's own); a study without
    ``claims`` gives no rows. A study whose ``claims`` raises gives one row that does not hold and
    names the error."""
    if isinstance(study, str):
        study = STUDIES[study]
    name = study.name
    try:  # one tuple per claim, in the order of COLUMNS + COUNT_COLUMNS
        rows = [(name, c.claim, c.seed_figure, c.kvfast_figure, bool(c.holds), c.criterion, len(c.conditions),
                 sum(ok for _, ok in c.conditions)) for c in (study.claims(df) if study.claims else ())]  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - one study's failure must not hide the others
        rows = [(name, f"(claims failed: {type(exc).__name__}: {exc})", "", "", False, "", 1, 0)]
    return pd.DataFrame(rows, columns=COLUMNS + COUNT_COLUMNS)


def claims_table(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every study's claims, in study-name order (:func:`study_claims`)."""
    parts = [study_claims(name, df) for name, df in sorted(results.items())]
    if not parts:
        return pd.DataFrame(columns=COLUMNS + COUNT_COLUMNS)
    return pd.concat(parts, ignore_index=True)


def counts(table: pd.DataFrame) -> dict[str, int]:
    """``claims``, ``claims_hold``, ``conditions`` (the verifier's assertions), ``conditions_hold``."""
    return {
        "claims": len(table),
        "claims_hold": int(table["holds"].sum()),
        "conditions": int(table["conditions"].sum()),
        "conditions_hold": int(table["conditions_hold"].sum()),
    }


def cell_text(v) -> str:
    """A table cell as the report shows it: booleans as yes/no, floats to 4 digits."""
    if isinstance(v, bool | np.bool_):
        return "yes" if v else "no"
    return f"{v:.4g}" if isinstance(v, float | np.floating) else str(v)


def markdown(df: pd.DataFrame, columns: list[str] | None = None) -> str:
    """A Markdown table of ``df`` (``columns`` default: all); booleans as yes/no, floats to 4 digits."""
    if df is None or len(df) == 0:
        return "(no rows)"
    cols = list(df.columns) if columns is None else columns
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    escape = {ord("|"): "\\|", ord("\n"): " "}  # a cell's text stays in its cell
    rows = df[cols].itertuples(index=False)
    lines += ["| " + " | ".join(cell_text(v).translate(escape) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def html_table(columns: Iterable[object], rows: Iterable[Iterable[str]]) -> str:
    """An HTML table: a header of ``columns`` (text, escaped here) over ``rows``, each a row's cells already HTML
    (``<td>...</td>``, their text escaped by the caller)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(cells) + "</tr>" for cells in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def claims_markdown(table: pd.DataFrame) -> str:
    """The claims table as Markdown, then its count line, ``"N of M claims hold; verifier: K of J assertions (the
    claims' conditions) hold"`` (what docs/claims.md pastes)."""
    c = counts(table)
    return (
        f"{markdown(table, COLUMNS)}\n\n{c['claims_hold']} of {c['claims']} claims hold; verifier: "
        f"{c['conditions_hold']} of {c['conditions']} assertions (the claims' conditions) hold"
    )


FACT_COLUMNS = ["key", "figure", "value", "study"]


def facts(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every figure the docs quote beside the claims that the stored ``results`` (study name -> runs) allow, as
    rows of :data:`FACT_COLUMNS`: each study with ok runs and declared ``facts`` (``Study.facts``, next to its run
    function), in study-name order, then the count of stored runs."""
    rows = []
    for name, df in sorted(results.items()):
        study = STUDIES.get(name)
        if study is not None and study.facts is not None and len(ok_rows(df)):
            rows += [{"key": k, "figure": f, "value": v, "study": name} for k, f, v in study.facts(df)]
    total = sum(len(df) for df in results.values())
    rows.append({"key": "runs", "figure": "runs stored over every study", "value": f"{total:,}", "study": "all"})
    out = pd.DataFrame(rows, columns=FACT_COLUMNS)
    return out.astype({"value": str}).replace({np.nan: ""})


def study_dirs(root: str | os.PathLike) -> dict[str, Path]:
    """Study name -> results directory, for ``root`` itself (one study) or every folder under it that has a
    manifest, in study-name order. ``ValueError`` naming ``RESULTS_DIR`` when there is none."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"RESULTS_DIR: {str(root)!r} is not allowed; allowed: a directory of kvfast results")
    candidates = [base] if (base / MANIFEST).is_file() else sorted(p for p in base.iterdir() if p.is_dir())
    found = {name: path for path in candidates if (path / MANIFEST).is_file() and (name := _study_of(path)) in STUDIES}
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
