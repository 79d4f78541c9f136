"""Subcommands of the ``kvfast`` command line (see :mod:`kvfast.cli`), and what they share."""

from __future__ import annotations

from kvfast._version import __version__

EXIT_KVFAST_BUG = 70  # sysexits' EX_SOFTWARE: never 1, which kvfast check uses for "divergence found"
EXIT_STORAGE = 74  # sysexits' EX_IOERR: results, a report or a scoreboard could not be written
EXIT_INTERRUPTED = 130  # 128 + SIGINT


def bug_line() -> str:
    """The line printed under the traceback of an unexpected error."""
    return (
        f"kvfast {__version__}: this is a bug in kvfast, not a problem with your input or model; "
        "please report it with the traceback above"
    )
