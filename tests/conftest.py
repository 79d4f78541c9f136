"""Shared test setup.

Numba's cache directory is keyed by a hash of kvfast's Numba sources by
``kvfast.kernels`` itself, so the tests never run stale machine code.
"""

from __future__ import annotations

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


@pytest.fixture
def small_config():
    from kvfast import ModelConfig

    return ModelConfig(vocab=13, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=16)


@pytest.fixture(scope="module")
def torch_one_thread():
    """torch on one intra-op thread for a module's tests (the machine is shared; the checks' order noise must not
    depend on a thread count), put back after them. A module uses it with
    ``pytestmark = pytest.mark.usefixtures("torch_one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
