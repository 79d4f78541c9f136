"""Inference engines as models under test (each an optional extra): :mod:`kvfast.check.engines.ort`
(onnxruntime-genai, ``kvfast[ort]``), :mod:`kvfast.check.engines.llamacpp` (llama.cpp through
llama-cpp-python, ``kvfast[llamacpp]``), :mod:`kvfast.check.engines.vllm` (vLLM, ``kvfast[vllm]``),
:mod:`kvfast.check.engines.transformer_lens` (a TransformerLens ``HookedTransformer`` or ``TransformerBridge``,
``kvfast[transformer_lens]``).

:func:`engine_adapter` is where an engine's own object (or an onnxruntime-genai model directory) given to
``check_cache`` finds its adapter: the one table of what kvfast wraps by itself. :func:`choose_variants` and
:func:`run_variants` are every adapter's order-noise variants chosen and run (the Hugging Face adapter's too),
:class:`FedCache` the cached calls of an engine whose cache is fed tokens.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import numpy as np

from kvfast.validation import require_choice, require_int

#: What ``check_cache`` wraps by itself: ``(module, detector, adapter)``; the detector (imports no engine) says
#: whether an object is that engine's, the adapter (the module's class) takes it as its first argument.
ENGINE_OBJECTS = (
    ("kvfast.check.engines.ort", "is_ort_model", "ORTModel"),  # an onnxruntime-genai model directory
    ("kvfast.check.engines.ort", "is_og_model", "ORTModel"),  # an onnxruntime_genai.Model
    ("kvfast.check.engines.llamacpp", "is_llama", "LlamaCppModel"),  # a llama_cpp.Llama
    ("kvfast.check.engines.vllm", "is_vllm_llm", "VLLMModel"),  # a vllm.LLM
    ("kvfast.check.engines.transformer_lens", "is_hooked_transformer", "TLModel"),  # a HookedTransformer
    ("kvfast.check.engines.transformer_lens", "is_transformer_bridge", "TLBridgeModel"),  # a TransformerBridge
)


def engine_adapter(model: object) -> tuple[str, Callable[[object], object]] | None:
    """``(name, adapter class)`` for an engine object or model directory kvfast wraps by itself
    (:data:`ENGINE_OBJECTS`), else ``None``. Imports no engine: only the matching adapter's module."""
    for module, detector, adapter in ENGINE_OBJECTS:
        found = sys.modules.get(module) or importlib.import_module(module)
        if getattr(found, detector)(model):
            return f"{module}.{adapter}", getattr(found, adapter)
    return None


def choose_variants(variants, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``variants`` (one name or several) as a tuple, each one of ``allowed`` (``ValueError`` naming ``variants``)."""
    return tuple(
        require_choice(v, "variants", allowed) for v in ((variants,) if isinstance(variants, str) else variants)
    )


def run_variants(adapter, names, compute: Callable[[str], object]) -> dict:
    """``{name: compute(name)}`` for each of ``names`` that ``adapter.skipped_variants`` does not hold. A variant that
    raises is left out and named there with the reason: a variant is order noise, and losing one must not lose the
    check."""
    out = {}
    for name in names:
        if name in adapter.skipped_variants:
            continue
        try:
            out[name] = compute(name)
        except Exception as exc:  # noqa: BLE001 - any failure of a variant skips it, with why
            adapter.skipped_variants[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return out


class FedCache:
    """The protocol's cached calls of an engine whose cache is fed tokens: ``prefill`` (a fresh cache, then the
    tokens), ``extend`` and ``decode`` (the tokens on top of it). An engine fills in ``_fresh()`` (a fresh cache)
    and ``_feed(tokens)`` (``tokens``, a list of ints, fed to the cache: their logits ``(n, V)``); :attr:`tokens`
    is what the cache holds (``None`` before the first prefill)."""

    tokens: list[int] | None = None

    def prefill(self, tokens):
        """A fresh cache, then ``tokens`` over it: logits ``(T, V)``."""
        self._fresh()
        self.tokens = []
        return self._fed(tokens)

    def extend(self, tokens):
        """``tokens`` on top of the cache: logits ``(n, V)``."""
        self._require()
        return self._fed(tokens)

    def decode(self, token):
        """One token on top of the cache: logits ``(V,)``."""
        self._require()
        return self._fed([require_int(token, "token", 0, self.vocab_size - 1)])[0]

    def _fed(self, tokens):
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        out = self._feed(tokens)
        self.tokens += tokens
        return out

    def _require(self) -> None:
        if self.tokens is None:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")
