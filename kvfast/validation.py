"""Argument validation shared by every layer: one message form, ``FIELD: VALUE is not allowed; allowed: WHAT``.

A leaf module (it imports nothing from kvfast), so kernels' callers, the model,
the checker, the studies and the sweep engine all raise the same ``ValueError``.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from types import ModuleType

import numpy as np

SHOWN_CHARS = 200  # a user's value quoted in a message: at most this many characters of its repr
LINE_CHARS = 2000  # an error line on the command line: at most this many characters


def shorten(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and end around an ellipsis that
    says how long it was (a message quoting a 5 MB value must still be one readable line)."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 8)
    return f"{text[: keep - keep // 4]}...{text[-(keep // 4) :]} ({len(text):,} characters)"


def shown(value: object) -> str:
    """``repr(value)`` for a message, shortened to :data:`SHOWN_CHARS`."""
    return shorten(repr(value), SHOWN_CHARS)


def one_line(message: object) -> str:
    """``message`` as one line for the command line: newlines and runs of blanks collapsed, shortened to
    :data:`LINE_CHARS`."""
    return shorten(" ".join(str(message).split()), LINE_CHARS)


def printable(text: object, keep: str = "") -> str:
    """``text`` with every character that is not printable (control characters, escape sequences, line and
    paragraph separators, lone surrogates) written as its Python escape (``\\x1b``, ``\\u2028``), except those in
    ``keep`` (``"\\n"``): what a terminal, a Markdown or HTML file shows as text, never acts on."""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in str(text))


def not_allowed(field: str, value: object, allowed: str) -> ValueError:
    """The one form of kvfast's argument errors (to ``raise``); the value is quoted shortened."""
    return ValueError(f"{field}: {shown(value)} is not allowed; allowed: {allowed}")


def require_int(value: object, field: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[minimum, maximum]``, else ``ValueError``."""
    is_int = not isinstance(value, bool) and isinstance(value, int | np.integer)
    if not (is_int and value >= minimum and (maximum is None or value <= maximum)):
        upper = "" if maximum is None else f", <= {maximum}"
        raise not_allowed(field, value, f"an integer >= {minimum}{upper}")
    return int(value)


def require_choice(value: object, field: str, allowed: Collection[str]) -> str:
    """``value`` if it is one of the strings ``allowed``, else ``ValueError`` listing them (sorted)."""
    if not isinstance(value, str) or value not in allowed:
        raise not_allowed(field, value, ", ".join(sorted(allowed)))
    return value


class MissingExtra(ValueError):
    """Bad input of one kind: something needs an optional extra of kvfast that is not installed. ``extra``
    names it as pip does (``"hf"``, or ``"llamacpp,hf"`` for two), so that a caller can say
    ``needs kvfast[hf]`` (``kvfast grids``) where another refusal says ``invalid``."""

    def __init__(self, message: str, extra: str):
        super().__init__(message)
        self.extra = extra


def prefixed(exc: ValueError, prefix: str) -> ValueError:
    """``exc``'s message after ``prefix: ``, as the same kind of refusal (a :class:`MissingExtra` keeps its
    extra)."""
    if isinstance(exc, MissingExtra):
        return MissingExtra(f"{prefix}: {exc}", exc.extra)
    return ValueError(f"{prefix}: {exc}")


def import_extra(module: str, what: str, extra: str, field: str = "model") -> ModuleType:
    """The module ``module``, imported, or :class:`MissingExtra` (a ``ValueError``) naming ``field`` when it
    cannot be: ``what`` (in words, e.g. ``"a llama.cpp model"``) needs it, and the optional extra ``extra`` of
    kvfast installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{field}: {what} needs {module}; allowed: pip install 'kvfast[{extra}]'", extra) from exc
