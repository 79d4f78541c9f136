"""``kvfast.check``: every-step KV-cache checks for any model, with a rounding-or-bug verdict.

The API: :func:`check_cache` / :func:`assert_cache_exact` (:func:`check_cache_with` takes the options as one
:class:`CheckOptions`); a :class:`CheckReport` back. :class:`KvfastModel` (kvfast's own model),
:class:`NumpyModel` (a NumPy model of the same architecture) and :class:`HFModel` (a Hugging Face causal LM,
extra ``kvfast[hf]``, imported on first use) are models under test; engines are in :mod:`kvfast.check.engines`.

Reading order: a check is one pipeline (choose the scenarios, run each, judge each, report), and the modules
follow it, each below the next:

1. :mod:`~kvfast.check.protocol`: what a model under test provides, how its answers are validated
   (:class:`~kvfast.check.protocol.ModelCalls`), and whose failure an error is (:class:`ModelUnderTestError`,
   :class:`CheckTimeout`); :mod:`~kvfast.check.formats`: rounding (the formats, their ulps, the ceilings
   below which noise is rounding, the model's internal formats).
2. :mod:`~kvfast.check.scenarios`: one unit per scenario (``decode``, ``resume``, ``rollback``, ``fork``,
   ``reorder``, ``padded``) and their registry; :mod:`~kvfast.check.control`: control mode's method and limits;
   :mod:`~kvfast.check.check_report`: the report and its rendering.
3. :mod:`~kvfast.check.options`: every option, validated once (the command line's flags come from its fields).
4. :mod:`~kvfast.check.subject`: the options met with a model and a prompt; :mod:`~kvfast.check.judge`: how a
   scenario is judged (exact or control), chosen once.
5. :mod:`~kvfast.check.reference`: the recompute rows (and order noise) a cache path is compared with;
   :mod:`~kvfast.check.lossy`: a quantized cache re-judged as one.
6. :mod:`~kvfast.check.checker`: the pipeline itself (the float64 logic check is a second run of it).

The product only: the bug catalogues kvfast tests it against, and detector scoring, are :mod:`kvfast.bugs`
(which imports this package, never the other way round).
"""

from __future__ import annotations

from kvfast._lazy import lazy_exports

# public name -> the module that defines it: imported on first use, so that importing one of this package's
# modules (``kvfast.check.options``: the command line's flags and their validation) does not load the checker,
# kvfast's model and Numba
_EXPORTS = {
    "KvfastModel": "kvfast.check.adapters",
    "CheckReport": "kvfast.check.check_report",
    "ScenarioReport": "kvfast.check.check_report",
    "assert_cache_exact": "kvfast.check.checker",
    "check_cache": "kvfast.check.checker",
    "check_cache_with": "kvfast.check.checker",
    "NumpyModel": "kvfast.check.numpy_model",
    "CheckOptions": "kvfast.check.options",
    "MODES": "kvfast.check.options",
    "SCENARIOS": "kvfast.check.options",
    "CheckTimeout": "kvfast.check.protocol",
    "ModelUnderTestError": "kvfast.check.protocol",
    "HFModel": "kvfast.check.hf",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, submodules=True)


__all__ = sorted(_EXPORTS)  # every public name, from the one list of them
