"""Every section of a document that the code or the documents cite by name or number exists.

A citation is a document's name followed by a section's number and/or its heading in quotes, as messages,
docstrings and comments write them: ``docs/check.md, section 9 'The scoreboard of transformers 5.24'``,
``docs/development.md, "Numba's compile cache"``, ``benchmarks/README.md, "Checksums on resume"``, or in a
document ``check.md, section 3``. A number must be a ``## N.`` heading of that document; a quoted heading must be
one of its headings (or the start of one, up to a colon or a parenthesis), inside section N when both are given.
Links (``[text](file.md#anchor)``) are tests/docs/test_doc_tables.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

from shared import ROOT

#: a citation: the document, then ``section N``, a quoted heading, or both
QUOTED = r"(?:\"(?P<{0}d>[^\"]+)\"|'(?P<{0}s>[^']+)')"  # a heading in double quotes (an apostrophe inside) or single
CITATION = re.compile(
    r"(?P<doc>(?:docs/|benchmarks/)?[A-Za-z_]+\.md),?\s+"
    rf"(?:section\s+(?P<number>\d+)(?:\s+{QUOTED.format('a')})?|(?:section\s+)?{QUOTED.format('b')})"
)


def cited_in() -> list[Path]:
    """The files whose citations are checked: the package, the benchmarks, the user documents."""
    code = [*ROOT.glob("kvfast/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    return sorted(code) + [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(ROOT.glob("docs/*.md"))]


def headings(markdown: str) -> list[tuple[int | None, str]]:
    """(the number of the ``##`` section it is in, the heading's text) for every heading outside code blocks."""
    out, number, in_code = [], None, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().replace("`", "")
            numbered = re.match(r"(\d+)\. (.*)", title)
            if line.startswith("## "):
                number = int(numbered.group(1)) if numbered else None
            out.append((number, numbered.group(2) if numbered else title))
    return out


def resolve(doc: str, citing: Path) -> Path | None:
    """The cited document: as written from the repository's root, or beside the citing document."""
    for path in (ROOT / doc, citing.parent / doc):
        if path.is_file():
            return path
    return None


def problems(text: str, citing: Path) -> list[str]:
    """The citations in ``text`` whose document, section number or heading does not exist."""
    found = []
    for m in CITATION.finditer(text):
        doc, number = m["doc"], m["number"] and int(m["number"])
        quoted = m["ad"] or m["as"] or m["bd"] or m["bs"] or ""
        heading = re.sub(r"\s*\n\s*#?\s*", " ", quoted).strip() or None  # a heading wrapped over lines
        path = resolve(doc, citing)
        if path is None:
            if doc.startswith("docs/") or doc.startswith("benchmarks/"):
                found.append(f"{m[0]!r}: no document {doc}")
            continue
        known = headings(path.read_text())
        if number is not None and not any(n == number for n, _ in known):
            found.append(f"{m[0]!r}: {doc} has no section {number}")
        elif heading is not None:
            matches = [n for n, h in known if h == heading or h.startswith((heading + ":", heading + " ("))]
            if not matches or (number is not None and number not in matches):
                where = f" in section {number}" if number else ""
                found.append(f"{m[0]!r}: {doc} has no heading {heading!r}{where}")
    return found


def test_every_cited_section_exists():
    found = [f"{p.relative_to(ROOT)}: {problem}" for p in cited_in() for problem in problems(p.read_text(), p)]
    assert found == []


def test_citations_are_found():
    """The citations this test relies on are recognised, not silently skipped."""
    text = (ROOT / "kvfast" / "repro" / "known.py").read_text()
    assert len(list(CITATION.finditer(text))) >= 3


def test_a_stale_citation_is_found():
    """The control: a heading that was renamed, a section number that does not exist, a heading in the wrong
    section and a missing document are each reported; the same citations made right are not."""
    citing = ROOT / "kvfast" / "check" / "control.py"
    stale = (
        'see docs/check.md, section "Rounding or bug?".\n'
        "docs/check.md, section 42.\n"
        "docs/check.md, section 4 'The modes'\n"
        'docs/nowhere.md, "Anything"\n'
    )
    assert len(problems(stale, citing)) == 4
    right = (
        "docs/check.md, section \"The modes\"; docs/check.md, section 3 'The modes'; docs/check.md, section 4\n"
        'docs/development.md, "Numba\'s compile cache"\n'
    )
    assert problems(right, citing) == []
