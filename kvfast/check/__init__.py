"""``kvfast.check``: every-step KV-cache checks for any model, with a rounding-or-bug verdict.

- :func:`check_cache` / :func:`assert_cache_exact`: the checker (:mod:`kvfast.check.checker`);
  :class:`CheckOptions` its options as one validated object (:func:`check_cache_with`).
- :mod:`kvfast.check.protocol`: what a model under test provides; :class:`ModelUnderTestError` (the
  model's own code raised or exited) and :class:`CheckTimeout` (``check_cache(..., timeout=S)``).
- :mod:`kvfast.check.control`: control mode's method and limits.
- :class:`KvfastModel`: kvfast's own model (with any catalogue bug) as a model under test.
- :class:`NumpyModel`: a NumPy reference model of the same architecture, loading kvfast's ``.npz``.
- :class:`HFModel` (:mod:`kvfast.check.hf`, extra ``kvfast[hf]``): a Hugging Face causal LM as a model
  under test (imported on first use: kvfast does not need torch).

The product only: the bug catalogues kvfast tests it against, and detector scoring, are :mod:`kvfast.bugs`
(which imports this package, never the other way round).
"""

from __future__ import annotations

from kvfast.check.adapters import KvfastModel
from kvfast.check.checker import (
    MODES,
    SCENARIOS,
    CheckReport,
    ScenarioReport,
    assert_cache_exact,
    check_cache,
    check_cache_with,
)
from kvfast.check.numpy_model import NumpyModel
from kvfast.check.options import CheckOptions
from kvfast.check.protocol import CheckTimeout, ModelUnderTestError


def __getattr__(name: str):
    if name == "HFModel":
        from kvfast.check.hf import HFModel

        return HFModel
    raise AttributeError(f"module 'kvfast.check' has no attribute {name!r}")


__all__ = [
    "HFModel",
    "MODES",
    "SCENARIOS",
    "CheckOptions",
    "CheckReport",
    "CheckTimeout",
    "KvfastModel",
    "ModelUnderTestError",
    "NumpyModel",
    "ScenarioReport",
    "assert_cache_exact",
    "check_cache",
    "check_cache_with",
]
