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
    noted = threading.current_thread() is threading.main_thread() and note_ctrl_c()
    try:
        yield
    finally:
        if noted:
            unnote_ctrl_c()


def note_ctrl_c() -> bool:
    """:func:`ctrl_c_noted`'s start, called in the main thread: install :func:`on_sigint` (clearing
    :data:`INTERRUPTED`) and return ``True`` when Python's default SIGINT handler is installed, else ``False``
    (nothing changed). After ``True``, :func:`unnote_ctrl_c` puts the default handler back."""
    if _signal.getsignal(_SIGINT) is not _DEFAULT:
        return False
    INTERRUPTED.clear()
    _signal.signal(_SIGINT, on_sigint)
    return True


def unnote_ctrl_c() -> None:
    """:func:`ctrl_c_noted`'s end after :func:`note_ctrl_c` returned ``True``: Python's default handler back."""
    _signal.signal(_SIGINT, _DEFAULT)


_SIGINT = int(signal.SIGINT)
_DEFAULT = signal.default_int_handler
