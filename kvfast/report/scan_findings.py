"""The findings a scan's reproducers were written for, in the report: :func:`scan_findings` reads the listing
beside each results directory (a scan's, ``DIR.repro/findings.csv``, :mod:`kvfast.studies.scan_repro`), new
findings first; :func:`findings_html` is the report page's section (each finding's label with its reference,
and links to its reproducer and issue text); :func:`findings_text` the listing ``kvfast report`` and ``kvfast
scan`` print.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from kvfast.report.claims import html_table, markdown, study_dirs
from kvfast.validation import printable

#: The columns the listing shows, in order (``note`` only in the files: why a row has no reproducer).
SHOWN = ("label", "architecture", "dtype", "scenario", "bug", "step", "reproducer", "reference")
#: The label cells' colours on the page.
LABEL_COLOURS = {"new": "#fbe3e3", "known": "#fff3cc", "injected": "#e6eefc"}


def scan_findings(results_root: str | os.PathLike, unread: list[str] | None = None) -> pd.DataFrame | None:
    """The findings listed beside every results directory under ``results_root`` (one, or a folder of them)
    that has them (a scan's, ``kvfast scan --repro``), new first; ``None`` where none has. The report names no
    study: whichever wrote a listing is read. A listing that cannot be read (a damaged ``findings.csv``) is left
    out, its one-line reason (naming the file) appended to ``unread`` where given, else raised (``ValueError``)."""
    from kvfast.repro.findings import ordered, read_findings
    from kvfast.studies.scan_repro import repro_dir

    tables = []
    for path in study_dirs(results_root).values():
        try:
            tables.append(read_findings(repro_dir(path)))
        except ValueError as exc:
            if unread is None:
                raise
            unread.append(str(exc))
    tables = [table for table in tables if table is not None]
    return ordered(pd.concat(tables, ignore_index=True)) if tables else None


def counts_line(table: pd.DataFrame) -> str:
    """``"3 findings: 1 new, 2 known; 3 with a reproducer"``."""
    labels = table["label"].value_counts()
    parts = [f"{int(labels[k])} {k}" for k in ("new", "known", "injected") if k in labels]
    with_script = int((table["reproducer"] != "").sum())
    return f"{len(table)} findings: {', '.join(parts) or 'none labelled'}; {with_script} with a reproducer"


def _shown(table: pd.DataFrame) -> pd.DataFrame:
    """The listing's :data:`SHOWN` columns as text a terminal shows and never acts on (each character that is not
    printable written as its escape: a cell's escape sequences are not run)."""
    shown = table[list(SHOWN)].astype(str).replace({"<NA>": ""})
    return shown.map(printable)


def findings_text(table: pd.DataFrame, as_markdown: bool = False) -> str:
    """The listing (:data:`SHOWN`, new first) after its counts line, as plain text or Markdown; a cell's
    characters that are not printable are shown as their escapes."""
    if as_markdown:
        return f"{counts_line(table)}\n\n{markdown(_shown(table))}"
    return f"{counts_line(table)}\n\n{_shown(table).to_string(index=False)}"


def _link(path: str, page_dir: Path, text: str) -> str:
    """A link to the file ``path`` from the page in ``page_dir``: a relative path, each of its segments
    percent-encoded, so that no scheme (``javascript:``), query or fragment can appear in it."""
    rel = Path(os.path.relpath(Path(path).absolute(), page_dir.absolute())).as_posix()
    href = "/".join(quote(segment, safe="") for segment in rel.split("/"))
    return f'<a href="{html.escape(href)}">{html.escape(text)}</a>'


def linked(path: str) -> bool:
    """Whether the page links the reproducer ``path`` (a listing's cell): a file named ``reproduce.py``, its name
    free of characters that are not printable; any other cell is shown as text."""
    from kvfast.repro.script import SCRIPT

    return bool(path) and Path(path).name == SCRIPT and printable(path) == path


def findings_html(table: pd.DataFrame, page_dir: str | os.PathLike) -> str:
    """The report page's findings section: the counts, then one row per finding, new first, with its label
    (coloured), its reference, and links (relative to ``page_dir``, where the page is) to its ``reproduce.py``
    and ``ISSUE.md``; a finding without a reproducer says why."""
    where = Path(page_dir)
    parts = [
        '<h2 id="findings">Findings, new first</h2>',
        f"<p><b>{html.escape(counts_line(table))}.</b> Each was written by <code>kvfast scan --repro</code>: a "
        "shrunk, standalone <code>reproduce.py</code> (torch and transformers only; exit 1 while the bug is there) "
        "and its <code>ISSUE.md</code>. <i>new</i>: in no registry of known cache bugs kvfast keeps; "
        "<i>known</i>: with its reference; <i>injected</i>: a bug of kvfast's own catalogue, put there on "
        "purpose.</p>",
    ]
    rows = []
    for row in table.to_dict("records"):
        label = str(row["label"] or "")
        colour = LABEL_COLOURS.get(label)
        style = f' style="background:{colour};font-weight:bold"' if colour else ""
        what = f"{row['architecture']}, {row['dtype'] or '?'}, {row['scenario']}"
        if row["bug"] and row["bug"] != "none":
            what += f" (injected {row['bug']})"
        script = str(row["reproducer"] or "")
        shown = f"<small>{html.escape(printable(script))}</small>"
        if linked(script):
            issue = _link(str(Path(script).with_name("ISSUE.md")), where, "ISSUE.md")
            links = f"{_link(script, where, 'reproduce.py')} · {issue}<br>{shown}"
        else:
            links = shown if script else "none"
        step = "" if pd.isna(row["step"]) else str(int(row["step"]))
        ref = html.escape(str(row["reference"] or ""))
        if row["note"]:
            ref += ("<br>" if ref else "") + f"<small>{html.escape(str(row['note']))}</small>"
        cells = (html.escape(what), step, links, ref)
        rows.append([f"<td{style}>{html.escape(label or '-')}</td>", *(f"<td>{c}</td>" for c in cells)])
    columns = ("label", "what", "first step", "reproducer", "reference or note")
    return "\n".join([*parts, html_table(columns, rows)])
