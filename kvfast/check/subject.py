"""What one check is about: the model's calls, the prompt, and the options resolved against both.

:func:`resolve` is where :class:`~kvfast.check.options.CheckOptions` meets a model and a prompt: it
wraps the model (:func:`as_model_under_test`), validates the prompt, and checks
what the options alone could not (``promote`` against the model's methods, ``split`` against the
prompt's length, every token against the vocabulary, the positions against ``max_positions``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvfast.check.adapters import KvfastModel
from kvfast.check.protocol import (
    PROTOCOL_METHODS,
    GuardedModel,
    ModelCalls,
    call_model,
    check_prompt,
    check_range,
    guard,
    has,
    model_name,
    read_attribute,
    require_model,
    vocab_of,
)
from kvfast.check.scenarios import REGISTRY
from kvfast.validation import not_allowed, require_int

if TYPE_CHECKING:  # the options are read, never built or validated here
    from kvfast.check.options import CheckOptions


@dataclass(frozen=True)
class CheckSubject:
    """One check's inputs, validated: ``calls`` (the model), ``prompt`` (``int64``, ``T`` tokens),
    ``options``, ``split`` (the resume scenario's, resolved), ``given`` (the continuation's
    tokens as ``int64``, or ``None`` for greedy ones), ``steps`` (the options') and ``vocab`` (the model's)."""

    calls: ModelCalls
    prompt: np.ndarray
    options: CheckOptions
    split: int
    given: np.ndarray | None
    T: int  # the prompt's length (its name throughout the checker's docs)
    steps: int
    vocab: int


def as_model_under_test(model: object) -> GuardedModel:
    """``model`` (a Hugging Face model wrapped in :class:`kvfast.check.hf.HFModel`, an engine's object or an
    onnxruntime-genai model directory in its adapter: :func:`kvfast.check.engines.engine_adapter`) seen through
    :class:`kvfast.check.protocol.GuardedModel`: its own exceptions and exits become
    :class:`~kvfast.check.protocol.ModelUnderTestError`. ``ValueError`` if it is not a model under test."""
    if isinstance(model, GuardedModel):
        return model
    if type(model) is KvfastModel:  # kvfast's own model (exactly): neither an engine's object nor a Hugging Face one
        if not PROTOCOL_METHODS.isdisjoint(vars(model)):  # a protocol method replaced on the instance: check them
            require_model(model)  # (else its methods are its class's, which has every required one)
        return guard(model)
    from kvfast.check.engines import engine_adapter
    from kvfast.check.hf import is_hf_model

    engine = engine_adapter(model)  # an engine's own object, or an onnxruntime-genai model directory
    if engine is None and is_hf_model(model):
        from kvfast.check.hf import HFModel

        engine = "kvfast.check.hf.HFModel", HFModel
    if engine is None:
        require_model(model)
        return guard(model)
    name, adapter_class = engine
    adapter = call_model(f"{name}(model)", adapter_class, model, passthrough=(ValueError,))
    return guard(adapter, passthrough=(ValueError,))  # the adapter's ValueErrors are bad input


def resolve(model: object, prompt: object, options: CheckOptions) -> CheckSubject:
    """``model``, ``prompt`` and ``options`` as one :class:`CheckSubject`; ``ValueError`` for bad input."""
    model = as_model_under_test(model)
    prompt = check_prompt(prompt)
    if options.promote is not None and not has(model, "promote"):
        raise not_allowed("promote", options.promote, f"None for {model_name(model)} (it has no promote(dtype) method)")
    T = prompt.shape[0]
    # bad input when no requested scenario can run on the prompt whatever the model (a one-token prompt asked only
    # to be resumed): known before any work, so never a check
    why = [REGISTRY[name].prompt_reason(prompt) for name in options.scenarios]
    if None not in why:
        can = ", ".join(n for n, s in REGISTRY.items() if s.prompt_reason(prompt) is None)
        raise ValueError(
            f"scenarios: {options.scenarios!r} cannot run on this prompt ({'; '.join(why)}); allowed: a longer "
            f"prompt, or a scenario that can ({can})"
        )
    if options.split is not None and T == 1:  # the resume scenario's split (default T // 2)
        raise not_allowed("split", options.split, "None (a one-token prompt cannot be split)")
    split = T // 2 if options.split is None else require_int(options.split, "split", 1, T - 1)
    vocab = vocab_of(model)
    check_range(prompt, vocab)
    limit = read_attribute(model, "max_positions")
    if isinstance(limit, int) and T + options.steps > limit:
        raise not_allowed(
            "steps", options.steps, f"at most {limit - T} (the model has {limit} positions; the prompt takes {T})"
        )
    given = options.given_tokens()
    if given is not None:
        check_range(given, vocab, "continuation")
    return CheckSubject(ModelCalls(model, vocab), prompt, options, split, given, T, options.steps, vocab)
