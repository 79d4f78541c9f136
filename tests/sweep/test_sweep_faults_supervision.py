"""The pool's supervision (issues 29, 42): a run past ``--run-timeout`` is a ``timeout`` row however its worker
is held: by C code that keeps the GIL (no thread of the worker runs), after arming its own ``faulthandler``
watchdog (which replaced the one kvfast armed in the worker before issue 42: a process has one), or with
SIGALRM blocked while it renames its process over and over. The sweep process kills the worker, timing the
run by the worker's process name.

Through the real command line, on tests/faultstudy.py (see tests/sweep/test_sweep_faults.py).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_sweep_faults import ENV, ROOT, grid_toml, kvfast, marks_env, one_line, stored

from kvfast.commands.sweep import EXIT_FAILED

pytestmark = pytest.mark.subprocess  # every test here starts a Python process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libc sleep through ctypes.PyDLL, PR_SET_NAME")
@pytest.mark.parametrize(
    "backend, mode",
    [
        ("fork", "gil"),
        pytest.param("loky", "gil", marks=pytest.mark.slow),
        ("fork", "watchdog"),
        ("loky", "watchdog"),
        ("fork", "renamed"),
    ],
)
def test_a_run_holding_the_gil_past_its_time_limit_is_a_timeout_row(tmp_path, backend, mode):
    """Issue 42: a `watchdog` run (its own faulthandler watchdog, then the GIL held) hung the sweep for ever: the
    worker's backstop was faulthandler's timer, which the run had replaced."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([80], mode), ([4, 5, 6, 7], "ok"))
    out = tmp_path / "o"
    args = ["--jobs", "2", "--backend", backend, "--run-timeout", "2", "--quiet"]
    t0 = time.monotonic()
    proc = kvfast("run", toml, "--out", out, *args, timeout=150)  # a hang fails here
    assert time.monotonic() - t0 < 100
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    one_line(proc, "1 runs stored as error, crashed or timeout")
    df = stored(out).set_index("x")
    assert df.loc[80, "status"] == "timeout" and "--run-timeout 2 s" in df.loc[80, "error"]
    ok = df.drop(index=80)
    assert len(ok) == 8 and (ok["status"] == "ok").all() and (ok["y"] == 1.5 * ok.index).all()
    again = kvfast("run", toml, "--out", out, *args)
    assert again.returncode == EXIT_FAILED and "9 already stored, 0 run now" in again.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, PR_SET_NAME")
def test_a_run_that_stops_its_worker_past_the_run_timeout_is_a_timeout_row_without_a_second_try(tmp_path):
    """Done-when: the SIGSTOP case ends within --run-timeout plus a few seconds. The sweep kills the worker
    stopped for --run-timeout and reads the run from the worker's process name: a `timeout` row at once, not a
    second try alone (which would stop and wait again)."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"), ([60], "stop"), ([4, 5, 6, 7], "ok"))
    out, marks = tmp_path / "o", tmp_path / "marks"
    args = ["--jobs", "2", "--backend", "fork", "--run-timeout", "2", "--quiet"]
    proc = kvfast("run", toml, "--out", out, *args, env=marks_env(marks), timeout=150)
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert len((marks / "stop-60").read_text().split()) == 1  # it ran once
    df = stored(out).set_index("x")
    assert df.loc[60, "status"] == "timeout" and (df.drop(index=60)["status"] == "ok").all() and len(df) == 9


STOP_AFTER_THE_COMMAND = """
import os, signal, sys
from joblib.externals.loky import reusable_executor
from kvfast.cli import main
code = main(sys.argv[1:])
executor = reusable_executor._executor  # the loky workers the sweep used, if the command left them running
for proc in list((getattr(executor, "_processes", None) or {}).values()):
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGSTOP)  # stopped after the sweep's last look at its workers
print("exit", code, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP")
def test_a_loky_worker_stopped_after_the_sweep_does_not_hold_the_exit(tmp_path):
    """Every run stored and the summary printed, an idle loky worker stopped (SIGSTOP) after the sweep's last
    look at its workers held the command's exit for ever: loky joins its workers when the interpreter exits
    (seen once in the loaded fault test). The command now kills its loky workers when it returns, so there
    is none left to stop, and the process exits."""
    toml = grid_toml(tmp_path / "g.toml", ([0, 1, 2, 3], "ok"))
    out = tmp_path / "o"
    argv = ["run", str(toml), "--out", str(out), "--jobs", "2", "--backend", "loky", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", STOP_AFTER_THE_COMMAND, *argv],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )  # a hang fails here
    assert done.returncode == 0 and "exit 0" in done.stdout, done.stdout + done.stderr
    assert len(stored(out)) == 4
