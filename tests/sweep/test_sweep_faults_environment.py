"""Issue 29, done-when: each environment problem is one line and a documented exit code. The case
tests/sweep/test_sweep_environment.py leaves out: ``kvfast scan`` with a ``--out`` that is not valid UTF-8 (the issue
found ``run``, ``repair`` and ``scan`` failing on it; ``run``, ``repair`` and ``show`` are tested there)."""

from __future__ import annotations

import os
import sys

import pytest

from kvfast.cli import main
from kvfast.commands.sweep import EXIT_CODES
from kvfast.sweep.store import ResultsDir

SCAN = ["scan", "--families", "gpt2", "--dtypes", "float32", "--seeds", "1", "--prompts", "1", "--steps", "3",
        "--scenarios", "decode", "--bugs", "none", "--jobs", "1", "--quiet", "--out"]  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a file system that takes any bytes in a name")
def test_scan_with_an_out_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys):
    raw = os.fsencode(tmp_path) + b"/scan-\xff\xfe"
    os.mkdir(raw)  # the file system takes it
    capsys.readouterr()
    code = main([*SCAN, os.fsdecode(raw)])
    err = capsys.readouterr().err
    assert code == 2 and 2 in EXIT_CODES
    assert "Traceback" not in err and "bug in kvfast" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("kvfast")]
    assert "--out: " in line and "not valid UTF-8" in line and "allowed: a path in UTF-8" in line
    assert repr(b"scan-\xff\xfe")[2:-1] in line  # the path is named, its bytes shown
    assert os.listdir(raw) == []  # nothing written
    # the refusal is the encoding's: the same folder under a UTF-8 name is taken
    ResultsDir(tmp_path / "scan-utf8", option="--out")
