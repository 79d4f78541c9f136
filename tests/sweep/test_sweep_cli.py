"""The sweep commands: resume after a real ``kill -9``, and every bad input -> one line, exit 2, results untouched."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvfast.cli import main
from kvfast.studies import STUDIES
from kvfast.sweep import ResultsDir, builtin_grids, list_parts, load, load_grid, run_sweep

KVFAST = str(Path(sys.executable).with_name("kvfast"))

SMALL = """\
study = "exactness"
[fixed]
vocab = 32
d_model = 16
d_ff = 32
n_head = 1
prompt_len = 3
steps = 4
order = "sequential"
[axes]
seed = [0, 1]
n_layer = [1, 2]
preset = ["f64"{extra}]
"""


def children(pid: int) -> list[int]:
    """Pids of the processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def stored(tmp_path) -> Path:
    """A results directory holding a finished 4-run exactness sweep."""
    grid_toml = tmp_path / "small.toml"
    grid_toml.write_text(SMALL.format(extra=""))
    out = tmp_path / "stored"
    assert main(["run", str(grid_toml), "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    return out


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def expect_refused(capsys, argv: list[str], match: str) -> None:
    """``kvfast ARGV`` exits 2 with one line on stderr containing ``match``."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1, err
    assert match in err, err


def test_bad_input_gives_one_line_exit_2_and_leaves_stored_results_alone(tmp_path, stored, capsys, monkeypatch):
    before = snapshot(stored)
    out = str(stored)
    small = SMALL.format(extra="")
    cases = [
        (["run", "no-such-grid", "--out", out], "'no-such-grid' is not a built-in grid; allowed: "),
        (
            ["run", write(tmp_path, "a.toml", small.replace("[axes]", "[axes]\ncolour = [1]")), "--out", out],
            "axis 'colour' is not a config field of study 'exactness'; allowed: seed",
        ),
        (
            ["run", write(tmp_path, "v.toml", small.replace('"sequential"', '"reverse"')), "--out", out],
            "order: 'reverse' is not allowed; allowed: sequential, pairwise",
        ),
        (["run", write(tmp_path, "s.toml", small.replace("[axes]", "[axes")), "--out", out], "TOML syntax error"),
        (
            ["run", write(tmp_path, "r.toml", small.replace("n_head = 1", "n_head = 0")), "--out", out],
            "n_head: 0 is not allowed; allowed: an integer >= 1",
        ),
        (
            ["run", write(tmp_path, "p.toml", small.replace('"f64"', '"f16"')), "--out", out],
            "preset: 'f16' is not allowed; allowed: f64, f32, bf16",
        ),
        (["run", "exactness", "--out", out, "--jobs", "0"], "--jobs: 0 is not allowed; allowed: an integer >= 1"),
        (["scan", "--out", out, "--jobs", "x"], "--jobs: 'x' is not allowed; allowed: an integer >= 1"),
        (["run", "exactness", "--out", out, "--backend", "mpi"], "invalid choice: 'mpi'"),
        (["run", "exactness", "--out", out, "--scheduler", "tcp://127.0.0.1:9"], "needs --backend dask"),
        (
            ["run", "exactness", "--out", out, "--backend", "dask", "--scheduler", "tcp://127.0.0.1:9"],
            "--scheduler: cannot connect to 'tcp://127.0.0.1:9'",
        ),
        (["show", str(tmp_path / "nowhere")], "is not a directory"),
        (["study", "nope"], "study: 'nope' is not allowed; allowed: "),
    ]
    for argv, match in cases:
        expect_refused(capsys, argv, match)
        assert snapshot(stored) == before, argv

    # the same study at another version (its run ids and numbers may differ): refused, unless --fresh
    version = STUDIES["exactness"].version  # the version the stored results were written by
    patched = dataclasses.replace(STUDIES["exactness"], version="999")
    monkeypatch.setitem(STUDIES, "exactness", patched)
    grid = write(tmp_path, "ok.toml", small)
    expect_refused(capsys, ["run", grid, "--out", out], f"holds results of exactness version '{version}'")
    assert snapshot(stored) == before


def test_foreign_unwritable_and_busy_output_directories_are_refused(tmp_path, stored, capsys):
    grid = write(tmp_path, "ok.toml", SMALL.format(extra=""))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    expect_refused(capsys, ["run", grid, "--out", str(foreign)], "is not a kvfast results directory")
    assert snapshot(foreign) == {"notes.txt": b"mine"}

    a_file = tmp_path / "file"
    a_file.write_text("x")
    expect_refused(capsys, ["run", grid, "--out", str(a_file)], "is not a directory")
    expect_refused(capsys, ["run", grid, "--out", str(a_file / "sub")], "is not writable")
    assert a_file.read_text() == "x"

    before = snapshot(stored)
    with ResultsDir(stored).locked():
        expect_refused(capsys, ["run", grid, "--out", str(stored), "--fresh"], "is in use by another sweep")
    after = snapshot(stored)
    after.pop(".lock"), before.pop(".lock")  # the lock file holds the holder's pid
    assert after == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_directory_is_refused(tmp_path, capsys):
    grid = write(tmp_path, "ok.toml", SMALL.format(extra=""))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        expect_refused(capsys, ["run", grid, "--out", str(ro / "out")], "is not writable")
    finally:
        ro.chmod(0o700)


@pytest.mark.subprocess
def test_real_command_line_exit_codes(tmp_path, stored):
    bad = write(tmp_path, "bad.toml", SMALL.format(extra="").replace("[axes]", "[axes]\ncolour = [1]"))
    proc = subprocess.run([KVFAST, "run", bad, "--out", str(stored)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "axis 'colour'" in proc.stderr
    # extending the stored grid runs only the new runs; `show` reads the directory
    grid = write(tmp_path, "more.toml", SMALL.format(extra=', "f32"'))
    proc = subprocess.run([KVFAST, "run", grid, "--out", str(stored), "--jobs", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "8 runs in the grid, 4 already stored, 4 run now" in proc.stdout
    proc = subprocess.run([KVFAST, "show", str(stored)], capture_output=True, text=True)
    assert proc.returncode == 0 and "8 runs stored: ok 8" in proc.stdout


@pytest.mark.subprocess
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path):
    # the exactness grid with 24 seeds (10,368 runs, about 5 s on 2 workers): long enough to be killed
    # mid-way once the first part (parts are written about once a second) is on disk
    toml = tmp_path / "exact24.toml"
    text = builtin_grids()["exactness"].read_text()
    toml.write_text(text.replace("seed = [0, 1, 2]", f"seed = {list(range(24))}"))
    grid = load_grid(str(toml))
    assert len(grid) == 10368
    out = tmp_path / "killed"
    cmd = [KVFAST, "run", str(toml), "--out", str(out), "--jobs", "2", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:  # a part stored and the pool started:
            if out.is_dir() and len(list_parts(out)) >= 1:  # the first part can come from the warm-up
                workers = children(proc.pid)  # run in the sweep's own process, before any worker exists
                if workers:
                    break
            time.sleep(0.01)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        # its worker processes notice and exit, rather than idling on as orphans
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p) for p in workers):
            time.sleep(0.1)
        assert workers and not any(alive(p) for p in workers)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the killed sweep's process group
        except ProcessLookupError:
            pass
    partial = pd.read_parquet(out)  # no half-written file is visible to plain readers
    assert 0 < len(partial) < len(grid)
    assert partial["run_id"].is_unique

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(partial):,} already stored, {len(grid) - len(partial):,} run now" in resumed.stdout

    reference = tmp_path / "uninterrupted"
    assert run_sweep(grid, reference, jobs=2, quiet=True).ok
    got, want = load(out), load(reference)
    assert len(got) == len(grid) and got["run_id"].is_unique
    assert set(got["run_id"]) == {r.run_id for r in grid.runs}
    pd.testing.assert_frame_equal(got.drop(columns="wall_s"), want.drop(columns="wall_s"), check_exact=True)
    assert np.array_equal(got["max_abs_dev"].to_numpy().view(np.int64), want["max_abs_dev"].to_numpy().view(np.int64))
    # the dataset on disk has each run once (compacted), and pandas reads it directly
    assert len(list_parts(out)) == 1 and len(pd.read_parquet(out)) == len(grid)


def test_grids_lists_the_builtin_grids_with_their_run_counts(capsys):
    assert main(["grids"]) == 0
    listing = capsys.readouterr().out
    row = next(line for line in listing.splitlines() if line.split()[:2] == ["exactness", "exactness"])
    assert row.split()[2] == "1296"


@pytest.mark.subprocess
def test_a_closed_pipe_ends_a_command_quietly(tmp_path):
    """`kvfast grids | head -0`: the reader is gone before kvfast writes; no traceback, exit 141 (128 + SIGPIPE)."""
    proc = subprocess.Popen([KVFAST, "grids"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # closed long before the command has started and printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "bug in kvfast" not in err
