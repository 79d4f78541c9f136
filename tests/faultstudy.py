"""A study whose runs misbehave on request (``mode``), for tests/sweep/test_sweep_faults.py.

Grids name it ``study = "faultstudy:STUDY"`` (tests/ on ``PYTHONPATH``). Modes:
``ok`` (``y = 1.5 x``), ``slow`` (0.3 s, then ok), ``exit0`` / ``exit3``
(``SystemExit``), ``kbint`` (``KeyboardInterrupt``), ``hang`` (sleeps an hour:
interruptible), ``spin`` (an hour of Python loop), ``stuck`` (an hour with SIGALRM blocked, as a C call that never
checks for signals), ``gil`` (``stuck``, holding the GIL all along: no other thread of the process runs),
``watchdog`` (``gil``, after arming the run's own ``faulthandler.dump_traceback_later`` watchdog for an hour, as
long jobs do to debug hangs: a process has one such timer, so this replaces any other), ``renamed`` (an hour
of renaming its process every 0.2 s, as a job that shows its progress with ``setproctitle``, catching every
exception: the time limit's too),
``die`` (``os._exit``), ``segv`` (SIGSEGV), ``big`` (ok, with a 256 KiB incompressible ``blob``), ``forkret``
(forks; the child returns a result instead of exiting), ``orphan`` (leaves a ``sleep`` child and a detached
daemon grandchild running, ok),
``stop`` (the run's process stops itself with SIGSTOP, never resumed), ``stopidle`` (ok, and its process
stops itself 0.2 s after the run returned: a worker stopped with no run in progress), ``slowkid`` (``slow``, with a
``sleep`` child running meanwhile; its pid goes into ``kids-X``).

When the environment variable ``KVFAST_FAULT_MARKS`` names a folder, ``slow`` runs write
``started-X`` there as they start, holding the pid of the process running them (tests wait for
it instead of sleeping a guessed time), ``orphan`` runs write the pids they leave behind
into ``orphans-X``, and ``stop`` runs add their pid to ``stop-X`` each time they run.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pyarrow as pa

from kvfast.sweep import Study

MODES = (
    "ok",
    "slow",
    "spin",
    "exit0",
    "exit3",
    "kbint",
    "hang",
    "stuck",
    "gil",
    "watchdog",
    "renamed",
    "die",
    "segv",
    "big",
    "forkret",
    "orphan",
    "stop",
    "stopidle",
    "slowkid",
)
MARKS = "KVFAST_FAULT_MARKS"


def _mark(name: str, text: str = "") -> None:
    folder = os.environ.get(MARKS)
    if folder:
        with open(os.path.join(folder, name), "a") as f:
            f.write(text)


def _orphans(x: int) -> None:
    """A ``sleep`` child, and a daemon (double fork, new session) whose parent exits at once."""
    import subprocess

    child = subprocess.Popen(["sleep", "3600"])
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.close(read)
            os.write(write, str(os.getpid()).encode())
            os.close(write)
            time.sleep(3600)
        os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    daemon = os.read(read, 64).decode()
    os.close(read)
    _mark(f"orphans-{x}", f"{child.pid} {daemon}\n")


def _forkret(x: int) -> dict:
    pid = os.fork()
    if pid == 0:
        return {"y": -1.0, "blob": "from the forked child"}
    os.waitpid(pid, 0)
    return {"y": 1.5 * x, "blob": ""}


def run(config: dict) -> dict:
    mode, x = config["mode"], config["x"]
    if mode == "slow":
        _mark(f"started-{x}", str(os.getpid()))
        time.sleep(0.3)
    elif mode == "slowkid":  # slow, with a `sleep` child running meanwhile
        import subprocess

        kid = subprocess.Popen(["sleep", "3600"])
        _mark(f"kids-{x}", f"{kid.pid}\n")
        _mark(f"started-{x}", str(os.getpid()))
        time.sleep(0.3)
    elif mode == "forkret":
        return _forkret(x)
    elif mode == "orphan":
        _orphans(x)
    elif mode == "stop":
        _mark(f"stop-{x}", f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "stopidle":
        import threading

        stopper = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGSTOP))
        stopper.daemon = True
        stopper.start()
    elif mode == "exit0":
        raise SystemExit(0)
    elif mode == "exit3":
        sys.exit(3)
    elif mode == "kbint":
        raise KeyboardInterrupt
    elif mode == "spin":
        start = time.monotonic()
        while time.monotonic() - start < 3600:
            pass
    elif mode == "hang":
        time.sleep(3600)
    elif mode == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            time.sleep(3600)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    elif mode == "renamed":
        import ctypes

        for step in range(18000):
            try:
                ctypes.CDLL(None).prctl(15, f"step {step}".encode(), 0, 0, 0)  # PR_SET_NAME
                time.sleep(0.2)
            except BaseException:  # noqa: BLE001, S110 - the point of the mode
                pass
    elif mode in ("gil", "watchdog"):
        import ctypes

        if mode == "watchdog":
            import faulthandler

            faulthandler.dump_traceback_later(3600, exit=True)

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held during the call
    elif mode == "die":
        os._exit(7)
    elif mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    blob = np.random.default_rng(x).bytes(1 << 18).hex() if mode == "big" else ""
    return {"y": 1.5 * x, "blob": blob}


def validate_config(config: dict) -> None:
    if config["mode"] not in MODES:
        raise ValueError(f"mode: {config['mode']!r} is not allowed; allowed: {', '.join(MODES)}")


STUDY = Study(
    name="faults",
    version="1",
    description="runs that misbehave on request",
    run=run,
    config_fields={"x": pa.int64(), "mode": pa.string()},
    result_fields={"y": pa.float64(), "blob": pa.string()},
    validate_config=validate_config,
    summarize=lambda df: df.groupby("mode").size().to_frame("runs").reset_index(),
    validate_groups=(),
)
