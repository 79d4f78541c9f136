"""Issue 29: every problem of the environment a sweep, a report or a scoreboard meets is one line and a documented
exit code (``kvfast.commands.sweep.EXIT_CODES``), never 70 (a bug in kvfast).

- a full disk, or a name longer than the file system allows, while ``kvfast report DIR`` or ``kvfast scan`` writes
  its report or scoreboard: 74, saying what is stored and where the report would have gone;
- a ``--out`` that is not valid UTF-8 (Linux file systems take it, pyarrow does not): 2, naming ``--out`` (or
  ``DIR`` for ``repair``), before any run;
- a read-only place: 2 before any work (``--out`` of ``run`` and ``report``), 74 once writing has begun.

A full disk is simulated by making every write under the report's folder fail with ``ENOSPC`` (the real one, on a
small tmpfs, needs root and mount(8): tests/sweep/test_sweep_faults.py does it where it can).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shared import ROOT, TESTS, environment

from kvfast.cli import main
from kvfast.commands.sweep import EXIT_CODES, EXIT_STORAGE

sys.path.insert(0, str(ROOT / "tests"))  # faultstudy
ENV = environment(TESTS)


def cli(capsys, *argv) -> subprocess.CompletedProcess:
    capsys.readouterr()
    code = main([str(a) if not isinstance(a, bytes) else os.fsdecode(a) for a in argv])
    got = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, got.out, got.err)


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """kvfast's single line on stderr (no traceback, no bug line), which says every one of ``needles``."""
    err = proc.stderr
    assert "Traceback" not in err and "bug in kvfast" not in err, err
    assert proc.returncode in EXIT_CODES and proc.returncode != 70, proc.returncode
    lines = [ln for ln in err.splitlines() if ln.startswith("kvfast")]  # (a model's own warnings aside)
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def grid_toml(path: Path, xs: list[int]) -> Path:
    path.write_text(f'study = "faultstudy:STUDY"\n[axes]\nx = {xs}\nmode = ["ok"]\n')
    return path


@pytest.fixture
def disk_full_under(monkeypatch):
    """``full(folder)``: from now on every file opened for writing under ``folder`` fails with ENOSPC."""
    real_open, real_io_open = builtins.open, io.open

    def full(folder: Path) -> None:
        prefix = os.path.abspath(folder)

        def opener(real):
            def fake(file, mode="r", *args, **kwargs):
                if isinstance(file, str | os.PathLike) and any(c in mode for c in "wax+"):
                    if os.path.abspath(os.fspath(file)).startswith(prefix):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
                return real(file, mode, *args, **kwargs)

            return fake

        monkeypatch.setattr(builtins, "open", opener(real_open))
        monkeypatch.setattr(io, "open", opener(real_io_open))

    return full


@pytest.fixture
def results(tmp_path, capsys) -> Path:
    """A folder holding one small results directory (``kvfast report`` reads a folder of them)."""
    root = tmp_path / "res"
    toml = tmp_path / "exactness.toml"  # 2 runs of a built-in study (the report shows registered studies)
    toml.write_text(
        'study = "exactness"\n[fixed]\nvocab = 32\nd_model = 16\nd_ff = 32\nseed = 0\nn_layer = 1\nn_head = 1\n'
        'prompt_len = 3\nsteps = 4\norder = "sequential"\n[axes]\npreset = ["f64", "f32"]\n'
    )
    assert cli(capsys, "run", toml, "--out", root / "exactness", "--jobs", "1", "--quiet").returncode == 0
    return root


# --- kvfast report ------------------------------------------------------------------------------------------


def test_report_on_a_full_disk_is_one_line_and_74(results, capsys, disk_full_under):
    disk_full_under(results.parent / "res.report")
    proc = cli(capsys, "report", results, "--no-html")
    assert proc.returncode == EXIT_STORAGE
    one_line(proc, "No space left on device", f"{results}.report", f"the results in {results} are stored")
    # the same report with room for it is written (the failure came from the disk, not the report)
    proc = cli(capsys, "report", results, "--no-html", "--out", results.parent / "elsewhere")
    assert proc.returncode == 0, proc.stderr


def test_report_whose_folder_name_is_too_long_is_one_line_and_74(tmp_path, results, capsys):
    long = tmp_path / ("r" * 250)  # fine itself; "r...r.report" is 257 bytes, over the 255 a name may have
    shutil.copytree(results, long)
    proc = cli(capsys, "report", long, "--no-html")
    assert proc.returncode == EXIT_STORAGE
    line = one_line(proc, "a name of 257 bytes", "255", f"the results in {long} are stored", "--out")
    assert line.startswith("kvfast: error: the report could not be written into")
    assert cli(capsys, "report", long, "--no-html", "--out", tmp_path / "short").returncode == 0


def test_report_into_a_read_only_place_is_one_line_naming_out(tmp_path, results, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = cli(capsys, "report", results, "--out", blocker / "sub")
    assert proc.returncode == 2
    one_line(proc, "--out:", "allowed: a writable directory")


# --- kvfast run, repair, show: --out that is not UTF-8 -------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a file system that takes any bytes in a name")
@pytest.mark.parametrize("command", ["run", "repair", "show"])
def test_an_out_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys, command):
    toml = grid_toml(tmp_path / "g.toml", [0])
    raw = os.fsencode(tmp_path) + b"/out-\xff\xfe"
    os.mkdir(raw)  # the file system takes it
    argv = ["run", toml, "--out", raw, "--quiet"] if command == "run" else [command, raw]
    proc = cli(capsys, *argv)
    assert proc.returncode == 2
    option = "--out" if command == "run" else "DIR"
    line = one_line(proc, f"{option}: ", "not valid UTF-8", "allowed: a path in UTF-8")
    assert repr(b"out-\xff\xfe")[2:-1] in line  # the path is named, its bytes shown
    assert os.listdir(raw) == []  # nothing written


# --- kvfast scan: the scoreboard ------------------------------------------------------------------------------


def _scan_args(out: Path) -> list:
    return ["scan", "--families", "gpt2", "--dtypes", "float32", "--seeds", "1", "--prompts", "1", "--steps", "3",
            "--scenarios", "decode", "--bugs", "none", "--jobs", "1", "--quiet", "--out", out]  # fmt: skip


def test_scan_whose_scoreboard_cannot_be_written_is_one_line_and_74(tmp_path, capsys, disk_full_under):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    torch.set_num_threads(1)
    long = tmp_path / ("s" * 250)  # the scoreboard's folder "s...s.report": 257 bytes
    proc = cli(capsys, *_scan_args(long))
    assert proc.returncode == EXIT_STORAGE, proc.stdout + proc.stderr
    one_line(proc, "the scoreboard could not be written", "a name of 257 bytes", f"runs are stored in {long}")
    assert "1 run now" in proc.stdout  # the run was stored before the scoreboard failed
    short = tmp_path / "scan"
    shutil.copytree(long, short)
    disk_full_under(tmp_path / "scan.report")
    proc = cli(capsys, *_scan_args(short))
    assert proc.returncode == EXIT_STORAGE, proc.stdout + proc.stderr
    one_line(proc, "No space left on device", f"{short}.report", f"1 runs are stored in {short}", "free space")
    assert "1 already stored, 0 run now" in proc.stdout
