"""Shared test setup: Hypothesis's profile, torch on one thread, and the fixtures many folders use.

Numba's cache directory is keyed by a hash of kvfast's Numba sources by
``kvfast.kernels`` itself, so the tests never run stale machine code.
Plain helpers (the repository's paths, ``kvfast`` as a fresh process) are in :mod:`shared`.
"""

from __future__ import annotations

import functools
import sys

import pytest
from hypothesis import HealthCheck, settings

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


@pytest.fixture(autouse=True)
def _torch_one_thread():
    """torch, where a test module has loaded it, on one intra-op thread (the machine is shared; the checks' order
    noise must not depend on a thread count). A test that imports torch itself sets it there."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(family, dtype, attention, seed)``: :func:`kvfast.testing.tiny_model`'s model, built once per
    session for the tests that only read it (checks wrap it in adapters, inject bugs into those, promote deep
    copies). A test that changes its model (its config, its weights) builds its own with ``tiny_model``."""
    from kvfast.testing import tiny_model

    return functools.cache(tiny_model)


@pytest.fixture
def small_config():
    from kvfast import ModelConfig

    return ModelConfig(vocab=13, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=16)
