"""kvfast: a KV cache is not an approximation. Bit-exact cache checks, bugs, detectors and sweeps.

Public names are imported on first use, so ``import kvfast`` (and the pytest
plugin that installing kvfast registers) stays cheap and does not load Numba
until a kernel is needed.
"""

from __future__ import annotations

from kvfast._lazy import lazy_exports
from kvfast._version import __version__

# public name -> module that defines it
_EXPORTS = {
    "BUGS": "kvfast.model.bugs",
    "KVCache": "kvfast.model.cache",
    "ModelConfig": "kvfast.model.config",
    "init_params": "kvfast.model.config",
    "load_params": "kvfast.model.config",
    "save_params": "kvfast.model.config",
    "decode_step": "kvfast.model.generation",
    "generate": "kvfast.model.generation",
    "forward": "kvfast.model.transformer",
    "forward_trace": "kvfast.model.transformer",
    "loss_and_grads": "kvfast.model.transformer",
    "Numerics": "kvfast.numerics",
    "to_bfloat16": "kvfast.kernels.precision",
    "load": "kvfast.sweep.store",
    "run_inline": "kvfast.sweep.engine",
    "compare_detectors": "kvfast.studies.detector",
    "score_detector": "kvfast.studies.detector",
    "CheckReport": "kvfast.check",
    "CheckTimeout": "kvfast.check",
    "ModelUnderTestError": "kvfast.check",
    "HFModel": "kvfast.check",
    "KvfastModel": "kvfast.check",
    "NumpyModel": "kvfast.check",
    "assert_cache_exact": "kvfast.check",
    "check_cache": "kvfast.check",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
