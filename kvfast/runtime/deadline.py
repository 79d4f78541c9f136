"""A deadline for the user's code in this process: :func:`watched` (a ``SIGALRM`` interval timer).

:func:`watched` runs its body as one watched call of the user's code: a call made through
:func:`kvfast.runtime.user.call_user` that outlives ``timeout`` seconds ends with :class:`CheckTimeout`
naming it, and a Ctrl-C from the user stays a ``KeyboardInterrupt`` (one the code raises itself becomes
a :class:`~kvfast.runtime.user.UserCodeError`). ``kvfast check``, ``check_cache(..., timeout=S)`` and the
``kv_check`` fixture use it. Code that never returns to the interpreter (a C call that blocks forever)
or that catches every ``BaseException`` forever cannot be stopped this way: run it in a child process
(:mod:`kvfast.runtime.child`), which can be killed. A sweep's per-run limit is
:func:`kvfast.runtime.worker.deadline` (timers, for pool workers and other threads).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from kvfast.runtime.interrupt import ctrl_c_noted
from kvfast.validation import not_allowed


class CheckTimeout(TimeoutError):
    """The check did not finish within its ``timeout``; ``where`` names what had not returned."""

    def __init__(self, seconds: float, where: str):
        self.seconds = seconds
        self.where = where
        super().__init__(f"the check did not finish within {seconds:g} s: {where} had not returned")


class Deadline(BaseException):
    """Raised by the timer's signal handler inside whatever runs; a ``BaseException`` so that the
    user's ``except Exception`` cannot swallow it (:func:`~kvfast.runtime.user.call_user` turns it
    into :class:`CheckTimeout`)."""


_watch: SimpleNamespace | None = None  # the watched call (main thread): its deadline ``seconds``, whether ``done``


def timed_out(where: str) -> CheckTimeout:
    """The :class:`CheckTimeout` for ``where`` (the watch is over: the timer stops raising)."""
    if _watch is not None:
        _watch.done = True
    return CheckTimeout(_watch.seconds if _watch else 0.0, where)


MAX_TIMEOUT = 1e9
"""The longest ``timeout`` (seconds, about 31 years): the interval timer takes at most about 9.2e9 (its
nanoseconds must fit in 64 bits; above, ``signal.setitimer`` raises ``OverflowError``)."""


def check_timeout(timeout: object, field: str = "timeout") -> float | None:
    """``timeout`` validated: ``None`` or a number of seconds in ``(0, MAX_TIMEOUT]`` (``ValueError`` naming the
    ``field`` and the range)."""
    if timeout is None:
        return None
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout <= MAX_TIMEOUT):
        raise not_allowed(field, timeout, f"None or a number of seconds > 0 and <= {MAX_TIMEOUT:.0e}")
    return float(timeout)


@contextmanager
def watched(timeout: float | None, started: float | None = None) -> Iterator[None]:
    """Run the body as one watched call of the user's code (see the module doc).

    The deadline is a ``SIGALRM`` interval timer (it re-fires every 0.25 s until a guarded call sees it, so
    code that catches it once does not outlive it), so it needs the main thread; no thread or process is
    started. Nested calls (the logic check's inner check) share the outer watch. Previous handlers and a
    pending timer (e.g. pytest-timeout's) are restored afterwards. ``started``: a ``time.time()`` the
    deadline counts from (default now; ``kvfast check``'s child process counts from the end of kvfast's
    own start-up). ``ValueError`` for a bad ``timeout``, or one outside the main thread (on entering).
    Without a ``timeout`` (a sweep's runs, ``check_cache`` without one) the watch sets no timer: outermost in the
    main thread it notes the user's Ctrl-C (:func:`~kvfast.runtime.interrupt.ctrl_c_noted`) and sets the watch
    for guarded calls; nested, or in another thread, it does nothing.
    """
    global _watch
    timeout = check_timeout(timeout)
    main = threading.current_thread() is threading.main_thread()
    if (_watch is not None and main) or (timeout is None and not main):
        yield
        return
    if not main:
        raise not_allowed("timeout", timeout, "None outside the main thread (the deadline is a SIGALRM timer)")
    if timeout is not None and not hasattr(signal, "setitimer"):
        raise not_allowed("timeout", timeout, "None on this platform (it has no signal.setitimer)")
    watch = SimpleNamespace(seconds=timeout, done=False)
    with ctrl_c_noted():

        def on_alarm(signum, frame):
            if not watch.done:
                raise Deadline

        if timeout is not None:
            old_alarm = signal.signal(signal.SIGALRM, on_alarm)
            first = timeout if started is None else max(timeout - (time.time() - started), 1e-3)
            old_timer = signal.setitimer(signal.ITIMER_REAL, first, 0.25)
            started = time.monotonic()
        _watch = watch
        try:
            yield
        except Deadline:
            watch.done = True
            raise CheckTimeout(timeout or 0.0, "kvfast's comparison between model calls") from None
        finally:
            watch.done = True
            _watch = None
            if timeout is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old_alarm)
                if old_timer[0] > 0:  # someone else's pending timer: give back what is left of it
                    left = max(old_timer[0] - (time.monotonic() - started), 1e-3)
                    signal.setitimer(signal.ITIMER_REAL, left, old_timer[1])
