"""What the Hugging Face studies (``hf_matrix``, ``hf_score``) share: the model axes, the torch requirement,
the case a run's config names (prompt and continuation, from its seed) and the tiny models.

A run's model is :func:`kvfast.testing.tiny_model` of the config's ``family``, ``dtype``,
``attention`` and ``seed`` (built once per worker and shared: the adapter never changes it). Adding an
axis is adding a config field here (and its validation): the scan (issue 20) adds architectures to
``family`` and scenarios to the studies' ``scenarios``.

Importing this module imports neither torch nor transformers; a grid of these studies without them is
refused before any run with one line (:func:`require_torch`).
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.bugs.hf import HF_BUGS
from kvfast.studies.common import NO_BUG, declared_order, ok_rows, require_config_choice
from kvfast.testing import ATTENTION, DTYPES, FAMILIES, TINY_VOCAB, tiny_model
from kvfast.validation import MissingExtra, require_int

#: The model a run checks: a tiny random causal LM (:func:`kvfast.testing.tiny_model`) and its weight seed.
MODEL_FIELDS: dict[str, pa.DataType] = {
    "family": pa.string(),
    "dtype": pa.string(),
    "attention": pa.string(),
    "seed": pa.int64(),
}
#: The case: which random prompt of the seed's stream (``prompt``), how many decode steps, which injected bug.
CASE_FIELDS: dict[str, pa.DataType] = {"prompt": pa.int64(), "steps": pa.int64(), "bug": pa.string()}


def require_torch(study: str) -> None:
    """``ValueError`` (one line) unless torch and transformers can be imported: the study needs them."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(
            f"study {study}: needs {' and '.join(missing)}; allowed: install kvfast[hf] (torch and transformers)", "hf"
        )


def validate_model_and_case(config: dict, study: str) -> None:
    """``ValueError`` naming the field unless :data:`MODEL_FIELDS` and :data:`CASE_FIELDS` are allowed values
    (and torch is installed)."""
    require_torch(study)
    require_config_choice(config, "family", FAMILIES)
    require_config_choice(config, "dtype", DTYPES)
    require_config_choice(config, "attention", ATTENTION)
    validate_case(config)


def validate_case(config: dict) -> None:
    """``ValueError`` naming the field unless ``seed`` and the :data:`CASE_FIELDS` are allowed values."""
    require_int(config.get("seed"), "seed", 0)
    require_int(config.get("prompt"), "prompt", 0, 1000)
    require_int(config.get("steps"), "steps", 1, 256)
    require_config_choice(config, "bug", (NO_BUG, *HF_BUGS))


def prompt_and_continuation(
    stream: int, seed: int, prompt: int, steps: int, lengths: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """The ``prompt``-th (prompt, continuation) of the seed's stream: ``default_rng(stream + seed)`` draws, for
    ``k = 0, 1, ...``, a prompt of ``lengths[k % len(lengths)]`` tokens then a continuation of ``steps`` tokens
    (the experiments' draws, so prompt ``k`` is the same whichever prompts a grid runs)."""
    rng = np.random.default_rng(stream + seed)
    for k in range(prompt + 1):
        tokens = rng.integers(0, TINY_VOCAB, lengths[k % len(lengths)])
        continuation = rng.integers(0, TINY_VOCAB, steps)
    return tokens, continuation


@functools.lru_cache(maxsize=32)
def base_model(family: str, dtype: str, attention: str, seed: int):
    """One tiny model per (family, dtype, attention, seed) per process, shared by its runs (adapters never change
    it); torch on one thread."""
    import torch

    torch.set_num_threads(1)
    return tiny_model(family, dtype, attention, seed)


def bug_of(config: dict) -> str | None:
    """The config's injected bug, ``None`` for a clean run."""
    return None if config["bug"] == NO_BUG else config["bug"]


ORDER = {"family": FAMILIES, "dtype": DTYPES, "attention": ATTENTION, "bug": (NO_BUG, *HF_BUGS)}


def ordered_ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The ok runs of ``df`` in the declared order of the model axes and the bug catalogue (then seed and prompt),
    whatever order the sweep stored them in, so every table built by grouping them has one order."""
    ok = ok_rows(df)
    keys = [k for k in (*ORDER, "seed", "prompt") if k in ok.columns]
    return ok.sort_values(keys, key=declared_order(ORDER), kind="stable") if len(ok) and keys else ok
