"""Write the report: one self-contained HTML page (images inline as base64 PNG) and its tables as CSV/JSON, from
the stored results of every study under a root (:func:`kvfast.report.claims.load_results`).

The page needs no server and no network: every style is inline and every image
a ``data:`` URL. With matplotlib absent each figure is replaced by the table of
its numbers and a note saying how to get the plots.

The report knows no study by name: it walks the registry (:data:`kvfast.studies.STUDIES`) in each study's
declared ``rank`` (ties in registry order) and turns each :class:`~kvfast.sweep.study.Figure` a study declares
into a :class:`Section`: the table of the numbers plotted (always computed; the page shows it when matplotlib is
absent) and a ``draw`` that returns a matplotlib Figure (only called when matplotlib, the ``plot`` extra, is
installed).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import html
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from kvfast._version import __version__
from kvfast.report import claims as claims_mod
from kvfast.report.scan_findings import findings_html, scan_findings
from kvfast.studies import STUDIES
from kvfast.studies.common import ok_rows
from kvfast.studies.plotting import matplotlib_available
from kvfast.sweep.store import MANIFEST, STORAGE_ERRNOS, StorageError
from kvfast.sweep.study import Figure, Study
from kvfast.validation import printable

REPORT = "report.html"
NO_MATPLOTLIB = (
    "matplotlib is not installed, so the figures below are shown as the tables of their numbers. "
    "Install the plot extra (pip install 'kvfast[plot]') and rerun `kvfast report` for the plots."
)

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 1250px;
       color: #222; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; padding-bottom: .2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: .6em 0; }
th, td { border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; text-align: left; }
th { background: #f2f2f2; }
td.yes { background: #e3f4e3; font-weight: bold; } td.no { background: #fbe3e3; font-weight: bold; }
img { max-width: 100%; border: 1px solid #eee; }
.note { background: #fff7dd; border-left: 4px solid #e0b000; padding: .4em .8em; }
.caption { color: #444; } details { margin: .4em 0 1em 0; } summary { cursor: pointer; color: #245; }
"""


class Section(NamedTuple):
    """One figure of the report computed on its study's stored ``runs``: ``table`` holds the numbers
    ``figure.draw(runs, table)`` plots (drawn only when the page shows plots)."""

    figure: Figure
    runs: pd.DataFrame
    table: pd.DataFrame


def ordered_studies(studies: dict[str, Study] | None = None) -> list[Study]:
    """The registered studies (default :data:`kvfast.studies.STUDIES`) in page order: by ``rank``, ties in
    registry order."""
    return sorted((STUDIES if studies is None else studies).values(), key=lambda study: study.rank)  # stable


def sections(results: dict[str, pd.DataFrame]) -> list[Section]:
    """Every section the stored ``results`` (study name -> runs) allow, in page order: each registered study
    with ok runs, its declared figures in order."""
    out = []
    for study in ordered_studies():
        df = results.get(study.name)
        if df is None or not len(ok_rows(df)):
            continue
        out += [Section(figure, df, figure.table(df)) for figure in study.figures]
    return out


def _html_table(df: pd.DataFrame, holds_col: str | None = None, max_rows: int = 400) -> str:
    if df is None or not len(df):
        return "<p>(no rows)</p>"

    def cell(column, value) -> str:
        text = claims_mod.cell_text(value)
        attribute = f' class="{text}"' if column == holds_col else ""
        return f"<td{attribute}>{html.escape(text)}</td>"

    rows = df.head(max_rows).itertuples(index=False)
    out = claims_mod.html_table(df.columns, ([cell(*c) for c in zip(df.columns, row, strict=True)] for row in rows))
    more = len(df) - max_rows
    return out + (f"<p>({more} more rows in the CSV beside this page)</p>" if more > 0 else "")


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _section_html(sec: Section, plots: bool) -> str:
    figure = sec.figure
    parts = [f'<h2 id="{figure.key}">{html.escape(figure.title)}</h2>']
    parts.append(f'<p class="caption">{html.escape(figure.caption)}</p>')
    if figure.note:
        parts.append(f'<p class="note">{html.escape(figure.note)}</p>')
    if plots and figure.draw is not None:
        data = _png(figure.draw(sec.runs, sec.table))
        parts.append(f'<img alt="{html.escape(figure.title)}" src="data:image/png;base64,{data}">')
        parts.append(
            f"<details><summary>the numbers plotted ({len(sec.table)} rows)</summary>{_html_table(sec.table)}</details>"
        )
    else:
        parts.append(_html_table(sec.table))
    return "\n".join(parts)


def summaries(results: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Each study's summary table (``study.summarize``) of its stored runs, in study-name order, each followed
    by the more tables the study declares (``study.tables``: name -> table)."""
    out = {}
    for name, df in sorted(results.items()):
        study = STUDIES[name]
        out[name] = study.summarize(df)
        for table_name, make in study.tables:
            out[table_name] = make(df)
    return out


def render(
    results: dict[str, pd.DataFrame],
    plots: bool | None = None,
    findings: pd.DataFrame | None = None,
    page_dir: str | os.PathLike = ".",
    unread: list[str] = (),
) -> str:
    """The report page for ``results`` (study name -> stored runs) as one HTML string; ``findings`` (a scan's
    listing, :func:`kvfast.report.scan_findings.scan_findings`) first where given, its links relative to
    ``page_dir``; ``unread``: why a listing was left out (a damaged ``findings.csv``), a note each."""
    plots = matplotlib_available() if plots is None else plots
    table = claims_mod.claims_table(results)
    count = claims_mod.counts(table)
    runs = sum(len(df) for df in results.values())
    body = [
        "<h1>kvfast: the seed's claims, measured</h1>",
        f"<p>kvfast {html.escape(__version__)}; {runs:,} stored runs of {len(results)} studies "
        f"({html.escape(', '.join(results))}). Every number on this page is computed from the stored Parquet "
        "by <code>kvfast report</code>.</p>",
        *([] if findings is None else [findings_html(findings, page_dir)]),
        *(f'<p class="note">{html.escape(printable(line))}; this page leaves it out</p>' for line in unread),
        '<h2 id="claims">Claims</h2>',
        f"<p><b>{count['claims_hold']} of {count['claims']} claims hold.</b> Verifier: {count['conditions_hold']} "
        f"of {count['conditions']} assertions (the claims' conditions) hold. The criterion column says how each "
        "verdict is reached; its first word is its kind (exact, vs seed, direction only, test, bound).</p>",
        _html_table(table[claims_mod.COLUMNS], holds_col="holds"),
        '<h2 id="facts">Other figures quoted in docs/claims.md</h2>',
        _html_table(claims_mod.facts(results)),
    ]
    if not plots:
        body.append(f'<p class="note">{html.escape(NO_MATPLOTLIB)}</p>')
    body += [_section_html(sec, plots) for sec in sections(results)]
    body.append('<h2 id="summaries">Study summaries</h2>')
    for name, summary in summaries(results).items():
        body.append(f"<details><summary>{html.escape(name)} ({len(summary)} rows)</summary>")
        body.append(_html_table(summary) + "</details>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>kvfast report</title><style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _writable(root: Path) -> None:
    """Create ``root``; ``ValueError`` naming ``--out`` when it cannot be created or written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()  # a file can be written there
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):  # the place is fine; it is full
            raise
        raise ValueError(
            f"--out: {str(root)!r} is not allowed ({exc.strerror}); allowed: a writable directory"
        ) from None


def write_tables(results: dict[str, pd.DataFrame], out: str | os.PathLike) -> list[Path]:
    """The report's tables under ``out``: ``claims.csv``, ``claims.json`` (rows + counts), ``facts.csv`` and
    ``summaries/STUDY.csv``. Floats are written in full (shortest round-trip repr): equal files, equal numbers."""
    root = Path(out)
    _writable(root)
    (root / "summaries").mkdir(exist_ok=True)
    table = claims_mod.claims_table(results)
    payload = {"counts": claims_mod.counts(table), "claims": table.to_dict(orient="records")}
    (root / "claims.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    csvs = {"claims": table, "facts": claims_mod.facts(results)}
    csvs |= {f"summaries/{name}": summary for name, summary in summaries(results).items()}
    for name, frame in csvs.items():
        frame.to_csv(root / f"{name}.csv", index=False, lineterminator="\n")
    claims_csv, *others = (root / f"{name}.csv" for name in csvs)
    return [claims_csv, root / "claims.json", *others]


# what the place a report goes to can refuse mid-way: a full disk or quota, a file too big, an I/O error, a
# read-only file system or folder, a name longer than the file system's limit
_WRITE_ERRNOS = STORAGE_ERRNOS | {errno.EACCES, errno.EPERM, errno.ENAMETOOLONG}


@contextlib.contextmanager
def writing_report(where: str | os.PathLike, stored: str, what: str = "the report") -> Iterator[None]:
    """Turn a failed write of ``what`` into ``where`` (see :data:`_WRITE_ERRNOS`) into one
    :class:`~kvfast.sweep.store.StorageError` line: why, where it would have gone, and ``stored`` (what is
    stored, unchanged). Other errors pass through."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS:
            raise
        name = os.fsdecode(exc.filename) if exc.filename else os.fspath(where)
        why, fix = f"{exc.strerror or type(exc).__name__}: {name}", "free space and rerun"
        if exc.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in Path(name).parts)
            why = f"{exc.strerror}: a name of {longest} bytes in {name!r}; the file system allows 255"
            fix = "pass --out with a shorter folder"
        elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = "pass --out with a writable folder"
        raise StorageError(f"{what} could not be written into {os.fspath(where)} ({why}); {stored}; {fix}") from None


def report_path(results_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """``out``, by default ``RESULTS_DIR.report`` beside ``results_dir`` (the path alone: nothing is looked at)."""
    if out is not None:
        return Path(out)
    base = Path(results_dir)
    base = Path(os.path.abspath(base)) if base.name in ("", ".", "..") else base
    return base.with_name(base.name + ".report")


def report_dir(results_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Where the report of ``results_dir`` goes: ``out``, by default ``RESULTS_DIR.report`` beside it.

    Never inside a results directory (a folder with the manifest, or under one):
    every file there that is not Parquet and not named ``.*``/``_*`` would make
    ``pd.read_parquet(DIR)`` and ``pyarrow.dataset`` fail. ``ValueError`` naming
    ``--out`` for such an ``out``.
    """
    root = report_path(results_dir, out)
    for folder in (root.absolute(), *root.absolute().parents):
        if (folder / MANIFEST).is_file():
            raise ValueError(
                f"--out: {str(root)!r} is not allowed (it is inside the results directory {str(folder)!r}, "
                f"which would then not read as a Parquet dataset); allowed: a folder outside it, "
                f"such as {str(folder) + '.report'!r}"
            )
    return root


def write_report(results_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Read every study's runs under ``results_dir`` and write ``OUT/report.html`` plus its tables
    (:func:`write_tables`); ``out``: see :func:`report_dir` (default ``RESULTS_DIR.report``). A scan's findings
    (``kvfast scan --repro``: :func:`~kvfast.report.scan_findings.scan_findings`) head the page; a listing that cannot
    be read is a note there, and the rest of the page is written.
    Returns the page's path."""
    results = claims_mod.load_results(results_dir)
    root = report_dir(results_dir, out)
    write_tables(results, root)  # creates root, or refuses it (--out) before anything is written
    page = root / REPORT
    unread: list[str] = []
    findings = scan_findings(results_dir, unread)
    page.write_text(render(results, findings=findings, page_dir=root, unread=unread), encoding="utf-8")
    return page
