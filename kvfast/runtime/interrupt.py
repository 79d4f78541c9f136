"""The user's Ctrl-C, told apart from a ``KeyboardInterrupt`` that the user's code raises itself.

:data:`INTERRUPTED` is set by :func:`on_sigint`, the SIGINT handler that the command line, a watched
check (:func:`ctrl_c_noted`) and a sweep install; :func:`kvfast.runtime.user.call_user` lets a
``KeyboardInterrupt`` through only when it is set.
"""

from __future__ import annotations

# _signal: the C functions under signal.signal / signal.getsignal, the same calls without the wrappers' enum
# conversions (each wrapper call tries Handlers(value), which raises and catches a ValueError for a Python
# handler: about 5 us, three times per watched check)
import _signal
import signal
import threading

INTERRUPTED = threading.Event()


def on_sigint(signum, frame) -> None:
    """A SIGINT handler: note the user's Ctrl-C in :data:`INTERRUPTED`, then interrupt as Python does."""
    INTERRUPTED.set()
    raise KeyboardInterrupt


class ctrl_c_noted:  # noqa: N801 - a context manager used as a function: ``with ctrl_c_noted():``
    """Run the body with :func:`on_sigint` as the SIGINT handler when Python's default one is installed
    (main thread only; restored afterwards; :data:`INTERRUPTED` cleared first). Any other handler
    (a sweep's, a test runner's) is left alone. (A class: every check enters one, issue 46.)"""

    __slots__ = ("noted",)

    def __enter__(self) -> None:
        noted = self.noted = (
            threading.current_thread() is threading.main_thread()
            and _signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if noted:
            if INTERRUPTED.is_set():  # (a read: clearing takes the event's lock)
                INTERRUPTED.clear()
            _signal.signal(signal.SIGINT, on_sigint)

    def __exit__(self, kind, error, tb) -> None:
        if self.noted:
            _signal.signal(signal.SIGINT, signal.default_int_handler)
