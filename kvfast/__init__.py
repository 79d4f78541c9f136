"""kvfast: a KV cache is not an approximation. Bit-exact cache checks, bugs, detectors and sweeps.

Public names are imported on first use, so ``import kvfast`` (and the pytest
plugin that installing kvfast registers) stays cheap and does not load Numba
until a kernel is needed.
"""

from __future__ import annotations

from kvfast._lazy import lazy_exports
from kvfast._version import __version__

# module -> the public names it defines
_MODULES = {
    "kvfast.model.bugs": ("BUGS",),
    "kvfast.model.cache": ("KVCache",),
    "kvfast.model.config": ("ModelConfig", "init_params", "load_params", "save_params"),
    "kvfast.model.generation": ("decode_step", "generate"),
    "kvfast.model.transformer": ("forward", "forward_trace", "loss_and_grads"),
    "kvfast.numerics": ("Numerics",),
    "kvfast.kernels.precision": ("to_bfloat16",),
    "kvfast.sweep.store": ("load",),
    "kvfast.sweep.engine": ("run_inline",),
    "kvfast.studies.detector": ("compare_detectors", "score_detector"),
    "kvfast.check": (
        "CheckReport", "CheckTimeout", "ModelUnderTestError", "HFModel", "KvfastModel", "NumpyModel",
        "assert_cache_exact", "check_cache",
    ),
}  # fmt: skip
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["__version__", *sorted(_EXPORTS)]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
