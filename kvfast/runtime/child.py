"""The user's code in a child process that this one survives: ``kvfast check``'s isolation.

:func:`run_in_child` starts ``python -c BOOT`` (the same interpreter and ``sys.path``, its own session and
process group) with its request and waits for it; the child reports back through a file. A child that ends
without a report (``os._exit``, a crash, a signal) can never read as a success; a child past its
``timeout`` (plus ``grace``, the time its own in-process timer has to report) is killed with its whole
process group, as it is on Ctrl-C and at the end in any case, so nothing the user's code started
outlives it. The child, for its part (:func:`child_started`, :func:`read_request`, :func:`child_ready`,
:func:`child_done`):

- kills its own process group when the parent dies (a watchdog thread reads a pipe the parent holds);
- reads its request once kvfast itself is imported, then writes a byte on the ready pipe: the parent's
  ``timeout`` counts from then, so a slow start of the interpreter and of kvfast on a loaded machine are
  never blamed on the user's code (the child's own timer counts from the same moment: :func:`child_ready`'s
  time);
- writes its result (a JSON object) atomically and ends with ``os._exit(0)``, so no ``atexit`` hook or
  finalizer of the user's code runs after the report;
- may send a report before its end (:func:`child_report`: ``kvfast check --repro`` sends the check's report, then
  writes the reproducers): the parent hands it to its ``on_report`` at once, and from then on gives the child
  only the seconds ``on_report`` returns (:func:`run_in_child`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from typing import NoReturn


class ChildOutcome(NamedTuple):
    """How a child ended: ``result`` (its report, ``None`` if it wrote none), its ``returncode``, and
    whether it was killed at its ``timeout`` (``timed_out``: with a ``report`` sent before, at the bound that
    followed it); ``report``: what it sent before its end (:func:`child_report`)."""

    result: dict | None
    returncode: int
    timed_out: bool = False
    report: dict | None = None  # what the child sent before its end (child_report), if it sent anything

    def ended(self) -> str:
        """How the process ended, in words (:func:`ended_text`)."""
        return ended_text(self.returncode)


def ended_text(returncode: int) -> str:
    """How a process of this ``returncode`` (``Popen``'s: a signal's negated) ended, in words (``exit status 0``,
    ``killed by signal SIGSEGV``)."""
    if returncode >= 0:
        return f"exit status {returncode}"
    with contextlib.suppress(ValueError):
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"killed by signal {-returncode}"


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (gone already: nothing), also once ``pid`` itself has ended and been
    reaped: what it started is still in the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_in_child(
    boot: str, request: dict, timeout: float | None = None, grace: float = 1.5, on_report=None
) -> ChildOutcome:
    """Run ``request`` in a child ``python -c boot BOOT_INFO`` (see the module doc) and wait for it; its
    :class:`ChildOutcome`. ``timeout``: seconds from the child's ready byte after which (plus ``grace``, the
    time the child's own timer has to report) it is killed. ``on_report``: called with the report the child
    sends before its end (:func:`child_report`) as soon as it is there (looked for every 0.1 s); it returns the
    seconds the child may run after it (``None``: no bound), and the child is killed at them instead of at
    ``timeout``. A ``KeyboardInterrupt`` here kills the child's group and is raised again; at the end the
    child's group is killed in any case (whatever the user's code left running) and its files removed.

    ``BOOT_INFO`` (JSON, the child's ``sys.argv[1]``): ``path`` (this ``sys.path``), ``result`` (the file to
    write), ``report`` (:func:`child_report`'s), ``request`` (the file :func:`read_request` reads), ``watch_fd``
    and ``ready_fd``."""
    tmp = tempfile.mkdtemp(prefix="kvfast-child-")
    files = {name: os.path.join(tmp, f"{name}.json") for name in ("result", "report", "request")}
    watch_read, watch_write = os.pipe()
    ready_read, ready_write = os.pipe()
    proc = None
    try:
        with open(files["request"], "w") as f:
            json.dump(request, f)
        boot_info = {"path": [str(p) for p in sys.path], **files, "watch_fd": watch_read, "ready_fd": ready_write}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, json.dumps(boot_info)],
                pass_fds=(watch_read, ready_write),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(watch_read)
            os.close(ready_write)
        # until the child has started kvfast: b"r" on the ready pipe, or b"" when it ended first (the child held
        # the pipe's only write end; what the user's code starts never gets it: child_ready closes it first)
        os.read(ready_read, 1)
        # the child's own timer fires at timeout from here; this one only ends code it cannot interrupt
        limit = None if timeout is None else timeout + grace
        report = None
        try:
            if on_report is not None:
                end = time.monotonic() + (float("inf") if limit is None else limit)
                while not os.path.exists(files["report"]) and proc.poll() is None:
                    if time.monotonic() >= end:
                        raise subprocess.TimeoutExpired(proc.args, limit)
                    time.sleep(0.1)
                if os.path.exists(files["report"]):
                    with open(files["report"]) as f:
                        report = json.load(f)
                    limit = on_report(report)
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            return ChildOutcome(None, proc.returncode, timed_out=True, report=report)
        try:
            with open(files["result"]) as f:
                return ChildOutcome(json.load(f), proc.returncode, report=report)
        except FileNotFoundError:
            return ChildOutcome(None, proc.returncode, report=report)
    finally:
        if proc is not None:
            kill_group(proc.pid)  # whatever the user's code left running in the child's session
            proc.wait()
        os.close(watch_write)
        os.close(ready_read)
        shutil.rmtree(tmp, ignore_errors=True)


_STARTED: dict = {}  # in a child, the boot information child_started was given (child_report reads it)


def child_started(request: dict) -> None:
    """In the child, first: kill this process group when the parent dies (a thread reads its pipe)."""
    _STARTED.update(request)

    def watchdog(fd: int) -> None:
        while os.read(fd, 1):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the parent is gone: take the user's processes along

    threading.Thread(target=watchdog, args=(request["watch_fd"],), daemon=True).start()


def read_request(boot: dict) -> dict:
    """In the child, once kvfast is imported: its request (written before it started)."""
    with open(boot["request"]) as f:
        return json.load(f)


def child_ready(request: dict) -> float:
    """In the child, once kvfast is imported and its request read: tell the parent (its timeout counts from
    now); the ``time.time()`` the child's own deadline counts from."""
    started = time.time()
    os.write(request["ready_fd"], b"r")
    os.close(request["ready_fd"])
    return started


def child_report(report: dict) -> bool:
    """In the child, before its end: send ``report`` (JSON) to the parent now, written atomically (the parent's
    ``on_report`` gets it, :func:`run_in_child`); ``False`` where this process has no place for one (not a child
    :func:`child_started` started): the caller then puts it in its result."""
    path = _STARTED.get("report")
    if path:
        write_json(path, report)
    return bool(path)


def write_json(path: str, value: object) -> None:
    """Write ``value`` (JSON) to ``path`` atomically: the parent sees all of it or no file."""
    with open(path + ".part", "w") as f:
        json.dump(value, f)
    os.replace(path + ".part", path)


def child_done(request: dict, result: dict) -> NoReturn:
    """In the child, last: write ``result`` atomically for the parent and end the process (exit 0)."""
    write_json(request["result"], result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no atexit hook or finalizer of the user's code runs after the report
