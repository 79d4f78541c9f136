"""``kvfast report RESULTS_DIR [--out DIR] [--markdown [claims|facts|tables|findings]] [--no-html]``.

Writes ``report.html`` (self-contained: inline styles, images as base64 PNG)
and its tables (``claims.csv``, ``claims.json``, ``facts.csv``,
``summaries/*.csv``) from the stored Parquet alone, and prints the page's path.
They go into ``--out``, by default ``RESULTS_DIR.report`` beside it: never inside
a results directory, which stays a readable Parquet dataset.
``--markdown`` prints a table as Markdown instead of writing anything: the
claims table with its count (what docs/claims.md pastes), the quoted figures, or
every study's summary table (what docs/studies.md pastes), or a scan's findings.

A scan whose reproducers were written (``kvfast scan --repro``) has its findings listed, new first, each with
its label, reference and reproducer's path: at the head of the page and printed after its path
(:mod:`kvfast.report.scan_findings`). A listing that cannot be read (a damaged ``findings.csv``) is one warning line
naming the file, on stderr and on the page, and the rest of the report is written (exit code 0).
"""

from __future__ import annotations

import sys

from kvfast.validation import one_line

MARKDOWN = ("claims", "facts", "tables", "findings")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="an HTML report (claims table, plots) of stored results, or Markdown tables",
        description="Write an HTML report of stored results (the claims table, the quoted figures, every study's "
        "plots; one page that opens from disk) and its CSV/JSON tables, or print one of its tables as Markdown. "
        "It reads only the stored Parquet: nothing is rerun.",
    )
    p.add_argument("results", metavar="RESULTS_DIR", help="a folder of results directories (kvfast reproduce --out)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where report.html and its tables go, outside any results directory (default: RESULTS_DIR.report)",
    )
    p.add_argument(
        "--markdown",
        nargs="?",
        const="claims",
        choices=MARKDOWN,
        metavar="WHAT",
        help="print Markdown instead: claims (default), facts, tables or findings (a scan's, kvfast scan --repro); "
        "writes nothing",
    )
    p.add_argument("--no-html", action="store_true", help="write only the tables (CSV/JSON), as data/ keeps them")
    p.set_defaults(func=cmd_report)


def markdown_text(results: dict, what: str) -> str:
    """The Markdown ``--markdown WHAT`` prints for ``results`` (study name -> stored runs)."""
    from kvfast.report.claims import claims_markdown, claims_table, facts, markdown
    from kvfast.report.page import summaries

    if what == "claims":
        return claims_markdown(claims_table(results))
    if what == "facts":
        return markdown(facts(results), ["figure", "value", "study"])
    return "\n\n".join(f"#### {name}\n\n{markdown(table)}" for name, table in summaries(results).items())


def cmd_report(args) -> int:
    from kvfast.report.claims import load_results
    from kvfast.report.page import report_dir, report_path, write_report, write_tables, writing_report
    from kvfast.report.scan_findings import findings_text, scan_findings

    unread: list[str] = []
    if args.markdown == "findings":
        found = scan_findings(args.results, unread)
        _warn(unread)
        print("(no findings: no kvfast scan --repro wrote reproducers beside these results)" if found is None
              else findings_text(found, as_markdown=True))  # fmt: skip
        return 0
    if args.markdown:
        print(markdown_text(load_results(args.results), args.markdown))
        return 0
    stored = f"the results in {args.results} are stored, unchanged"
    with writing_report(report_path(args.results, args.out), stored):  # a failed write: kvfast.cli's exit code 74
        if args.no_html:
            for path in write_tables(load_results(args.results), report_dir(args.results, args.out)):
                print(path)
            return 0
        page = write_report(args.results, args.out)
    print(f"report: {page}")
    found = scan_findings(args.results, unread)
    _warn(unread)
    if found is not None:
        print(f"\nfindings, new first: {findings_text(found)}")
    return 0


def _warn(unread: list[str]) -> None:
    """One line on stderr per listing of findings that could not be read (the rest of the report stands)."""
    for line in unread:
        print(f"kvfast: warning: {one_line(line)}; the report leaves it out", file=sys.stderr)
