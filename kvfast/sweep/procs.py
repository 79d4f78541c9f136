"""Pool workers' processes: their process trees, and the sweep process's watch over them.

Worker side (Linux; elsewhere these are no-ops):

- :func:`worker_setup` (a pool worker's initializer): :func:`kvfast.runtime.worker.worker_start`,
  then the worker leads its own process group (so a run's children, which inherit
  the group, are ended with it by one ``killpg``) and becomes a child subreaper
  (so a run's grandchildren whose parent exits, daemons included, are re-parented
  to the worker instead of init, and are found); a keeper process in its group
  kills the group when the worker dies, however it dies (``kill -9`` of the sweep too).
- :func:`end_new_children`: after each run, every process the run left behind
  (children not there before the run, and all their descendants) is killed.
- :class:`Beats`: a worker writes what it is doing (the run it started, when;
  or idle) into one small file per worker under the sweep's heartbeat folder
  (``DIR/.workers/TOKEN/PID``, a folder per sweep), one ``pwrite`` per run start and end.

Sweep side:

- :class:`Monitor`: a thread of the sweep process, running while a pool backend
  works (its warm-up, while the pool starts, included). Twice a second it reads the
  heartbeat files and the state of every child process of the sweep. A worker whose run is
  past ``--run-timeout`` plus the worker's own grace period and one second more
  (it did not kill itself: it is stopped, ``SIGSTOP``, or wedged in C code that
  holds the GIL) gets its run's timeout marker written and its process group
  killed: the pool sees a dead worker and the run is stored as ``timeout``
  (:mod:`kvfast.sweep.rows`). A child stopped (state ``T``), whatever it was doing (a run,
  nothing, starting up), is killed once stopped for ``--run-timeout`` (``stall_s`` without
  one): with a marker if its heartbeat names a run past its time limit (``timeout``),
  else without (its runs are re-run alone, per the crash rules: ``crashed`` when it stops
  again). When the pool is done, a child still stopped is killed at once (nothing waits
  for it any more). Only the sweep's own child processes are ever killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from kvfast.runtime.worker import worker_start

LINUX = sys.platform.startswith("linux")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_WORKER: list[int] = []  # [pid] once this process is set up as a pool worker
_KEEPER: list[int] = []  # [pid] of the worker's keeper (see worker_setup)


def in_worker() -> bool:
    """True in a pool worker set up by :func:`worker_setup` (not in a process it forked)."""
    return bool(_WORKER) and _WORKER[0] == os.getpid()


def worker_setup(parent: int | None = None) -> None:
    """A pool worker's initializer (idempotent): :func:`worker_start`, its own process group, a subreaper."""
    worker_start(parent)
    if in_worker():
        return
    _WORKER[:] = [os.getpid()]
    if not LINUX:
        return
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may still write to the terminal
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _start_keeper()


def _start_keeper() -> None:
    """Fork the worker's keeper: a process of its group that kills the group when the worker dies.

    However the worker dies (killed by the sweep, a crash, or by the kernel because
    the sweep was killed with ``kill -9``), the kernel sends the keeper SIGTERM
    (``PR_SET_PDEATHSIG``) and it kills the whole group: what the worker's runs left
    running dies with the worker. The keeper runs no kvfast code after the fork.
    """
    worker = os.getpid()
    if os.getpgid(0) != worker:  # not the leader of its own group: the group is not the worker's to kill
        return
    try:
        pid = os.fork()
    except OSError:
        return
    if pid:
        _KEEPER[:] = [pid]
        return
    try:
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != worker:  # the worker died before the line above
            os.killpg(0, signal.SIGKILL)
        while True:
            signal.pause()
    finally:
        os._exit(0)


_LIBC: list = []


def _prctl(option: int, value) -> int:
    try:
        if not _LIBC:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        return _LIBC[0].prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return -1


class RunTree:
    """The processes one run starts, ended when it ends (:meth:`end`), outside a pool worker too.

    ``reap`` false: nothing is done. In a process that is not a pool worker (``--jobs 1``,
    the warm-up), this process is a child subreaper for the run's duration only
    (as it was before, after it), so that the run's detached grandchildren are found.
    """

    def __init__(self, reap: bool) -> None:
        self.reap = reap and LINUX
        self.before = _run_children() if self.reap and not in_worker() else set(_KEEPER)  # a worker's own: its keeper
        self.was: int | None = None
        if self.reap and not in_worker():
            flag = ctypes.c_int(0)
            _prctl(PR_SET_CHILD_SUBREAPER + 1, ctypes.byref(flag))  # PR_GET_CHILD_SUBREAPER
            self.was = flag.value
            _prctl(PR_SET_CHILD_SUBREAPER, 1)

    def end(self) -> None:
        """Kill what the run left running (see :func:`end_new_children`)."""
        if not self.reap:
            return
        end_new_children(self.before)
        if self.was is not None:
            _prctl(PR_SET_CHILD_SUBREAPER, self.was)


_LISTS: dict[tuple[int, int], int] = {}  # (pid, thread id) -> open fd of its children list, read with pread


def _run_children() -> set[int]:
    """This process's children listed under its main thread and the calling thread (where a run's are).

    The two lists stay open and are re-read with one ``pread`` each (a microsecond; opening
    them anew costs fifty times that on a loaded machine)."""
    pid = os.getpid()
    found: set[int] = set()
    for task in {pid, threading.get_native_id()}:
        fd = _LISTS.get((pid, task))
        try:
            if fd is None:
                fd = _LISTS[(pid, task)] = os.open(f"/proc/{pid}/task/{task}/children", os.O_RDONLY)
            found.update(int(p) for p in os.pread(fd, 1 << 16, 0).split())
        except OSError:
            _LISTS.pop((pid, task), None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            found.update(p.pid for p in _process().children())  # (psutil: every thread's list)
    return found


def _process(pid: int | None = None):
    """``psutil.Process(pid)`` (this process by default): process trees and states, read by psutil."""
    import psutil

    return psutil.Process(pid)


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every live descendant of them (psutil)."""
    import psutil

    found = set(roots)
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            found.update(p.pid for p in _process(pid).children(recursive=True))
    return found


def end_new_children(before: set[int]) -> None:
    """Kill every child of this process not in ``before``, with all its descendants, and reap them.

    In a worker (a subreaper) the orphans that killing re-parents here are found
    and killed too, until none is left (a few rounds at most). Only the main thread's
    and the calling thread's children are looked at (one or two reads a run): a child
    forked by another thread the run left running is not, but it is in the worker's
    process group, which the worker's keeper kills when the worker ends.
    """
    for _ in range(8):
        new = _run_children() - before
        if not new:
            return
        for pid in _descendants(new):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in new:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


class Beats:
    """A worker's heartbeat file ``FOLDER/PID``: ``"RUN_ID STARTED"`` while a run runs, ``"-"`` when idle."""

    _files: dict[int, tuple[str, int]] = {}  # pid -> (folder, open fd); a forked worker opens its own

    @classmethod
    def write(cls, folder: Path | None, text: str) -> None:
        """Write ``text`` into this worker's file (opened anew when the folder changed: every sweep has
        its own, and a reused loky worker serves the next sweep too)."""
        if folder is None or not in_worker():
            return
        pid = os.getpid()
        try:
            where, fd = cls._files.get(pid, ("", -1))
            if where != str(folder) or fd < 0:
                if fd >= 0:
                    os.close(fd)
                Path(folder).mkdir(parents=True, exist_ok=True)
                fd = os.open(Path(folder) / str(pid), os.O_WRONLY | os.O_CREAT, 0o644)
                cls._files[pid] = (str(folder), fd)
            os.pwrite(fd, text.ljust(64).encode(), 0)
        except OSError:
            pass


def run_started(folder: Path | None, run_id: str) -> None:
    """Record in the heartbeat file that ``run_id`` started now (``time.monotonic``, the same in every process)."""
    Beats.write(folder, f"{run_id} {time.monotonic():.3f}")


def run_ended(folder: Path | None) -> None:
    """Record in the heartbeat file that no run is running."""
    Beats.write(folder, "-")


def _scandir(folder: Path | None) -> list[os.DirEntry]:
    """The entries of the heartbeat folder (none before a worker made it)."""
    try:
        return list(os.scandir(folder)) if folder is not None else []
    except OSError:
        return []


def kill_worker(pid: int) -> None:
    """SIGKILL a worker's process group (itself and its runs' processes) if it leads one, else the worker."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


class Monitor:
    """The sweep process's watch over its pool workers (see the module docstring); a context manager."""

    def __init__(self, folder: Path | None, seconds: float | None, markers: Path | None, stall_s: float) -> None:
        self.folder, self.seconds, self.markers, self.stall_s = folder, seconds, markers, stall_s
        self.stop = threading.Event()
        self.stopped_since: dict[int, float] = {}
        self.killed: list[tuple[int, str]] = []  # (pid, run id or "")
        self.thread = threading.Thread(target=self.loop, name="kvfast-monitor", daemon=True)

    def __enter__(self) -> Monitor:
        if self.folder is not None and LINUX:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        if self.folder is not None:
            with contextlib.suppress(OSError):
                self.check(time.monotonic(), final=True)  # end what dead workers left, and stopped ones
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                Path(self.folder).parent.rmdir()  # DIR/.workers, when no other sweep's folder is left

    def loop(self) -> None:
        while not self.stop.wait(0.5):
            with contextlib.suppress(OSError):
                self.check(time.monotonic())

    def limit(self) -> float | None:
        """Seconds after a run's start at which its worker is killed: the limit, the worker's grace, 1 s."""
        if not self.seconds:
            return None
        return self.seconds + min(30.0, 1.0 + 0.25 * self.seconds) + 1.0

    def stop_limit(self) -> float:
        """Seconds a child may stay stopped: the run time limit, else ``stall_s``."""
        return min(self.stall_s, self.seconds) if self.seconds else self.stall_s

    def check(self, now: float, final: bool = False) -> None:
        """One look at every child and heartbeat; kill the overdue and the long-stopped ones (``final``: every
        stopped one)."""
        import psutil

        kids = {p.pid: p for p in _process().children()}
        mine, limit = set(kids), self.limit()
        beats: dict[int, tuple[str, float]] = {}
        for entry in _scandir(self.folder):
            pid = int(entry.name) if entry.name.isdigit() else 0
            if pid <= 1 or pid == os.getpid():
                continue
            if pid not in mine:  # a worker of this sweep is gone: end what its runs left in its process group
                if not psutil.pid_exists(pid):  # (its pid not taken by a process that is not ours)
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                Path(entry.path).unlink(missing_ok=True)
                continue
            words = Path(entry.path).read_text().split()
            try:
                beats[pid] = (words[0], float(words[1])) if len(words) == 2 else ("", now)
            except ValueError:  # read while being written: look again next time
                beats[pid] = ("", now)
        for pid, proc in kids.items():
            try:
                stopped = proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
            except psutil.Error:  # gone meanwhile
                self.stopped_since.pop(pid, None)
                continue
            run_id, started = beats.get(pid, ("", now))
            if limit is not None and run_id and now - started > limit:
                self.kill(pid, run_id)
            elif stopped:
                since = self.stopped_since.setdefault(pid, now)
                if final or now - since > self.stop_limit():
                    overdue = bool(run_id and self.seconds and now - started > self.seconds)
                    self.kill(pid, run_id if overdue else "")
            else:
                self.stopped_since.pop(pid, None)

    def kill(self, pid: int, run_id: str) -> None:
        """Kill worker ``pid``; with ``run_id``, first leave the run's timeout marker."""
        if run_id and self.markers is not None:
            with contextlib.suppress(OSError):
                Path(self.markers).mkdir(exist_ok=True)
                (Path(self.markers) / run_id).write_text(str(pid))
        kill_worker(pid)
        self.killed.append((pid, run_id))
        self.stopped_since.pop(pid, None)
        with contextlib.suppress(OSError):
            (Path(self.folder) / str(pid)).unlink()
