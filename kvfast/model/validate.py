"""Argument validation for the model's public functions (messages: ``FIELD: VALUE ...; allowed: WHAT``).

Each ``require_*`` returns its argument in the form the computation uses (a
``Numerics`` for a preset name, an int64 array for a token sequence) or raises
``ValueError``; plain integers go through :func:`kvfast.validation.require_int`.
"""

from __future__ import annotations

import numpy as np

from kvfast.model.config import ModelConfig
from kvfast.numerics import Numerics
from kvfast.validation import not_allowed


def require_config(config: object) -> ModelConfig:
    """``config`` if it is a :class:`ModelConfig`."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config: {type(config).__name__} is not allowed; allowed: a ModelConfig")
    return config


def require_numerics(numerics: object, field: str = "numerics") -> Numerics:
    """A :class:`Numerics`, or the preset of that name."""
    if isinstance(numerics, str):
        return Numerics.preset(numerics)
    if not isinstance(numerics, Numerics):
        raise not_allowed(field, numerics, "a Numerics or a preset name")
    return numerics


def require_tokens(config: ModelConfig, tokens: object, field: str = "tokens", start: int = 0) -> np.ndarray:
    """A non-empty 1-D int64 array of ids in ``[0, vocab)`` that fits in ``max_pos`` after ``start``."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{field}: shape {arr.shape} is not allowed; allowed: a non-empty 1-D sequence")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{field}: dtype {arr.dtype} is not allowed; allowed: integer token ids")
    if arr[arr.argmin()] < 0 or arr[arr.argmax()] >= config.vocab:  # (no reduction's set-up, no boolean arrays)
        bad = (arr < 0) | (arr >= config.vocab)
        raise ValueError(f"{field}: token {int(arr[bad][0])} is out of range; allowed: integers in [0, {config.vocab})")
    if start + arr.size > config.max_pos:
        raise ValueError(
            f"{field}: {arr.size} tokens from position {start} pass max_pos={config.max_pos}; "
            f"allowed: at most {config.max_pos - start}"
        )
    return arr.astype(np.int64)


def require_token(config: ModelConfig, token: object) -> int:
    """One token id in ``[0, vocab)`` as an ``int``."""
    if isinstance(token, bool) or not isinstance(token, int | np.integer):
        raise not_allowed("token", token, f"an integer in [0, {config.vocab})")
    if not 0 <= int(token) < config.vocab:
        raise ValueError(f"token: {token} is out of range; allowed: integers in [0, {config.vocab})")
    return int(token)
