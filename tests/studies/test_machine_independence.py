"""A trained model's numbers depend only on its config, not on the CPU that computes them.

Training, its held-out evaluation, the gradient check's reference loss and the training study's gradient cosine
are float64 code outside the explicit-order kernels. NumPy's BLAS picks its kernel by the CPU (OpenBLAS's
``DYNAMIC_ARCH``: a SkylakeX dgemm adds in another order than a Nehalem one), and NumPy's ``exp``, ``log`` and
``power`` pick their code by the CPU's SIMD features; either would make ``data/`` differ in its last digits from
one machine to the next. Each case here is computed in a fresh interpreter under what a different machine
would choose (OpenBLAS told another CPU, NumPy's dispatched SIMD code switched off) and must give the same bits.
Before the backward ran on the sequential kernel, the OpenBLAS case differed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

SCRIPT = """
import hashlib
import numpy as np
from kvfast.model.config import ModelConfig
from kvfast.studies.bugs import task_for
from kvfast.studies.gradcheck import reference_loss
from kvfast.studies.toytask import evaluate, train
from kvfast.studies.training import cosine

cfg = ModelConfig(vocab=16, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=32)
params = train(cfg, task_for(16), 0, 4, 0.01, 8)
held_out = evaluate(cfg, params, task_for(16), 1, n=8)
rng = np.random.default_rng(0)
loss = reference_loss(rng.standard_normal((20, 50)) * 4, rng.integers(0, 50, 20))
cos = cosine(rng.standard_normal(1000), rng.standard_normal(1000))
digest = hashlib.sha256(b"".join(params[k].tobytes() for k in sorted(params)))
digest.update(np.array([held_out["loss"], held_out["accuracy"], loss, cos]).tobytes())
print(digest.hexdigest())
"""


def dispatched_simd() -> list[str]:
    """NumPy's SIMD targets above its baseline that this CPU has (switching them off is what an older CPU gets)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]


def digest(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def openblas() -> bool:
    return "openblas" in str(np.__config__.CONFIG["Build Dependencies"]["blas"]["name"])


MACHINES = {
    # an SSE4-only x86 core: OpenBLAS's oldest kernels the wheel still carries for 64-bit x86
    "openblas-nehalem": {"OPENBLAS_CORETYPE": "Nehalem"},
    "numpy-baseline-simd": "simd",
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_training_gives_the_same_bits_whatever_the_cpu(machine):
    env = MACHINES[machine]
    if env == "simd":
        features = dispatched_simd()
        if not features:
            pytest.skip("NumPy dispatches no SIMD code above its baseline on this CPU")
        env = {"NPY_DISABLE_CPU_FEATURES": " ".join(features)}
    elif platform.machine() not in ("x86_64", "AMD64") or not openblas():
        pytest.skip("OpenBLAS's core types are those of x86-64")
    assert digest(env) == digest({})
