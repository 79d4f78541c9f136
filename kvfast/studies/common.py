"""What the studies share: validating a run's config, its model's shape, the ok rows of a results table.

Integers are validated with :func:`kvfast.validation.require_int` directly
(``require_int(config.get(name), name, lo, hi)``); this module adds what is
specific to a config dict (a choice listed in the study's own order, the
head-count rule) and the two things every study repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from kvfast.model.config import ModelConfig
from kvfast.validation import not_allowed


def require_config_choice(config: dict, field: str, allowed: Sequence) -> None:
    """``ValueError`` unless ``config[field]`` is one of ``allowed`` (listed in that order; bools only match bools)."""
    listed = ", ".join(map(str, allowed))
    if field not in config:
        raise ValueError(f"{field}: missing; allowed: {listed}")
    value = config[field]
    if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
        raise not_allowed(field, value, listed)


def require_heads_divide(config: dict) -> None:
    """``ValueError`` unless ``config["n_head"]`` divides ``config["d_model"]``."""
    d_model, n_head = config["d_model"], config["n_head"]
    if d_model % n_head:
        raise ValueError(f"d_model: {d_model} is not allowed with n_head={n_head}; allowed: a multiple of n_head")


def model_config(config: dict, max_pos: int) -> ModelConfig:
    """The transformer a run's config names (``vocab``, ``d_model``, ``n_head``, ``n_layer``, ``d_ff``)."""
    return ModelConfig(
        vocab=config["vocab"],
        d_model=config["d_model"],
        n_head=config["n_head"],
        n_layer=config["n_layer"],
        d_ff=config["d_ff"],
        max_pos=max_pos,
    )


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The runs of ``df`` stored with ``status == "ok"`` (all rows when there is no ``status`` column)."""
    return df[df["status"] == "ok"] if "status" in df.columns else df
