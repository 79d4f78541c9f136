"""The ``kvfast`` command line.

Each subcommand lives in a module of :mod:`kvfast.commands` that defines
``add_parser(subparsers)`` (which sets ``func`` on its parser) and a handler
``func(args) -> int``. Bad input, or the user's code (a study's module, its
``validate_config``) raising or exiting, is a one-line message and exit code 2;
the user's modules are imported through :mod:`kvfast.runtime` (a forked probe
first, so that ``os._exit`` at import is one line too); a Ctrl-C is exit 130,
one line. An unexpected error (a bug in kvfast) prints its traceback, the kvfast version and
a line saying it is a bug in kvfast, with exit code 70 (never 1, which
``kvfast check`` uses for "divergence found"); results, a report or a scoreboard that could not be written
(``kvfast.sweep.store.StorageError``: a full disk, a read-only place) is one line and exit code 74. Ctrl-C
at any point, start-up included (the subcommands' imports: pandas, NumPy), is one line and exit code
130: this module imports nothing heavy, and :func:`main` installs its SIGINT
handler before it imports anything else.

Start-up: the command modules import nothing heavy at their top (their parsers are built without NumPy,
pandas, Numba or the sweep engine).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import kvfast.commands
from kvfast._version import __version__
from kvfast.commands import EXIT_INTERRUPTED


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe


def build_parser() -> Parser:
    """The ``kvfast`` parser: one subcommand per module of :mod:`kvfast.commands`, in name order."""
    import importlib
    import pkgutil

    parser = Parser(prog="kvfast", description="A KV cache is not an approximation: check it bit for bit.")
    parser.add_argument("--version", action="version", version=f"kvfast {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in sorted(m.name for m in pkgutil.iter_modules(kvfast.commands.__path__)):
        importlib.import_module(f"kvfast.commands.{module}").add_parser(sub)
    return parser


_CTRL_C = threading.Event()


def _on_ctrl_c(signum, frame) -> None:
    _CTRL_C.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. A Ctrl-C that no subcommand handled is one line and 130."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_ctrl_c) if on_main else None
    _CTRL_C.clear()
    try:
        return _main(argv)
    except BaseException as exc:  # a Ctrl-C during an import can surface as that import's ImportError
        interrupt = sys.modules.get("kvfast.runtime.interrupt")  # a sweep's own SIGINT handler records it there
        seen = _CTRL_C.is_set() or (interrupt is not None and interrupt.INTERRUPTED.is_set())
        if not seen or isinstance(exc, SystemExit):
            raise
        print("kvfast: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        pool = sys.modules.get("kvfast.sweep.backends.pool")
        if pool is not None:  # a sweep ran: its loky workers are killed, not joined at exit
            pool.release_workers()


def _main(argv: list[str] | None) -> int:
    import os
    import traceback

    from kvfast.commands import EXIT_KVFAST_BUG, EXIT_STORAGE, bug_line
    from kvfast.runtime import UserCodeError, ctrl_c_noted, probing_imports
    from kvfast.validation import one_line

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with ctrl_c_noted(), probing_imports():
            return int(args.func(args) or 0)
    except (ValueError, UserCodeError) as exc:  # bad input; the user's code (a study module, say) failed
        print(f"kvfast: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # only a real Ctrl-C gets here: the user's own became UserCodeError
        print("kvfast: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`kvfast show DIR | head`): stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 - an expected failure never gets here but a failed write
        store = sys.modules.get("kvfast.sweep.store")  # its StorageError: imported by whatever writes results
        if store is not None and isinstance(exc, store.StorageError):  # disk full, a read-only place: one line
            print(f"kvfast: error: {one_line(exc)}", file=sys.stderr)
            return EXIT_STORAGE
        traceback.print_exc()  # kvfast's bug
        print(bug_line(), file=sys.stderr)
        return EXIT_KVFAST_BUG


if __name__ == "__main__":
    sys.exit(main())
