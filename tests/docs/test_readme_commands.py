"""The shell blocks of the README and of docs/*.md run as written and print what their comments say.

Every command line of their shell blocks (fenced blocks without a language; a line ending in a backslash goes on
in the next; output and synopses are fenced as ``text``) is classified in :data:`RULES`: run by the default suite
(fast), run under the ``slow`` marker (a whole grid, a Hugging Face model), or not run, with the reason (an
install, a placeholder path, the test suite itself); a rule may name the modules it needs (an optional extra),
and where one is missing the command is skipped. A command no rule covers fails the suite, so a new command is
classified when it is written. A command run here runs from a scratch directory (not the repository's root: a
user's shell is anywhere; a command that names ``examples/`` finds the clone's examples there, as from a clone's
root), with ``kvfast`` as ``python -m kvfast.cli`` of this tree; its exit code must be 0, or the one its comment
states, and a comment quoting ``kvfast check: ...`` must be the report's first line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from shared import ROOT

#: (a regular expression a command matches, how it is tested: "run", "slow", or "not run: WHY"[, modules it needs])
RULES = [
    (r"git clone ", "not run: clones a placeholder URL"),
    (r"pip install ", "not run: installs packages"),
    (r"python3 dev\.py ", "not run: the test suite itself, or a whole environment"),
    (r"python benchmarks/scan_releases\.py ", "not run: installs one transformers release per environment"),
    (r"kvfast check kvfast\.bugs\.kvfast_model:tiny_model ", "run"),
    (r"kvfast check kvfast\.testing:tiny_model ", "slow", ("torch", "transformers")),
    (r"kvfast check --engine ", "not run: MODEL_DIR, HF_DIR, tiny/onnx and tiny.json are placeholders for a model"),
    (r"kvfast check mymodels:", "not run: mymodels is a placeholder for your own factory"),
    (r"kvfast grids$", "run"),
    (r"kvfast run exactness --out results/ex(act)?$", "slow"),
    (r"kvfast run exactness --out results/ex --backend dask$", "slow", ("dask", "distributed")),
    (r"kvfast run exactness .*--scheduler ", "not run: the address of a Dask scheduler of your own"),
    (r"kvfast run my_grid\.toml ", "not run: my_grid.toml is a placeholder for your own grid"),
    (r"kvfast run examples/sum_order\.toml ", "slow"),
    (r"kvfast run check ", "slow"),
    (r"kvfast show results/(?!mine$)", "slow"),
    (r"kvfast show results/mine$", "not run: the results of my_grid.toml, a placeholder for your own grid"),
    (r"kvfast study (precision|neartied|training)$", "slow"),
    (r"kvfast scan --families mamba ", "slow", ("torch", "transformers")),
    (r"kvfast reproduce( |$)", "not run: every study of the write-up; tests/report/test_reference_data.py reruns them"),
]


def commands(text: str) -> list[tuple[str, str]]:
    """(command, comment) for every line of every shell block of ``text``, in order (a line ending in a
    backslash joined with the next)."""
    out, fence, pending = [], None, ""  # fence: the open block's language ("" for a shell block), None outside
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "" and line.strip():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1].strip() + " "
                continue
            parts = re.split(r"\s+#\s", pending + line.strip(), maxsplit=1)
            pending = ""
            out.append((parts[0].strip(), parts[1].strip() if len(parts) > 1 else ""))
    return out


def rule(command: str) -> tuple | None:
    """The one rule that covers ``command`` (``None``: no rule, or more than one)."""
    found = [r for r in RULES if re.match(r[0], command)]
    return found[0] if len(found) == 1 else None


def how(command: str) -> str | None:
    """The rule's verdict for ``command`` (``None``: no rule covers it)."""
    found = rule(command)
    return None if found is None else found[1]


def missing(command: str) -> list[str]:
    """The modules the command's rule needs that are not installed."""
    needs = rule(command)[2] if len(rule(command)) > 2 else ()
    return [m for m in needs if importlib.util.find_spec(m) is None]


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
COMMANDS = {doc: commands((ROOT / doc).read_text()) for doc in DOCS}
README = COMMANDS["README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_is_classified(doc):
    assert [command for command, _ in COMMANDS[doc] if how(command) is None] == []


def test_an_unclassified_command_is_found():
    """The control: a new command in a shell block is reported until a rule covers it."""
    text = (ROOT / "README.md").read_text().replace("kvfast grids ", "kvfast grids\nkvfast repair results/x ", 1)
    assert [c for c, _ in commands(text) if how(c) is None] == ["kvfast repair results/x"]


def test_a_continued_line_is_one_command():
    text = (
        "```\nkvfast scan --families llama \\\n    --dtypes float32   # a comment\n```\n```text\nnot a command\n```\n"
    )
    assert commands(text) == [("kvfast scan --families llama --dtypes float32", "a comment")]


def expected(comment: str) -> tuple[str | None, int]:
    """The report's first line and the exit code a command's comment states (``None``, 0 where it states none)."""
    line = re.search(r"(kvfast check: [A-Z]+: .*?)(?: \(exit (\d+)\))?$", comment)
    code = re.search(r"\(exit (\d+)\)", comment)
    return (line.group(1) if line else None), int(code.group(1)) if code else 0


def problems(result: subprocess.CompletedProcess, comment: str) -> list[str]:
    """How a command's result differs from what its comment says (empty: as stated)."""
    first, code = expected(comment)
    out = []
    if result.returncode != code:
        out.append(f"exit {result.returncode}, not {code}: {result.stderr.strip()[-400:]}")
    if first is not None and result.stdout.splitlines()[:1] != [first]:
        out.append(f"first line {result.stdout.splitlines()[:1]}, not {first!r}")
    return out


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "kvfast"
    if "examples/" in command and not (cwd / "examples").exists():
        (cwd / "examples").symlink_to(ROOT / "examples")  # as from a clone's root
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvfast.cli", *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )


_RESULTS: dict[str, subprocess.CompletedProcess] = {}


def result_of(command: str, cwd: Path) -> subprocess.CompletedProcess:
    if command not in _RESULTS:
        _RESULTS[command] = run(command, cwd)
    return _RESULTS[command]


FAST = list(dict.fromkeys((c, m) for doc in DOCS for c, m in COMMANDS[doc] if how(c) == "run"))


@pytest.mark.subprocess
@pytest.mark.parametrize("command, comment", FAST, ids=[c for c, _ in FAST])
def test_a_fast_command_does_what_its_comment_says(command, comment, tmp_path):
    assert problems(result_of(command, tmp_path), comment) == []


@pytest.mark.subprocess
def test_a_comment_that_the_output_contradicts_is_found(tmp_path):
    """The control: the README's passing check with a comment claiming another verdict and exit code."""
    command, comment = next((c, m) for c, m in FAST if "PASS: EXACT" in m)
    result = result_of(command, tmp_path)
    assert problems(result, comment) == []
    wrong = comment.replace("PASS: EXACT", "PASS: ROUNDING").replace("(exit 0)", "(exit 3)")
    assert len(problems(result, wrong)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("doc", [doc for doc in DOCS if any(how(c) == "slow" for c, _ in COMMANDS[doc])])
def test_the_slow_commands_of_a_document_in_order(doc, tmp_path):
    """A document's grids, studies and Hugging Face checks, in its order, in one scratch directory (a later
    command reads what an earlier one stored); a command whose extra is missing is left out."""
    for command, comment in COMMANDS[doc]:
        if how(command) == "slow" and not missing(command):
            assert problems(run(command, tmp_path), comment) == [], command
