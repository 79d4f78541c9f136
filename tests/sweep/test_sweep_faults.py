"""Fault injection on the sweep engine (issue 14): every failure is a row, a line and an exit code,
and a rerun ends identical to an uninterrupted sweep.

Runs go through the real command line (``python -m kvfast.cli``) in a subprocess, on the study in
tests/faultstudy.py, whose runs exit, hang, crash or write big rows on request. Exit codes:
see ``kvfast.commands.sweep.EXIT_CODES``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from shared import ROOT, TESTS, environment
from shared import kvfast as run_kvfast

import kvfast.studies  # noqa: F401 - registers the built-in studies (the sweep names none itself: issue 29)
from kvfast.cli import main
from kvfast.commands.sweep import EXIT_CODES, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LOST, EXIT_STORAGE
from kvfast.sweep import grid_from_spec, load, load_grid, run_sweep
from kvfast.sweep.store import MANIFEST, QUARANTINE, list_parts

ENV = environment(TESTS)  # faultstudy
COLUMNS = ["run_id", "x", "mode", "y", "blob", "status", "error"]


def kvfast(*argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_kvfast(*argv, env=env or ENV, timeout=timeout)


def marks_env(folder: Path) -> dict:
    """The environment under which tests/faultstudy.py leaves marks in ``folder`` (see its docstring)."""
    folder.mkdir(exist_ok=True)
    return {**ENV, "KVFAST_FAULT_MARKS": str(folder)}


def wait_for_a_worker_run(marks: Path, sweep: subprocess.Popen, limit: float = 300) -> None:
    """Wait until a ``slow`` run has started in a process other than the sweep's own (a worker).

    No fixed sleep: on a loaded machine the sweep may still be importing pandas seconds
    after it started, and a signal then tests start-up, not the sweep."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for mark in marks.glob("started-*"):
            pid = mark.read_text().strip()
            if pid and int(pid) != sweep.pid:
                return
        assert sweep.poll() is None, "the sweep ended before any worker started a run"
        time.sleep(0.02)
    raise AssertionError(f"no run started in a worker within {limit} s")


def cli(capsys, *argv) -> subprocess.CompletedProcess:
    """``kvfast ARGV`` in this process (faster than a subprocess; the same ``main``)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    got = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, got.out, got.err)


def grid_toml(path: Path, *entries: tuple[list[int], str]) -> Path:
    """A grid file of the fault study: one ``[[union]]`` entry per ``(xs, mode)``."""
    lines = ['study = "faultstudy:STUDY"']
    for xs, mode in entries:
        lines += ["[[union]]", "[union.axes]", f"x = {list(xs)}", f'mode = ["{mode}"]']
    path.write_text("\n".join(lines) + "\n")
    return path


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The failure's line on stderr: no traceback, and it says every one of ``needles``."""
    err = proc.stderr
    assert "Traceback" not in err and "Fatal Python error" not in err, err
    lines = [ln for ln in err.splitlines() if all(n in ln for n in needles)]
    assert lines, f"no line with {needles} in:\n{err}"
    return lines[0]


def stored(out: Path) -> pd.DataFrame:
    return load(out)[COLUMNS].reset_index(drop=True)


_REFERENCES: dict[str, pd.DataFrame] = {}


def reference(tmp_path: Path, toml: Path) -> pd.DataFrame:
    """The rows of an uninterrupted sweep of ``toml`` (computed once per grid text)."""
    text = toml.read_text()
    if text not in _REFERENCES:
        out = tmp_path / f"ref-{toml.stem}"
        run_sweep(load_grid(str(toml)), out, jobs=2, quiet=True)
        _REFERENCES[text] = stored(out)
    return _REFERENCES[text]


def test_exit_code_table_is_complete():
    """Every code the sweep commands use; docs/sweep.md's copy of the table is tests/docs/test_doc_tables.py's."""
    assert set(EXIT_CODES) == {0, 1, 2, 3, 70, 74, 130}


# --- 1. a run that exits is a row, never a silent exit -------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_system_exit_and_keyboard_interrupt_in_a_run_are_error_rows(tmp_path, jobs, capsys):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2], "ok"), ([10], "exit0"), ([11], "exit3"), ([12], "kbint"))
    proc = cli(capsys, "run", toml, "--out", tmp_path / "o", "--jobs", jobs, "--quiet")
    assert proc.returncode == EXIT_FAILED
    one_line(proc, "3 runs stored as error")
    df = stored(tmp_path / "o").set_index("x")
    assert (df.loc[[0, 1, 2], "status"] == "ok").all()
    assert df.loc[10, "error"].startswith("SystemExit: 0") and df.loc[11, "error"].startswith("SystemExit: 3")
    assert df.loc[12, "error"].startswith("KeyboardInterrupt")
    assert stored(tmp_path / "o").equals(reference(tmp_path, toml))


# --- 4. time limits --------------------------------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "backend, modes",
    [
        ("fork", ("hang", "stuck")),
        ("loky", ("hang", "stuck")),
        ("threading", ("spin",)),
        ("inline", ("hang", "spin")),
        pytest.param("dask", ("hang", "spin"), marks=pytest.mark.slow),
    ],
)
def test_run_timeout_stores_timeout_rows_and_replaces_the_worker(tmp_path, backend, modes, capsys):
    entries = [([0, 1, 2, 3], "ok"), *[([20 + i], m) for i, m in enumerate(modes)], ([4, 5, 6, 7], "ok")]
    toml = grid_toml(tmp_path / "g.toml", *entries)
    args = ["--jobs", "1"] if backend == "inline" else ["--jobs", "2", "--backend", backend]
    t0 = time.monotonic()
    proc = cli(capsys, "run", toml, "--out", tmp_path / "o", *args, "--run-timeout", "1", "--quiet")
    assert time.monotonic() - t0 < 60
    assert proc.returncode == EXIT_FAILED, proc.stderr
    one_line(proc, f"{len(modes)} runs stored as error, crashed or timeout")
    df = stored(tmp_path / "o")
    assert (df.loc[df["mode"] == "ok", "status"] == "ok").all() and (df["mode"] == "ok").sum() == 8
    bad = df[df["mode"] != "ok"]
    assert (bad["status"] == "timeout").all() and bad["error"].str.contains("--run-timeout 1 s").all()
    assert not (tmp_path / "o" / ".timeouts").exists() or not any((tmp_path / "o" / ".timeouts").iterdir())


@pytest.mark.subprocess
def test_run_timeout_refuses_nonsense():
    proc = kvfast("run", "gradcheck", "--out", "/tmp/never", "--run-timeout", "-1")
    assert proc.returncode == 2 and "--run-timeout" in proc.stderr and "Traceback" not in proc.stderr


# --- 5. no orphans ---------------------------------------------------------------------------------


def _group_alive(sid: int) -> list[int]:
    """Live processes of the session ``sid`` (the sweep's, started with ``start_new_session``): its workers
    lead process groups of their own inside it, and whatever their runs start stays in it too."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "backend, delay",
    [
        ("fork", 0.3),
        ("loky", 0.3),
        pytest.param("fork", 2.5, marks=pytest.mark.slow),
        pytest.param("loky", 1.5, marks=pytest.mark.slow),
        pytest.param("loky", 3.0, marks=pytest.mark.slow),
    ],
)
def test_kill_9_of_the_sweep_leaves_no_worker_behind(tmp_path, backend, delay):
    toml = grid_toml(tmp_path / "g.toml", (list(range(16)), "slow"))
    out, marks = tmp_path / "o", tmp_path / "marks"
    cmd = [sys.executable, "-m", "kvfast.cli", "run", str(toml), "--out", str(out), "--jobs", "2", "--quiet"]
    proc = subprocess.Popen(
        [*cmd, "--backend", backend], env=marks_env(marks), cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL
    )
    wait_for_a_worker_run(marks, proc)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while (alive := _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"workers left {alive} after kill -9 {delay} s after a worker started a run"
    again = kvfast("run", toml, "--out", out, "--jobs", "2", "--quiet")
    assert again.returncode == 0, again.stderr
    assert stored(out).equals(reference(tmp_path, toml))


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_sweep_ends_the_processes_its_runs_had_running(tmp_path):
    """A run's process tree ends with it when the sweep is killed too: each worker's keeper kills its group."""
    toml = grid_toml(tmp_path / "g.toml", (list(range(8)), "slowkid"))
    out, marks = tmp_path / "o", tmp_path / "marks"
    cmd = [sys.executable, "-m", "kvfast.cli", "run", str(toml), "--out", str(out), "--jobs", "2", "--quiet"]
    proc = subprocess.Popen(cmd, env=marks_env(marks), cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL)
    wait_for_a_worker_run(marks, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kids = [int(p) for mark in marks.glob("kids-*") for p in mark.read_text().split()]
    try:
        deadline = time.monotonic() + 10
        while ((left := [p for p in kids if _alive(p)]) or _group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kids and not left and not _group_alive(proc.pid), (kids, left, _group_alive(proc.pid))
    finally:
        for pid in kids:
            with __import__("contextlib").suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# --- 8. Ctrl-C and crashes: quiet --------------------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "backend, delay",
    [
        ("fork", 0.3),  # seconds after a worker started a run (16 runs of 0.3 s on 2 workers: well before the end)
        pytest.param("loky", 0.3, marks=pytest.mark.slow),
        pytest.param("dask", 0.3, marks=pytest.mark.slow),
        pytest.param("dask", 1.0, marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_is_exit_130_without_worker_tracebacks_and_resumes(tmp_path, backend, delay):
    toml = grid_toml(tmp_path / "g.toml", (list(range(16)), "slow"))
    out, marks = tmp_path / "o", tmp_path / "marks"
    cmd = [sys.executable, "-m", "kvfast.cli", "run", str(toml), "--out", str(out), "--jobs", "2", "--quiet"]
    cmd += ["--backend", backend]
    proc = subprocess.Popen(
        cmd, env=marks_env(marks), cwd=ROOT, start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    wait_for_a_worker_run(marks, proc)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the sweep's process group
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "ERROR" not in err, err
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(proc.pid)
    again = kvfast("run", toml, "--out", out, "--jobs", "2", "--quiet")
    assert again.returncode == 0 and stored(out).equals(reference(tmp_path, toml))


# --- issue 23: runs that fork, stop, or leave processes behind ---------------------------------------


@pytest.mark.subprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
@pytest.mark.parametrize("args", [["--jobs", "1"], ["--jobs", "2", "--backend", "fork"]])
def test_a_forked_child_that_returns_never_reaches_the_sweep(tmp_path, args):
    """Finding 10: `if os.fork() == 0: return {...}` in a run hung the sweep and stored 45 rows for 24 runs."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([50, 51, 52], "forkret"), ([4, 5, 6, 7], "ok"))
    out = tmp_path / "o"
    proc = kvfast("run", toml, "--out", out, *args, "--quiet", timeout=120)  # a hang fails here
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip() == "", proc.stderr
    assert "11 run now" in proc.stdout
    raw = pd.read_parquet(out)
    assert len(raw) == 11 and raw["run_id"].is_unique and (raw["blob"] == "").all()
    ref = grid_toml(tmp_path / "ref.toml", ([0, 1, 2, 3], "ok"), ([50, 51, 52], "forkret"), ([4, 5, 6, 7], "ok"))
    assert stored(out).equals(reference(tmp_path, ref))
    again = kvfast("run", toml, "--out", out, *args, "--quiet")
    assert again.returncode == 0 and "11 already stored, 0 run now" in again.stdout


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, /proc")
@pytest.mark.parametrize("backend", ["fork", pytest.param("loky", marks=pytest.mark.slow)])
def test_a_stopped_worker_is_killed_by_the_sweep_and_its_run_is_a_timeout_row(tmp_path, backend):
    """Finding 11: a worker stopped with SIGSTOP (never resumed) made the sweep wait forever; its time limit
    was enforced only inside the stopped worker. The sweep process now kills it."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([60], "stop"), ([4, 5, 6, 7], "ok"))
    out = tmp_path / "o"
    t0 = time.monotonic()
    args = ["--jobs", "2", "--backend", backend, "--run-timeout", "2", "--quiet"]
    proc = kvfast("run", toml, "--out", out, *args, timeout=240)
    assert proc.returncode == EXIT_FAILED, proc.stderr
    assert time.monotonic() - t0 < 200
    one_line(proc, "1 runs stored as error, crashed or timeout")
    df = stored(out).set_index("x")
    assert df.loc[60, "status"] == "timeout" and "--run-timeout 2 s" in df.loc[60, "error"]
    ok = df.drop(index=60)
    assert len(ok) == 8 and (ok["status"] == "ok").all() and (ok["y"] == 1.5 * ok.index).all()
    assert not (out / ".workers").exists()
    assert not any((out / ".timeouts").iterdir()) if (out / ".timeouts").exists() else True
    again = kvfast("run", toml, "--out", out, *args)
    assert again.returncode == EXIT_FAILED and "9 already stored, 0 run now" in again.stdout
    assert stored(out).equals(df.reset_index()[COLUMNS])


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, /proc")
@pytest.mark.parametrize("backend", ["fork", "loky"])
def test_a_worker_stopped_between_runs_is_killed_within_the_run_timeout(tmp_path, backend):
    """Issue 29: a worker stopped with SIGSTOP while no run of it was in progress (its heartbeat said idle) was
    waited for until --stall-timeout (300 s): the sweep looked hung. With --run-timeout a stopped worker is
    killed once stopped that long, whatever it was doing. The `stopidle` run returns and its worker stops
    itself 0.2 s later, while the other worker's `hang` run runs into its time limit."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([20], "hang"), ([62], "stopidle"))
    out = tmp_path / "o"
    args = ["--jobs", "2", "--backend", backend, "--run-timeout", "2", "--quiet"]
    t0 = time.monotonic()
    proc = kvfast("run", toml, "--out", out, *args, timeout=150)  # a hang fails here (it waited 300 s)
    took = time.monotonic() - t0
    assert took < 100, took  # the start-up of 2 loky workers on a loaded machine included
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    one_line(proc, "1 runs stored as error, crashed or timeout")
    df = stored(out).set_index("x")
    assert len(df) == 6 and df.loc[20, "status"] == "timeout" and (df.drop(index=20)["status"] == "ok").all()
    again = kvfast("run", toml, "--out", out, *args, timeout=150)
    assert again.returncode == EXIT_FAILED and "6 already stored, 0 run now" in again.stdout, again.stdout


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, /proc")
def test_a_worker_stopped_for_the_stall_timeout_is_killed_and_its_run_crashed(tmp_path):
    """Without --run-timeout a stopped worker is killed after --stall-timeout; its run is retried alone
    per the crash rules (it stops its worker again: `crashed`), the other runs are stored ok."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([61], "stop"), ([4, 5], "ok"))
    out = tmp_path / "o"
    proc = kvfast("run", toml, "--out", out, "--jobs", "2", "--stall-timeout", "1", "--quiet", timeout=240)
    assert proc.returncode == EXIT_FAILED, proc.stderr
    one_line(proc, "killed its worker, twice; stored as crashed")
    df = stored(out).set_index("x")
    assert df.loc[61, "status"] == "crashed" and (df.drop(index=61)["status"] == "ok").all() and len(df) == 7


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("args", [["--jobs", "1"], ["--jobs", "2", "--backend", "fork"]])
def test_processes_a_run_leaves_behind_are_ended_with_the_run(tmp_path, args):
    """Also seen in issue 23: a run's own grandchild processes outlived the sweep. Each `orphan` run leaves
    a `sleep` child and a detached daemon (new session, parent gone); none may be running after the sweep."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1], "ok"), ([70, 71, 72], "orphan"), ([2, 3], "ok"))
    marks = tmp_path / "marks"
    proc = kvfast("run", toml, "--out", tmp_path / "o", *args, "--quiet", env=marks_env(marks))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    pids = [int(p) for mark in marks.glob("orphans-*") for p in mark.read_text().split()]
    assert len(pids) == 6, pids
    try:
        deadline = time.monotonic() + 5
        while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes left running by runs: {left}"
    finally:
        for pid in pids:
            with __import__("contextlib").suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert (stored(tmp_path / "o")["status"] == "ok").all() and len(stored(tmp_path / "o")) == 7


@pytest.mark.parametrize("surfaces_as", ["KeyboardInterrupt", "ImportError"])
def test_ctrl_c_during_the_clis_start_up_is_one_line_and_130(monkeypatch, capsys, surfaces_as):
    """A real SIGINT while the subcommands are imported (pandas, NumPy: seconds on a loaded machine) is one
    line and 130, also when the import it hit turns it into an ImportError (NumPy's C extension does)."""
    import kvfast.cli as cli_module

    def importing():
        try:
            os.kill(os.getpid(), signal.SIGINT)  # delivered to this (the main) thread, as a terminal's Ctrl-C
            time.sleep(5)
        except KeyboardInterrupt:
            if surfaces_as == "ImportError":
                raise ImportError("PyCapsule_Import could not import module 'datetime'") from None
            raise
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(cli_module, "build_parser", importing)
    capsys.readouterr()
    assert cli_module.main(["run", "exactness"]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err == "kvfast: interrupted\n", err
    assert signal.getsignal(signal.SIGINT) is not cli_module._on_ctrl_c  # main put the previous handler back


@pytest.mark.subprocess
def test_a_segfaulting_run_is_one_line_and_a_crashed_row(tmp_path):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2], "ok"), ([30], "segv"), ([3, 4], "ok"))
    proc = kvfast("run", toml, "--out", tmp_path / "o", "--jobs", "2", "--quiet")
    assert proc.returncode == EXIT_FAILED
    one_line(proc, "killed its worker", "crashed")
    assert proc.stderr.count("Segmentation fault") == 0
    df = stored(tmp_path / "o").set_index("x")
    assert df.loc[30, "status"] == "crashed" and (df.drop(index=30)["status"] == "ok").all()


# --- 3. limits before work -------------------------------------------------------------------------


@pytest.mark.subprocess
def test_jobs_above_the_core_count_is_capped_with_a_warning(tmp_path, capsys):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"))
    proc = cli(capsys, "run", toml, "--out", tmp_path / "o", "--jobs", "100000", "--quiet")
    assert proc.returncode == 0
    line = one_line(proc, "warning: --jobs 100000 is more than the")
    assert f"using {os.cpu_count()}" in line


def test_a_run_needing_more_memory_than_the_machine_is_refused_before_work(tmp_path, capsys):
    out = tmp_path / "o"
    proc = cli(capsys, "run", "precision", "--out", out, "--max-memory", "0.001")
    assert proc.returncode == 2 and not out.exists()
    line = one_line(proc, "GiB by kvfast's estimate", "--max-memory")
    assert "d_model=" in line


def test_a_grid_whose_results_would_not_fit_on_the_disk_is_refused_before_work(tmp_path, capsys, monkeypatch):
    import shutil

    from kvfast.sweep import limits

    out = tmp_path / "o"
    grid = load_grid("exactness")
    need = limits.row_bytes(grid.study) * len(grid)
    real = shutil.disk_usage
    fake = type(real(tmp_path))(total=10 * need, used=10 * need - need // 2, free=need // 2)
    monkeypatch.setattr(limits.shutil, "disk_usage", lambda path: fake)
    proc = cli(capsys, "run", "exactness", "--out", out)
    assert proc.returncode == 2 and not out.exists()
    line = one_line(proc, "1,296 runs need up to", "free under")
    # the same grid with room for it is not refused (the check compares, it does not always refuse)
    fake_roomy = type(real(tmp_path))(total=10 * need, used=0, free=2 * need)
    monkeypatch.setattr(limits.shutil, "disk_usage", lambda path: fake_roomy)
    limits.check_disk(grid, out)
    assert "bytes a row" in line


@pytest.mark.subprocess
def test_max_runs_refuses_a_huge_grid_before_expanding_it(tmp_path, capsys):
    toml = tmp_path / "huge.toml"
    toml.write_text('study = "faultstudy:STUDY"\n[axes]\nx = ' + str(list(range(10_000))) + '\nmode = ["ok"]\n')
    t0 = time.monotonic()
    proc = cli(capsys, "run", toml, "--out", tmp_path / "o", "--max-runs", "100")
    assert proc.returncode == 2 and time.monotonic() - t0 < 30
    one_line(proc, "--max-runs")


# --- 6. one line, the right code, a way back -------------------------------------------------------


def _manifest_breakers():
    return {
        "list": lambda p: p.write_text("[1, 2]"),
        "not json": lambda p: p.write_text("{"),
        "binary": lambda p: p.write_bytes(b"\x00\xff\xfe\x80"),
        "no study": lambda p: p.write_text(
            json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "study"})
        ),
        "other format": lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "format": "x"})),
        "unreadable": lambda p: (p.unlink(), p.mkdir()),
        "missing": lambda p: p.unlink(),
    }


@pytest.mark.subprocess
@pytest.mark.parametrize("shape", list(_manifest_breakers()))
def test_every_broken_manifest_is_one_line_naming_it_and_repair_brings_it_back(tmp_path, shape, capsys):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3, 4, 5], "ok"))
    out = tmp_path / "o"
    assert cli(capsys, "run", toml, "--out", out, "--jobs", "1", "--quiet").returncode == 0
    _manifest_breakers()[shape](out / MANIFEST)
    for command in (["run", toml, "--out", out, "--jobs", "1", "--quiet"], ["show", out]):
        proc = cli(capsys, *command)
        assert proc.returncode == 2, (shape, proc.stderr)
        one_line(proc, str(out / MANIFEST), f"kvfast repair {out}")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    replaced = cli(capsys, "run", toml, "--out", copy, "--jobs", "1", "--quiet", "--fresh")
    assert replaced.returncode == 0 and "0 already stored, 6 run now" in replaced.stdout, replaced.stderr
    fixed = cli(capsys, "repair", out)
    assert fixed.returncode == 0 and "rebuilt _sweep.json from 1 parts" in fixed.stdout, fixed.stdout + fixed.stderr
    again = cli(capsys, "run", toml, "--out", out, "--jobs", "1", "--quiet")
    assert again.returncode == 0 and "6 already stored, 0 run now" in again.stdout
    assert stored(out).equals(reference(tmp_path, toml))
    assert cli(capsys, "show", out).returncode == 0


@pytest.mark.subprocess
def test_a_truncated_part_is_one_line_then_repair_quarantines_it_and_a_rerun_reruns_its_runs(tmp_path, capsys):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3, 4, 5, 6, 7], "ok"))
    out = tmp_path / "o"
    assert cli(capsys, "run", toml, "--out", out, "--jobs", "1", "--quiet").returncode == 0
    (part,) = list_parts(out)
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    for command in (["run", toml, "--out", out, "--quiet"], ["show", out]):
        proc = cli(capsys, *command)
        assert proc.returncode == 2
        one_line(proc, str(part), f"kvfast repair {out}")
    with pytest.raises(ValueError, match="kvfast repair"):
        load(out)
    fixed = cli(capsys, "repair", out)
    assert fixed.returncode == 0 and f"moved unreadable {part.name} into {QUARANTINE}/" in fixed.stdout
    assert (out / QUARANTINE / part.name).exists()
    again = cli(capsys, "run", toml, "--out", out, "--jobs", "2", "--quiet")
    assert again.returncode == 0 and "0 already stored, 8 run now" in again.stdout, again.stdout
    assert stored(out).equals(reference(tmp_path, toml))


def _flip_a_bit_of_y(part: Path, y: float) -> None:
    """Change one bit of the stored value ``y`` inside the ``y`` column chunk of ``part`` (its dictionary page:
    the value's 8 bytes as written), so that the chunk still decodes, to another number."""
    import struct

    import pyarrow.parquet as pq

    meta = pq.ParquetFile(part).metadata
    chunk = meta.row_group(0).column(meta.schema.names.index("y"))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(part.read_bytes())
    at = data.find(struct.pack("<d", y), start, start + chunk.total_compressed_size)
    assert at >= 0, "the value's bytes are not in the y column chunk as written"
    data[at + 6] ^= 0x01  # a bit of the mantissa's top byte: 10.5 reads as 10.0
    part.write_bytes(bytes(data))


@pytest.mark.subprocess
def test_a_damaged_part_is_one_line_then_repair_quarantines_it_and_a_rerun_reruns_its_runs(tmp_path):
    """Issue 42: bytes overwritten inside a part's column chunk were read back as other numbers (no checksums),
    and `kvfast run` resumed with exit 0. Parts carry page checksums now, verified on every read."""
    import pyarrow.parquet as pq

    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3, 4, 5, 6, 7], "ok"))
    out = tmp_path / "o"
    assert kvfast("run", toml, "--out", out, "--jobs", "1", "--quiet").returncode == 0
    (part,) = list_parts(out)
    assert stored(out).equals(reference(tmp_path, toml))  # control: the intact part reads
    # the reason for the feature: a part written without checksums (as before issue 42) reads, and damaged the
    # same way it reads back changed, silently
    old = tmp_path / "old" / part.name
    old.parent.mkdir()
    pq.write_table(pq.read_table(part), old, write_page_checksum=False)
    assert stored(old.parent).equals(reference(tmp_path, toml))
    _flip_a_bit_of_y(old, 10.5)
    assert load(old.parent).set_index("x").loc[7, "y"] == 10.0

    _flip_a_bit_of_y(part, 10.5)
    with pytest.raises(ValueError, match="CRC checksum verification failed.*kvfast repair"):
        load(out)
    for command in (["run", toml, "--out", out, "--jobs", "1", "--quiet"], ["show", out]):
        proc = kvfast(*command)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1
        one_line(proc, str(part), "checksum", f"kvfast repair {out}")
    fixed = kvfast("repair", out)
    assert fixed.returncode == 0, fixed.stderr
    assert f"moved unreadable {part.name} into {QUARANTINE}/ (could not verify page integrity" in fixed.stdout
    assert (out / QUARANTINE / part.name).exists() and not list_parts(out)
    again = kvfast("run", toml, "--out", out, "--jobs", "1", "--quiet")
    assert again.returncode == 0 and "0 already stored, 8 run now" in again.stdout, again.stdout + again.stderr
    assert stored(out).equals(reference(tmp_path, toml))


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["run", "show", "repair"])
def test_a_path_over_255_characters_is_one_line(tmp_path, capsys, command):
    toml = grid_toml(tmp_path / "g.toml", ([0], "ok"))
    out = tmp_path / ("a" * 300)
    proc = cli(capsys, command, *([toml, "--out", out] if command == "run" else [out]))
    assert proc.returncode == 2
    one_line(proc, "at most 255 bytes")


def test_binary_toml_names_the_file(tmp_path, capsys):
    toml = tmp_path / "bin.toml"
    toml.write_bytes(b"\x00\xff\xfe")
    proc = cli(capsys, "run", toml, "--out", tmp_path / "o")
    assert proc.returncode == 2
    one_line(proc, str(toml), "not a TOML text file")


def _can_mount_tmpfs(path: Path) -> str | None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root and mount(8) for a small tmpfs"
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    return None if r.returncode == 0 else f"mount -t tmpfs failed here: {r.stderr.strip()}"


@pytest.mark.subprocess
def test_disk_full_is_one_line_with_what_is_stored_and_a_rerun_resumes(tmp_path):
    disk = tmp_path / "disk"
    why = _can_mount_tmpfs(disk)
    if why:
        pytest.skip(why)
    try:
        toml = grid_toml(tmp_path / "g.toml", (list(range(12)), "big"))
        out = disk / "o"
        proc = kvfast("run", toml, "--out", out, "--jobs", "1", "--quiet")
        assert proc.returncode == EXIT_STORAGE, proc.stdout + proc.stderr
        one_line(proc, str(out), "No space left on device", "runs are stored", "free space and rerun to resume")
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = kvfast("run", toml, "--out", out, "--jobs", "1", "--quiet")
        assert again.returncode == 0, again.stderr
        assert stored(out).equals(reference(tmp_path, toml))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --- 7. provenance and safety ----------------------------------------------------------------------


@pytest.mark.subprocess
def test_a_resume_under_other_versions_warns_and_the_history_keeps_both(tmp_path, capsys):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2], "ok"))
    out = tmp_path / "o"
    assert cli(capsys, "run", toml, "--out", out, "--quiet").returncode == 0
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["versions"]["numpy"] = "0.0.1"
    (out / MANIFEST).write_text(json.dumps(manifest))
    grid_toml(toml, ([0, 1, 2, 3], "ok"))
    proc = cli(capsys, "run", toml, "--out", out, "--quiet")
    assert proc.returncode == 0
    one_line(proc, "warning:", "other versions", "numpy 0.0.1 ->")
    history = json.loads((out / MANIFEST).read_text())["history"]
    assert len(history) == 2 and all("numpy" in h["versions"] for h in history)


@pytest.mark.subprocess
def test_study_refuses_to_replace_another_studys_results_without_fresh(tmp_path, capsys):
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2], "ok"))
    out = tmp_path / "o"
    assert cli(capsys, "run", toml, "--out", out, "--quiet").returncode == 0
    before = sorted(p.name for p in out.iterdir())
    proc = cli(capsys, "study", "gradcheck", "--out", out, "--quiet")
    assert proc.returncode == 2
    one_line(proc, "holds results of study 'faults'", "--fresh")
    assert sorted(p.name for p in out.iterdir()) == before and len(load(out)) == 3


def test_config_values_are_canonical_before_hashing():
    base = {"study": "precision", "fixed": {"seed": 0, "n_layer": 1, "d_model": 8, "n_head": 2, "d_ff": 8}}
    base["fixed"].update(vocab=16, prompt_len=3, steps=2, storage="f64", accum="f64")
    base["fixed"].update(decode_attention="standard", prefill_order="pairwise")

    def ids(attention):
        return grid_from_spec({**base, "axes": {"attention": attention}}).iter_ids()

    assert list(ids(["online:04"])) == list(ids(["online:4"]))
    assert len(grid_from_spec({**base, "axes": {"attention": ["online:4", "online:004"]}})) == 1
    for bad in ("online:٤", "online:²"):
        with pytest.raises(ValueError, match=f"attention: '{bad}' is not allowed"):
            grid_from_spec({**base, "axes": {"attention": [bad]}})


@pytest.mark.subprocess
@pytest.mark.parametrize("sweeps", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_load_never_fails_while_a_sweep_compacts(tmp_path, sweeps):
    """A reader loads the results while a sweep writes and compacts them: once in the default run, three times
    (more chances to hit the race) with -m slow."""
    toml = grid_toml(tmp_path / "g.toml", (list(range(400)), "ok"))
    out = tmp_path / "o"
    assert kvfast("run", grid_toml(tmp_path / "seed.toml", ([0], "ok")), "--out", out, "--quiet").returncode == 0
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                load(out)
                reads[0] += 1
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    for _ in range(sweeps):  # each sweep writes parts every few runs and compacts them at the end
        shutil.rmtree(out)
        assert kvfast("run", grid_toml(tmp_path / "seed.toml", ([0], "ok")), "--out", out, "--quiet").returncode == 0
        reader = threading.Thread(target=read)
        reader.start()
        try:
            proc = kvfast("run", toml, "--out", out, "--jobs", "2", "--quiet")
        finally:
            stop.set()
            reader.join()
            stop.clear()
        assert proc.returncode == 0
    assert not errors, errors[:3]
    assert reads[0] > 10


# --- 2. Dask: dead workers are rows, a lost scheduler is lost runs -----------------------------------


@pytest.mark.subprocess
def test_dask_killed_worker_is_a_crashed_row(tmp_path):
    pytest.importorskip("distributed")
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([40], "die"), ([4, 5, 6, 7], "ok"))
    proc = kvfast("run", toml, "--out", tmp_path / "o", "--jobs", "2", "--backend", "dask", "--quiet", timeout=180)
    assert proc.returncode == EXIT_FAILED, proc.stderr
    assert "Traceback" not in proc.stderr and "KilledWorker" not in proc.stderr
    df = stored(tmp_path / "o").set_index("x")
    assert df.loc[40, "status"] == "crashed" and (df.drop(index=40)["status"] == "ok").all()


@pytest.mark.slow
def test_a_killed_dask_scheduler_is_lost_runs_in_one_line_and_a_rerun_completes(tmp_path):
    pytest.importorskip("distributed")
    sched = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
         "--scheduler-file", str(tmp_path / "s.json"), "--no-dashboard"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        for _ in range(200):
            if (tmp_path / "s.json").exists():
                break
            time.sleep(0.1)
        address = json.loads((tmp_path / "s.json").read_text())["address"]
        worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard"],
            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        toml = grid_toml(tmp_path / "g.toml", (list(range(60)), "slow"))
        out = tmp_path / "o"
        cmd = [sys.executable, "-m", "kvfast.cli", "run", str(toml), "--out", str(out), "--backend", "dask"]
        run = subprocess.Popen(
            [*cmd, "--scheduler", address, "--quiet"], env=ENV, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        time.sleep(6)
        os.killpg(sched.pid, signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == EXIT_LOST, stdout + stderr
        assert "Traceback" not in stderr
        assert "the Dask scheduler was lost" in stdout and "a plain rerun runs them" in stdout
        one_line(
            subprocess.CompletedProcess([], 0, stdout, stderr), "runs lost (not stored)", "run the same command again"
        )
        worker.kill()
        again = kvfast("run", toml, "--out", out, "--jobs", "2", "--quiet")
        assert again.returncode == 0 and stored(out).equals(reference(tmp_path, toml))
    finally:
        for p in (sched,):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        with __import__("contextlib").suppress(Exception):
            os.killpg(worker.pid, signal.SIGKILL)


@pytest.mark.parametrize("ref", [None, "nosuchmodule:STUDY"])
def test_show_of_a_study_this_kvfast_cannot_find_says_why_and_shows_the_rest(tmp_path, capsys, ref):
    """Control: the same folder with its study found prints its summary, not the line."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1], "ok"))
    out = tmp_path / "o"
    assert cli(capsys, "run", toml, "--out", out, "--jobs", "1", "--quiet").returncode == 0
    assert "no summary" not in cli(capsys, "show", out).stdout
    manifest = json.loads((out / MANIFEST).read_text())
    manifest.update(study="nosuch", study_ref=ref)
    (out / MANIFEST).write_text(json.dumps(manifest))
    shown = cli(capsys, "show", out)
    assert shown.returncode == 0 and "2 runs stored: ok 2" in shown.stdout, shown.stdout + shown.stderr
    why = ": " if ref else " is not registered in this kvfast; no summary"
    assert f"(study 'nosuch'{why}" in shown.stdout


def test_a_ctrl_c_before_the_first_run_says_nothing_stored_changed(tmp_path, capsys, monkeypatch):
    """Starting a Dask cluster, say: the engine raises before any run. Control: a finished sweep exits 0."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1], "ok"))
    assert cli(capsys, "run", toml, "--out", tmp_path / "done", "--jobs", "1", "--quiet").returncode == 0

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvfast.sweep.engine.run_sweep", interrupted)
    with pytest.raises(SystemExit) as exited:
        main(["run", str(toml), "--out", str(tmp_path / "o"), "--jobs", "1", "--quiet"])
    assert exited.value.code == 130
    assert capsys.readouterr().err == "kvfast: interrupted before any run; nothing stored changed\n"
    assert not (tmp_path / "o").exists()
