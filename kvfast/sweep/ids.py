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


def canonical(value: Any, where: str = "config") -> Any:
    """``value`` as plain JSON-able Python (dict keys str, lists, bool/int/float/str/None).

    Raises ``ValueError`` naming ``where`` for a type that has no canonical form.
    """
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not allowed; allowed: string keys")
            out[k] = canonical(v, f"{where}.{k}")
        return out
    raise ValueError(
        f"{where}: {value!r} ({type(value).__name__}) is not allowed; "
        "allowed: integers, floats, strings, booleans, arrays and tables of them"
    )


def canonical_json(value: Any) -> str:
    """The canonical JSON text of ``value`` (sorted keys, no spaces, exact floats)."""
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), allow_nan=True)


def run_id(study: str, version: str, config: dict) -> str:
    """The run's id: 32 hex digits of blake2b over the canonical JSON of study name, version and config."""
    text = canonical_json({"study": study, "version": version, "config": config})
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def spec_hash(spec: dict) -> str:
    """A grid spec's hash (same canonical form as run ids)."""
    return hashlib.blake2b(canonical_json(spec).encode(), digest_size=16).hexdigest()
