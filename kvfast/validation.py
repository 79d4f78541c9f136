"""Argument validation shared by every layer: one message form, ``FIELD: VALUE is not allowed; allowed: WHAT``.

A leaf module (it imports nothing from kvfast), so kernels' callers, the model,
the checker, the studies and the sweep engine all raise the same ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np


def not_allowed(field: str, value: object, allowed: str) -> ValueError:
    """The one form of kvfast's argument errors (to ``raise``)."""
    return ValueError(f"{field}: {value!r} is not allowed; allowed: {allowed}")


def require_int(value: object, field: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[minimum, maximum]``, else ``ValueError``."""
    ok = not isinstance(value, bool) and isinstance(value, int | np.integer)
    if ok:
        ok = value >= minimum and (maximum is None or value <= maximum)
    if not ok:
        upper = "" if maximum is None else f", <= {maximum}"
        raise not_allowed(field, value, f"an integer >= {minimum}{upper}")
    return int(value)


def require_choice(value: object, field: str, allowed: Collection[str]) -> str:
    """``value`` if it is one of the strings ``allowed``, else ``ValueError`` listing them (sorted)."""
    if not isinstance(value, str) or value not in allowed:
        raise not_allowed(field, value, ", ".join(sorted(allowed)))
    return value
