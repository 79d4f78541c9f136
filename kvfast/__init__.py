"""kvfast: a KV cache is not an approximation. Bit-exact cache checks, bugs, detectors and sweeps."""

from kvfast._version import __version__
from kvfast.kernels.precision import to_bfloat16
from kvfast.model.bugs import BUGS
from kvfast.model.cache import KVCache
from kvfast.model.config import ModelConfig, init_params, load_params, save_params
from kvfast.model.decode import decode_step, generate
from kvfast.model.transformer import forward, forward_trace, loss_and_grads
from kvfast.numerics import Numerics


def load(path):
    """A results directory as a pandas DataFrame, one row per run, sorted by run_id (see kvfast.sweep.load)."""
    from kvfast.sweep.store import load as _load

    return _load(path)


__all__ = [
    "BUGS",
    "KVCache",
    "ModelConfig",
    "Numerics",
    "__version__",
    "decode_step",
    "forward",
    "forward_trace",
    "generate",
    "init_params",
    "load",
    "load_params",
    "loss_and_grads",
    "save_params",
    "to_bfloat16",
]

# kvfast.check, imported on first use (keeps `import kvfast` light and the pytest plugin cheap).
_CHECK_EXPORTS = (
    "CheckReport",
    "KvfastModel",
    "NumpyModel",
    "assert_cache_exact",
    "check_cache",
    "compare_detectors",
    "score_detector",
)
__all__ += list(_CHECK_EXPORTS)


def __getattr__(name: str):
    if name in _CHECK_EXPORTS:
        import kvfast.check

        return getattr(kvfast.check, name)
    raise AttributeError(f"module 'kvfast' has no attribute {name!r}")
