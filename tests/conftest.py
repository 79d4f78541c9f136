"""Shared test setup.

Numba's on-disk cache is invalidated only when the file that defines a jitted
function changes, not when a function it calls (in another file) changes, nor
when a module-level constant it reads changes: after an edit to
``kvfast/kernels/reduce.py`` the cached ``decode_kernel`` would still run the
old reduction. A bit-exactness suite must never test stale code, so the tests
use a Numba cache directory keyed by a hash of every source file that uses
Numba, plus ``kvfast/model/bugs.py`` (whose constants ``decode_kernel`` reads),
set before Numba is imported. Set ``NUMBA_CACHE_DIR`` yourself to override.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_key() -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / "kvfast").rglob("*.py")):
        text = path.read_bytes()
        if b"numba" in text or path.name == "bugs.py":
            digest.update(path.relative_to(ROOT).as_posix().encode())
            digest.update(text)
    return digest.hexdigest()[:16]


if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = str(ROOT / ".numba-test-cache" / _source_key())

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "kvfast",
    max_examples=60,
    deadline=None,  # the first call of a kernel may load or compile it
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("kvfast")

PRESETS = ("f64", "f32", "bf16")
ORDERS = ("sequential", "pairwise")


@pytest.fixture
def small_config():
    from kvfast import ModelConfig

    return ModelConfig(vocab=13, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=16)
