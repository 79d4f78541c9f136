"""The documents' copies of tables the code holds are the generated ones (tests/doctables.py), and every
relative link of the README and docs/ points at a file, and an anchor, that exists.

Each check has its control: the same check on a deliberately edited copy fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import doctables
import pytest
from shared import ROOT
from test_layering import LAYERS


@pytest.mark.parametrize("doc", sorted(doctables.PLACES))
def test_each_documents_tables_are_the_generated_ones(doc):
    text = (ROOT / doc).read_text()
    assert doctables.stale(text, doctables.PLACES[doc]) == [], f"{doc}: run `python tests/doctables.py`"


def test_every_table_has_a_place():
    placed = {name for names in doctables.PLACES.values() for name in names}
    assert placed == set(doctables.TABLES)


@pytest.mark.parametrize(
    "doc, edit, problem",
    [
        ("docs/check.md", ("| 5 | the check did not finish", "| 5 | the check never finished"), "differs"),
        ("docs/check.md", ("| `strict` | `False` |", "| `strict` | `True` |"), "differs"),
        ("docs/sweep.md", ("| 3 | runs lost", "| 1 | runs lost"), "differs"),
        ("README.md", ("`matplotlib>=3.8` |", "`matplotlib>=3.9` |"), "differs"),
        ("docs/development.md", ("| `python3 dev.py test` |", "| `python3 dev.py tests` |"), "differs"),
        ("docs/check.md", ("<!-- end of table check-exit-codes -->", ""), "end marker is missing"),
    ],
)
def test_an_edited_copy_fails(doc, edit, problem):
    """The control: one edited row (or a lost marker) in a copy of the document is reported."""
    text = (ROOT / doc).read_text()
    assert edit[0] in text
    problems = doctables.stale(text.replace(edit[0], edit[1], 1), doctables.PLACES[doc])
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_table_missing_from_its_document_fails():
    text = (ROOT / "docs" / "sweep.md").read_text()
    head, tail = doctables.begin("sweep-exit-codes"), doctables.end("sweep-exit-codes")
    without = text.split(head)[0] + text.split(tail)[1]
    assert doctables.stale(without, ("sweep-exit-codes",)) == ["table sweep-exit-codes: no copy between its markers"]


def test_rewrite_restores_an_edited_copy():
    text = (ROOT / "docs" / "sweep.md").read_text()
    edited = text.replace("| 3 | runs lost", "| 1 | runs lost", 1)
    assert doctables.rewrite(edited, ("sweep-exit-codes",)) == text


def test_a_flagless_option_without_a_description_is_refused(monkeypatch):
    monkeypatch.setattr(doctables, "PYTHON_ONLY", {})
    with pytest.raises(ValueError, match="describe the field 'keep_logits'"):
        doctables.check_options()


def test_an_extra_without_a_description_is_refused(tmp_path):
    pyproject = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(
        pyproject.replace("[project.optional-dependencies]\n", '[project.optional-dependencies]\nnew = ["x"]\n')
    )
    with pytest.raises(ValueError, match=r"describe \['new'\]"):
        doctables.extras(tmp_path / "pyproject.toml")


# --- the architecture's layer table ----------------------------------------------------------------------------


def layer_rows(text: str) -> list[tuple[str, set[str]]]:
    """(layer, its packages) for each row of the table under docs/architecture.md's "Layers"."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], set(re.findall(r"`([a-z_.]+)`", cells[1]))))
    return rows


def test_the_architectures_layers_are_the_layering_tests():
    rows = layer_rows((ROOT / "docs" / "architecture.md").read_text())
    assert rows == [(name, set(packages)) for name, packages in LAYERS]


def test_a_layer_out_of_order_fails():
    """The control: the table with two layers swapped is not the layering test's."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = layer_rows(text)
    sweep = next(line for line in text.splitlines() if line.startswith("| sweep |"))
    studies = next(line for line in text.splitlines() if line.startswith("| studies |"))
    swapped = text.replace(sweep, "@@").replace(studies, sweep).replace("@@", studies)
    assert layer_rows(swapped) != rows and len(layer_rows(swapped)) == len(rows)


# --- links --------------------------------------------------------------------------------------------------


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings (lower case, punctuation dropped, spaces to hyphens)."""
    found = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file, or anchor, does not exist."""
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", path.read_text(), flags=re.S))  # code is no link
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            broken.append(target)
    return broken


DOCS = ["README.md", "benchmarks/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    assert broken_links(ROOT / doc) == []


def test_a_broken_link_is_found(tmp_path):
    """The control: a link to a missing file and one to a missing anchor are both reported."""
    (tmp_path / "a.md").write_text(
        "# Title\n\n## Exit codes\n\n[ok](#exit-codes) [gone](b.md) [bad](#exit-code) `code[x](0)`\n"
    )
    assert broken_links(tmp_path / "a.md") == ["b.md", "#exit-code"]
