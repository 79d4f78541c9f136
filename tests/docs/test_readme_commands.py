"""The README's shell blocks run as written and print what their comments say.

Every command line of the README's shell blocks (fenced blocks without a language) is classified in
:data:`RULES`: run by the default suite (fast), run under the ``slow`` marker (a whole grid, a Hugging Face
model), or not run, with the reason (an install, a placeholder path, the test suite itself). A command no rule
covers fails the suite, so a new README command is classified when it is written. A command run here runs
from a scratch directory (not the repository's root: a user's shell is anywhere), with ``kvfast`` as
``python -m kvfast.cli`` of this tree; its exit code must be 0, or the one its comment states, and a comment
quoting ``kvfast check: ...`` must be the report's first line.
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

#: (a regular expression a README command matches, how it is tested: "run", "slow", or "not run: WHY")
RULES = [
    (r"git clone ", "not run: clones a placeholder URL"),
    (r"pip install ", "not run: installs packages"),
    (r"python3 dev\.py ", "not run: the test suite itself, or a whole environment"),
    (r"kvfast check kvfast\.bugs\.kvfast_model:tiny_model ", "run"),
    (r"kvfast check kvfast\.check\.hf:tiny_model ", "slow"),
    (r"kvfast check --engine ", "not run: MODEL_DIR and HF_DIR are placeholders for an engine's model"),
    (r"kvfast grids$", "run"),
    (r"kvfast run exactness ", "slow"),
    (r"kvfast show results/exact$", "slow"),
    (r"kvfast run check ", "slow"),
]
HF = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def commands(text: str) -> list[tuple[str, str]]:
    """(command, comment) for every line of every shell block of ``text``, in order."""
    out, fence = [], None  # fence: the open block's language ("" for a shell block), None outside blocks
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "" and line.strip():
            parts = re.split(r"\s+#\s", line, maxsplit=1)
            out.append((parts[0].strip(), parts[1].strip() if len(parts) > 1 else ""))
    return out


def how(command: str) -> str | None:
    """The rule's verdict for ``command`` (``None``: no rule covers it)."""
    found = [verdict for pattern, verdict in RULES if re.match(pattern, command)]
    return found[0] if len(found) == 1 else None


README = commands((ROOT / "README.md").read_text())


def test_every_readme_command_is_classified():
    assert [command for command, _ in README if how(command) is None] == []


def test_an_unclassified_command_is_found():
    """The control: a new command in a shell block is reported until a rule covers it."""
    text = (ROOT / "README.md").read_text().replace("kvfast grids ", "kvfast grids\nkvfast repair results/x ", 1)
    assert [c for c, _ in commands(text) if how(c) is None] == ["kvfast repair results/x"]


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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvfast.cli", *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )


_RESULTS: dict[str, subprocess.CompletedProcess] = {}


def result_of(command: str, cwd: Path) -> subprocess.CompletedProcess:
    if command not in _RESULTS:
        _RESULTS[command] = run(command, cwd)
    return _RESULTS[command]


FAST = [(c, comment) for c, comment in README if how(c) == "run"]


@pytest.mark.subprocess
@pytest.mark.parametrize("command, comment", FAST, ids=[c for c, _ in FAST])
def test_a_fast_readme_command_does_what_its_comment_says(command, comment, tmp_path):
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
def test_the_slow_readme_commands_in_order(tmp_path):
    """The grids and the Hugging Face check, in the README's order, in one scratch directory."""
    for command, comment in README:
        if how(command) != "slow":
            continue
        if "kvfast.check.hf" in command and not HF:
            continue
        assert problems(run(command, tmp_path), comment) == [], command
