"""The KV cache: per layer, the keys and values of every position seen so far."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvfast.model.config import ModelConfig
from kvfast.numerics import Numerics


@dataclass
class KVCache:
    """Keys and values of positions ``0 .. length-1`` for every layer.

    ``k`` and ``v`` are ``(n_layer, capacity, d_model)`` float64 arrays whose
    entries are on the ``storage`` grid. ``prefill_len`` is the length after the
    last prefill (a batched forward); decoding grows ``length`` one at a time.
    """

    config: ModelConfig
    storage: str
    capacity: int
    k: np.ndarray
    v: np.ndarray
    length: int = 0
    prefill_len: int = 0

    @classmethod
    def empty(cls, config: ModelConfig, numerics: Numerics | str, capacity: int | None = None) -> KVCache:
        """An empty cache for ``config`` holding at most ``capacity`` positions (default ``max_pos``)."""
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config: {type(config).__name__} is not allowed; allowed: a ModelConfig")
        if isinstance(numerics, str):
            numerics = Numerics.preset(numerics)
        if not isinstance(numerics, Numerics):
            raise ValueError(f"numerics: {numerics!r} is not allowed; allowed: a Numerics or a preset name")
        if capacity is None:
            capacity = config.max_pos
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, int | np.integer)
            or not (1 <= capacity <= config.max_pos)
        ):
            raise ValueError(f"capacity: {capacity!r} is not allowed; allowed: an integer in [1, {config.max_pos}]")
        shape = (config.n_layer, int(capacity), config.d_model)
        return cls(config, numerics.storage, int(capacity), np.zeros(shape), np.zeros(shape))

    def check_for(self, config: ModelConfig, numerics: Numerics, extra: int) -> None:
        """Raise ``ValueError`` unless this cache fits ``config``/``numerics`` and has room for ``extra`` more."""
        if self.config != config:
            raise ValueError(f"cache: made for {self.config}, not for {config}; allowed: a cache made for this config")
        if self.storage != numerics.storage:
            raise ValueError(
                f"cache: stores {self.storage!r} values but numerics.storage is {numerics.storage!r}; "
                "allowed: the same storage format"
            )
        if self.length + extra > self.capacity:
            raise ValueError(
                f"cache: full ({self.length} of {self.capacity} positions used, {extra} more asked); "
                "allowed: at most its capacity"
            )
