"""Loading a user's object named ``package.module:ATTR``: one set of rules and messages for every caller.

Used for a grid's ``study``, the ``check`` study's ``factory`` and ``kvfast check``'s factory.

Rules (:func:`load_object`):

- ``ref`` is ``"package.module:ATTR"`` (``ATTR`` may be dotted: ``module:Class.method``) or, where the
  caller passes ``entry_points`` (e.g. :func:`entry_points_of` a group), the name of one of them;
- the working directory is put first on ``sys.path`` (if it is not there yet), as ``python -m`` does, so
  a module next to the user's grid or shell is found;
- the module is imported through :func:`kvfast.runtime.user.call_user`: an ``ImportError`` (the module or
  one of its imports is missing) is bad input, a ``ValueError``; anything else the import raises or
  exits with (``SystemExit`` of any code, ``KeyboardInterrupt`` from the module, any exception) is the
  caller's ``error`` (:class:`~kvfast.runtime.user.UserCodeError`) naming ``importing MODULE``;
- with :func:`probing_imports` on (the command line turns it on), a module not imported yet is first
  imported in a forked probe process, so that ``os._exit`` (or a crash) at import ends the probe, not
  kvfast: it is then ``error`` with :class:`~kvfast.runtime.user.ProcessEnded`. The probe costs a fork and the
  module's import once more (its import-time side effects run twice; its output in the probe is discarded);
  kvfast's own modules (``kvfast.studies...``) are not user code and are never probed. Why a probe and not the
  child-process runner (:mod:`kvfast.runtime.child`): a sweep's process is the one that forks its workers,
  holds the results directory's lock and handles Ctrl-C, so moving all of it into a child would change what
  every other fault test pins down; the probe guards exactly the step that can end the process before any of
  that starts.
- a missing attribute, or an object ``accept`` refuses, is a ``ValueError`` ending in
  ``allowed: ALLOWED``.

Messages (``FIELD`` is the caller's name for the reference, e.g. ``study`` or ``factory``)::

    FIELD: 'REF' is not allowed; allowed: FORM
    FIELD: 'REF' cannot be imported: its module 'MODULE' cannot be imported (ModuleNotFoundError: ...)
    FIELD: 'REF' cannot be found: 'MODULE' has no attribute 'ATTR'; allowed: ALLOWED
    FIELD: 'REF' is TYPE, not allowed; allowed: ALLOWED
    FIELD: 'REF' (entry point VALUE) cannot be loaded (TYPE: ...)
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from kvfast.runtime.child import ended_text
from kvfast.runtime.user import ProcessEnded, UserCodeError, call_user, describe
from kvfast.validation import shown

_PROBE: list[bool] = [False]


@contextmanager
def probing_imports(on: bool = True) -> Iterator[None]:
    """Within the body, :func:`load_object` imports a user's module in a forked probe first (see the
    module doc); restored afterwards. Only where ``os.fork`` exists, and only from the main thread."""
    before = _PROBE[0]
    _PROBE[0] = on
    try:
        yield
    finally:
        _PROBE[0] = before


def split_ref(ref: object, field: str, form: str = "package.module:NAME") -> tuple[str, str]:
    """``(module, attr)`` of ``"module:attr"``; ``ValueError`` (``FIELD: 'REF' is not allowed; allowed: FORM``)."""
    module, _, attr = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not module or not attr or ":" in attr:  # exactly one ':', something on either side
        raise ValueError(f"{field}: {shown(ref)} is not allowed; allowed: {form}")
    return module, attr


def working_dir_on_path() -> None:
    """Put the working directory first on ``sys.path`` unless it is already there (as ``python -m`` does);
    ``ValueError`` when it no longer exists (deleted while the shell was in it)."""
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        raise ValueError(
            f"working directory: {os.environ.get('PWD', '?')!r} no longer exists (deleted); "
            "allowed: an existing directory (cd to one and run again)"
        ) from None
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def import_user_module(module: str, field: str, ref: str, error: type[UserCodeError] = UserCodeError):
    """``module`` imported by the rules of the module doc (``ValueError`` or ``error``)."""
    working_dir_on_path()
    # kvfast's own modules are not user code, never probed (the studies' import, 1.4 s, would otherwise run twice)
    if _PROBE[0] and module not in sys.modules and module != "kvfast" and not module.startswith("kvfast."):
        ended = probe_import(module)
        if ended is not None:
            raise error(f"importing {module}", ended)
    try:
        where = f"importing {module}"
        return call_user(where, importlib.import_module, module, passthrough=(ImportError,), error=error)
    except ImportError as exc:
        raise ValueError(
            f"{field}: {shown(ref)} cannot be imported: its module {module!r} cannot be imported ({describe(exc)})"
        ) from None


def probe_import(module: str) -> ProcessEnded | None:
    """Import ``module`` in a forked child (output discarded); :class:`ProcessEnded` if the import ended
    that process (``os._exit``, a crash, a signal), ``None`` if it returned or raised (the real import
    says which), or where there is no fork to probe with (not the main thread, no ``os.fork``)."""
    if not hasattr(os, "fork") or threading.current_thread() is not threading.main_thread():
        return None
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a fork with threads: the probe only imports
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the probe (its coverage is lost with os._exit)
        try:
            os.close(read)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            with suppress(BaseException):  # returned or raised: the parent's own import tells which
                importlib.import_module(module)
            os.write(write, b"ok")
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 2)  # b"ok" (one write, under PIPE_BUF: read whole), or b"" once the probe ended
        _, status = os.waitpid(pid, 0)
    except BaseException:
        with suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read)
    if answer == b"ok":
        return None
    return ProcessEnded(f"{ended_text(os.waitstatus_to_exitcode(status))}: os._exit, a crash or a signal at import")


def load_object(
    ref: object,
    field: str,
    *,
    accept: Callable[[object], bool],
    allowed: str,
    form: str = "package.module:NAME",
    entry_points: Callable[[], dict] | None = None,
    error: type[UserCodeError] = UserCodeError,
):
    """The object ``ref`` names, by the rules and with the messages of the module doc.

    ``field``: what the messages call it; ``accept(obj)``: whether the object is what the caller wants
    (``allowed`` says what that is, in words); ``form``: the reference's form, in words;
    ``entry_points``: a function returning ``{name: entry point}`` (:func:`entry_points_of`) whose names
    are also accepted. ``ValueError`` for bad input; ``error`` (a
    :class:`~kvfast.runtime.user.UserCodeError`) when the user's module raises or exits at import.
    """
    # a name without ':' is an entry point's, if it is one (else split_ref refuses it, as it does any other form)
    ep = entry_points().get(ref) if isinstance(ref, str) and ":" not in ref and entry_points is not None else None
    if ep is not None:
        working_dir_on_path()
        try:
            obj = call_user(f"loading entry point {ep.value}", ep.load, passthrough=(ImportError,), error=error)
        except ImportError as exc:
            raise ValueError(
                f"{field}: {shown(ref)} (entry point {ep.value}) cannot be loaded ({describe(exc)})"
            ) from None
    else:
        module_name, attr = split_ref(ref, field, form)
        obj = import_user_module(module_name, field, ref, error)
        owner = module_name
        for part in attr.split("."):
            try:
                obj = call_user(f"{module_name}.{attr}", getattr, obj, part, passthrough=(AttributeError,), error=error)
            except AttributeError:
                raise ValueError(
                    f"{field}: {shown(ref)} cannot be found: {owner!r} has no attribute {part!r}; allowed: {allowed}"
                ) from None
            owner = part
    if not accept(obj):
        raise ValueError(f"{field}: {shown(ref)} is {type(obj).__name__}, not allowed; allowed: {allowed}")
    return obj


def entry_points_of(group: str) -> dict:
    """The installed entry points of ``group``, by name."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}
