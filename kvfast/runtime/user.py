"""Calling a user's code: whatever it raises or exits with becomes one exception naming the call.

- :class:`UserCodeError`: the user's code (a model, a factory, a study module, a ``validate_config``)
  raised or exited instead of returning. ``where`` names the call, ``error`` is the original exception,
  ``str()`` is one line. :class:`kvfast.check.ModelUnderTestError` is its subclass for models under test.
- :func:`call_user`: ``fn(*args, **kwargs)`` with every ``BaseException`` it lets out (``SystemExit`` of
  any code, ``sys.exit(0)`` included, ``KeyboardInterrupt`` raised by the code itself, any other
  exception) turned into ``error`` (default :class:`UserCodeError`), chained from it; ``passthrough``
  types stay as they are. The deadline of :func:`kvfast.runtime.deadline.watched` ends the call with
  :class:`~kvfast.runtime.deadline.CheckTimeout`.
- The user's Ctrl-C: :data:`kvfast.runtime.interrupt.INTERRUPTED` tells a ``KeyboardInterrupt`` the
  user's code raises itself apart from a real Ctrl-C, which alone stays a ``KeyboardInterrupt``
  (exit 130 on the command line).
"""

from __future__ import annotations

from collections.abc import Callable

from kvfast.runtime import deadline
from kvfast.runtime.interrupt import INTERRUPTED


class UserCodeError(RuntimeError):
    """The user's code raised or exited instead of returning (see the module doc).

    ``where`` names the call (``model.decode(5)``, ``importing mypkg.study``), ``error`` is the original
    exception (also ``__cause__``); ``str()`` is one line: where, the type and the message.
    """

    def __init__(self, where: str, error: BaseException):
        self.where = where
        self.error = error
        if isinstance(error, ProcessEnded):
            super().__init__(f"{where} ended its process ({error})")
        else:
            super().__init__(f"{where} raised {describe(error)}")


class ProcessEnded(Exception):  # noqa: N818 - what the user's code did, not an error of kvfast's
    """The user's code ended its process without raising (``os._exit``, a crash, a signal): the
    ``error`` of a :class:`UserCodeError` when kvfast watched it from another process."""


def describe(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line (whitespace squeezed, at most about ``limit`` characters of message)."""
    name = type(error).__name__
    text = repr(error.code) if isinstance(error, SystemExit) else " ".join(str(error).split())  # code None: "None"
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{name}: {text}" if text else name


def call_user(
    where: str,
    fn: Callable,
    *args,
    passthrough: tuple[type[BaseException], ...] = (),
    error: type[UserCodeError] = UserCodeError,
    **kwargs,
):
    """``fn(*args, **kwargs)``: the user's code. Whatever it raises (``SystemExit``, ``KeyboardInterrupt``
    and every other exception; except ``passthrough`` types, a real Ctrl-C (:data:`INTERRUPTED`) and
    kvfast's own :class:`UserCodeError`) becomes ``error(where, exc)`` chained from it; the watched
    deadline (:func:`kvfast.runtime.deadline.watched`) becomes ``CheckTimeout`` naming ``where``."""
    try:
        return fn(*args, **kwargs)
    except deadline.Deadline:
        raise deadline.timed_out(where) from None
    except (UserCodeError, deadline.CheckTimeout):
        raise
    except passthrough:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure of the user's own code is the user's
        if isinstance(exc, KeyboardInterrupt) and INTERRUPTED.is_set():  # the user's Ctrl-C
            raise
        raise error(where, exc) from exc
