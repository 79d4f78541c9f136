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
from collections.abc import Iterator
from contextlib import contextmanager

INTERRUPTED = threading.Event()


def on_sigint(signum, frame) -> None:
    """A SIGINT handler: note the user's Ctrl-C in :data:`INTERRUPTED`, then interrupt as Python does."""
    INTERRUPTED.set()
    raise KeyboardInterrupt


@contextmanager
def ctrl_c_noted() -> Iterator[None]:
    """Run the body with :func:`on_sigint` as the SIGINT handler when Python's default one is installed
    (main thread only; restored afterwards; :data:`INTERRUPTED` cleared first). Any other handler
    (a sweep's, a test runner's) is left alone."""
    noted = threading.current_thread() is threading.main_thread()
    noted = noted and _signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if noted:
        INTERRUPTED.clear()
        _signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if noted:
            _signal.signal(signal.SIGINT, signal.default_int_handler)
