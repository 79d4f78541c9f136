"""What guards a run of the user's code and a worker process: time limits, the parent's death, Ctrl-C.

(The sweep's runs use it.)

- :func:`worker_start` (a pool worker's initializer, and the first thing every
  task calls): on Linux the kernel kills the worker when the process that
  started it dies (``PR_SET_PDEATHSIG``), checked against the parent's pid so
  that a parent killed before the call is caught too; elsewhere a thread polls
  the parent once a second. Workers ignore SIGINT: Ctrl-C is the sweep
  process's to handle (it stops the workers), so no worker prints a traceback.
- :func:`deadline`: a run's time limit. At the limit the run is interrupted
  with :class:`RunTimeout` (in the main thread by ``SIGALRM``, which also
  interrupts ``sleep`` and blocking calls; in another thread asynchronously,
  which only interrupts Python code). If the run has not returned ``grace``
  seconds later (a Numba kernel or C call that never checks for signals), a
  worker process writes the run's id into the marker folder and exits: the
  sweep process sees the dead worker, finds the marker and stores a
  ``timeout`` row; the pool starts a new worker. The sweep process itself (one
  job, or the threading backend) is never killed: there a run stuck in C code
  runs on until it returns. A run in a pool worker's main thread also arms
  ``faulthandler.dump_traceback_later(exit=True)`` one second after that: a C thread that needs
  no GIL ends the worker even when the run's C code holds the GIL (the watchdog thread cannot
  run then); the sweep sees the dead worker and re-runs the run alone, under its own watch.
- :data:`INTERRUPTED` (:mod:`kvfast.runtime.interrupt`'s): set by the sweep process's
  SIGINT handler :func:`on_sigint`, so that a ``KeyboardInterrupt`` raised by a
  run's own code (an ``error`` row) is told apart from the user's Ctrl-C (which
  stops the sweep).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfast.runtime.interrupt import INTERRUPTED, on_sigint

__all__ = ["INTERRUPTED", "RunTimeout", "deadline", "grace", "on_sigint", "prctl", "worker_start"]

_STARTED: list[int] = []
_LIBC: list = []
_DEVNULL: list = []  # where the faulthandler backstop writes its (unwanted) traceback


class RunTimeout(BaseException):  # noqa: N818 - a BaseException, so that a run's `except Exception` cannot hide it
    """Raised inside a run that passed its time limit."""


def prctl(option: int, value) -> int:
    """Linux ``prctl(option, value)`` through libc; -1 where there is none."""
    try:
        if not _LIBC:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        return _LIBC[0].prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return -1


def grace(seconds: float) -> float:
    """How long a run past its time limit of ``seconds`` may take to return before its worker ends."""
    return min(30.0, 1.0 + 0.25 * seconds)


def worker_start(parent: int | None = None) -> None:
    """Set up a pool worker (idempotent): die with the parent, ignore SIGINT."""
    if _STARTED:
        return
    _STARTED.append(os.getpid())
    INTERRUPTED.clear()
    faulthandler.disable()  # a crashing run is one line in the sweep's report, not a dump per worker
    parent = parent or os.getppid()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="kvfast-watch-parent", daemon=True).start()


class _Watchdog:
    """One thread per process that fires the deadlines of the runs in progress."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.runs: dict[int, list] = {}  # token -> [thread ident, deadline, hard deadline, run id, marker dir, fired]
        self.token = 0
        self.thread: threading.Thread | None = None

    def arm(self, seconds: float, run_id: str, marker_dir: Path | None, hard: bool) -> int:
        now = time.monotonic()
        with self.cond:
            self.token += 1
            hard_at = now + seconds + grace(seconds) if hard else float("inf")
            self.runs[self.token] = [threading.get_ident(), now + seconds, hard_at, run_id, marker_dir, False]
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self.loop, name="kvfast-run-timeout", daemon=True)
                self.thread.start()
            self.cond.notify()
            return self.token

    def disarm(self, token: int) -> None:
        with self.cond:
            self.runs.pop(token, None)

    def active(self, ident: int) -> bool:
        with self.cond:
            return any(r[0] == ident for r in self.runs.values())

    def loop(self) -> None:
        while True:
            with self.cond:
                now = time.monotonic()
                wake = now + 60.0
                for entry in self.runs.values():
                    ident, soft_at, hard_at, run_id, marker_dir, fired = entry
                    if not fired and now >= soft_at:
                        entry[5] = True
                        _interrupt(ident)
                    elif now >= hard_at:
                        if marker_dir is not None:
                            try:
                                marker_dir.mkdir(exist_ok=True)
                                (marker_dir / run_id).write_text(str(os.getpid()))
                            except OSError:
                                pass
                        os._exit(3)
                    wake = min(wake, hard_at if entry[5] else soft_at)
                self.cond.wait(max(0.01, wake - now))


_WATCHDOG = _Watchdog()


def _after_fork_in_child() -> None:
    # a forked worker has none of the parent's threads, but a copy of its locks, maybe held: start afresh
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_alarm(signum, frame) -> None:
    if _WATCHDOG.active(threading.get_ident()):
        raise RunTimeout


def _interrupt(ident: int) -> None:
    if ident == threading.main_thread().ident:
        signal.pthread_kill(ident, signal.SIGALRM)
    else:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(RunTimeout))


@contextmanager
def deadline(seconds: float | None, run_id: str, marker_dir: Path | None) -> Iterator[None]:
    """Interrupt the block with :class:`RunTimeout` after ``seconds`` (``None``: no limit); see the module doc."""
    if not seconds:
        yield
        return
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGALRM, _on_alarm)
    hard = bool(_STARTED) and _STARTED[0] == os.getpid()  # only a pool worker may kill itself
    token = _WATCHDOG.arm(seconds, run_id, marker_dir, hard)
    backstop = hard and threading.current_thread() is threading.main_thread()  # one run at a time
    if backstop:
        _DEVNULL[:] = _DEVNULL or [open(os.devnull, "w")]  # noqa: SIM115 - kept open for faulthandler
        faulthandler.dump_traceback_later(seconds + grace(seconds) + 1.0, exit=True, file=_DEVNULL[0])
    try:
        yield
    finally:
        if backstop:
            faulthandler.cancel_dump_traceback_later()
        _WATCHDOG.disarm(token)
        if previous is not None:
            signal.signal(signal.SIGALRM, previous)
