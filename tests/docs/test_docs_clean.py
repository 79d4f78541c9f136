"""The user documents (README.md and docs/*.md) are guides for a user, not a development log.

They cite no path outside the repository, name no machine the figures were measured on, no issue number
and no development pass (the history of how a figure was reached belongs in benchmarks/README.md), and
every measured figure names the command that prints it. The first four are text a pattern can find:
:data:`FORBIDDEN` lists them, and each has its control, a planted line that the check reports.
"""

from __future__ import annotations

import re

import pytest
from shared import ROOT

DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

#: (what a user document must not hold, a pattern that finds it)
FORBIDDEN = [
    ("a path outside the repository", r"\.\./shared|(?<![\w.])\.\./\.\./|/work/|/home/\w|/Users/\w"),
    ("a machine", r"\b\d+-core\b|\b(?:EPYC|Xeon|Ryzen|Threadripper|Graviton|A100|H100|H200)\b|\bAMD\b|\bIntel\b"),
    ("a machine", r"development (?:VM|machine)|load average|\bshared (?:by|with) (?:\w+ )?(?:agents|other jobs)"),
    ("an issue number", r"\b[Ii]ssues? #?\d+|\(#\d+\)|\bPR #?\d+"),
    ("a development pass", r"\b(?:first|second|third|fourth|fifth|sixth|seventh|\d+(?:st|nd|rd|th)) (?:pass|turn)\b"),
    ("a development pass", r"(?:start|end) of the issue|\bthis issue\b|\bgit archive\b|\bas before this\b"),
]  # fmt: skip


def findings(text: str) -> list[str]:
    """``what: line`` for each line of ``text`` that holds forbidden text (empty: a clean document)."""
    return [
        f"{what}: {line.strip()[:160]}"
        for line in text.splitlines()
        for what, pattern in FORBIDDEN
        if re.search(pattern, line)
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_a_user_document_holds_no_development_history(doc):
    assert findings((ROOT / doc).read_text()) == []


@pytest.mark.parametrize(
    "planted, what",
    [
        ("The write-up, `../shared/seed/000_f13ed8e173d0b056.txt`, says so.", "a path outside the repository"),
        ("Medians on the 2-core AMD EPYC development VM.", "a machine"),
        ("fp32 and int8 builds, this 2-core machine shared by six agents", "a machine"),
        ("Fixed in issue 41 (the default mode).", "an issue number"),
        ("789 lines at the start of the issue, 797 after its first turn", "a development pass"),
        ("Measured after the fifth pass of the kernels.", "a development pass"),
        ("`git archive cae9e9d` gives the baseline.", "a development pass"),
    ],
)
def test_a_planted_line_is_found(planted, what):
    """The control: each kind of forbidden text, planted in a copy of the README, is reported."""
    text = (ROOT / "README.md").read_text()
    assert findings(text) == []
    found = findings(text.replace("## Install\n", f"## Install\n\n{planted}\n", 1))
    assert found and all(f.startswith(f"{what}: ") for f in found), found
