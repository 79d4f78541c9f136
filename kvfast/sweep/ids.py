"""Stable run ids: blake2b of a canonical JSON form of (study, version, config).

The canonical form sorts keys, writes floats in Python's shortest round-trip
form (exact: two floats get the same text only if they are the same double),
turns NumPy scalars and arrays into plain Python values and tuples into lists,
and keeps ``True`` distinct from ``1`` and ``1.0`` distinct from ``1``. So
``0.1`` and ``np.float64(0.1)`` give the same id, ``np.float32(0.1)`` (a
different number) does not, and key order never matters.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from kvfast.validation import shown

MAX_DEPTH = 64  # arrays and tables nested deeper than this are refused (no config needs it; recursion does)
_PLAIN = (str, int, float, bool, type(None))  # the exact types that are already canonical


def canonical(value: Any, where: str = "config", depth: int = 0) -> Any:
    """``value`` as plain JSON-able Python (dict keys str, lists, bool/int/float/str/None).

    Raises ``ValueError`` naming ``where`` for a type that has no canonical form, or for arrays and tables
    nested more than :data:`MAX_DEPTH` deep.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} deep is not allowed; allowed: at most {MAX_DEPTH} "
                         "levels of arrays and tables")  # fmt: skip
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int | float):  # (subclasses, an IntEnum say, as the plain type)
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):  # the common case, without a call per element
            return list(value)
        return [canonical(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {shown(k)} is not allowed; allowed: string keys")
            out[k] = canonical(v, f"{where}.{k}", depth + 1)
        return out
    raise ValueError(
        f"{where}: {shown(value)} ({type(value).__name__}) is not allowed; "
        "allowed: integers, floats, strings, booleans, arrays and tables of them"
    )


def canonical_json(value: Any) -> str:
    """The canonical JSON text of ``value`` (sorted keys, no spaces, exact floats)."""
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), allow_nan=True)


def run_id(study: str, version: str, config: dict) -> str:
    """The run's id: the :func:`canonical_hash` of study name, version and config."""
    return canonical_hash({"study": study, "version": version, "config": config})


def canonical_hash(value: Any) -> str:
    """32 hex digits of blake2b over ``value``'s canonical JSON: a run's id (:func:`run_id`), a grid spec's hash."""
    return hashlib.blake2b(canonical_json(value).encode(), digest_size=16).hexdigest()
