"""The user's code in a child process that this one survives: ``kvfast check``'s isolation.

:func:`run_in_child` starts ``python -c BOOT REQUEST.json`` (the same interpreter and ``sys.path``, its
own session and process group) and waits for it; the child reports back through a file. A child that
ends without a report (``os._exit``, a crash, a signal) can never read as a success; a child past its
``timeout`` (plus ``grace``, the time its own in-process timer has to report) is killed with its whole
process group, as it is on Ctrl-C and at the end in any case, so nothing the user's code started
outlives it. The child, for its part (:func:`child_started`, :func:`child_ready`, :func:`child_done`):

- kills its own process group when the parent dies (a watchdog thread reads a pipe the parent holds);
- writes a byte on the ready pipe once kvfast itself is imported: the parent's ``timeout`` counts from
  then, so a slow start of the interpreter and of kvfast on a loaded machine is never blamed on the
  user's code (the child's own timer counts from the same moment: :func:`child_ready`'s time);
- writes its result (a JSON object) atomically and ends with ``os._exit(0)``, so no ``atexit`` hook or
  finalizer of the user's code runs after the report.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class ChildOutcome:
    """How a child ended: ``result`` (its report, ``None`` if it wrote none), its ``returncode``, and
    whether it was killed at its ``timeout`` (``timed_out``)."""

    result: dict | None
    returncode: int
    timed_out: bool = False

    def ended(self) -> str:
        """How the process ended, in words (``exit status 0``, ``killed by signal SIGSEGV``)."""
        code = self.returncode
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (gone already: nothing)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_until_ready(proc: subprocess.Popen, ready_fd: int) -> None:
    """Until the child has started kvfast (it writes a byte on ``ready_fd``) or has ended."""
    while proc.poll() is None:
        readable, _, _ = select.select([ready_fd], [], [], 0.2)
        if readable:
            os.read(ready_fd, 1)  # b"r", or b"" when the child ended first: either way, stop waiting
            return


def run_in_child(boot: str, request: dict, timeout: float | None = None, grace: float = 1.5) -> ChildOutcome:
    """Run ``python -c boot REQUEST`` (see the module doc) and wait for it; its :class:`ChildOutcome`.

    ``request`` (JSON) reaches the child with ``path`` (this ``sys.path``), ``result`` (the file to
    write), ``watch_fd`` and ``ready_fd`` added. ``timeout``: seconds from the child's ready byte after
    which (plus ``grace``) it is killed. A ``KeyboardInterrupt`` here kills the child's group and is
    raised again.
    """
    with tempfile.TemporaryDirectory(prefix="kvfast-child-") as tmp:
        watch_read, watch_write = os.pipe()
        ready_read, ready_write = os.pipe()
        request = {
            **request,
            "path": [str(p) for p in sys.path],
            "result": os.path.join(tmp, "result.json"),
            "watch_fd": watch_read,
            "ready_fd": ready_write,
        }
        with open(os.path.join(tmp, "request.json"), "w") as f:
            json.dump(request, f)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, os.path.join(tmp, "request.json")],
                pass_fds=(watch_read, ready_write),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(watch_read)
            os.close(ready_write)
        try:
            _wait_until_ready(proc, ready_read)
            # the child's own timer fires at timeout from here; this one only ends code it cannot interrupt
            proc.wait(timeout=None if timeout is None else timeout + grace)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            return ChildOutcome(None, proc.returncode, timed_out=True)
        except KeyboardInterrupt:
            kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            kill_group(proc.pid)  # whatever the user's code left running in the child's session
            os.close(watch_write)
            os.close(ready_read)
        try:
            with open(request["result"]) as f:
                return ChildOutcome(json.load(f), proc.returncode)
        except FileNotFoundError:
            return ChildOutcome(None, proc.returncode)


def child_started(request: dict) -> None:
    """In the child, first: kill this process group when the parent dies (a thread reads its pipe)."""

    def watchdog(fd: int) -> None:
        while os.read(fd, 1):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the parent is gone: take the user's processes along

    threading.Thread(target=watchdog, args=(request["watch_fd"],), daemon=True).start()


def child_ready(request: dict) -> float:
    """In the child, once kvfast is imported: tell the parent (its timeout counts from now); the
    ``time.time()`` the child's own deadline counts from."""
    started = time.time()
    os.write(request["ready_fd"], b"r")
    os.close(request["ready_fd"])
    return started


def child_done(request: dict, result: dict) -> NoReturn:
    """In the child, last: write ``result`` atomically for the parent and end the process (exit 0)."""
    part = request["result"] + ".part"
    with open(part, "w") as f:
        json.dump(result, f)
    os.replace(part, request["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no atexit hook or finalizer of the user's code runs after the report
