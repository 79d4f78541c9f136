"""The KV cache: per layer, the keys and values of every position seen so far.

:class:`KVCache` owns its bookkeeping: the layer-by-layer forward stores rows with
:meth:`KVCache.append` and moves ``length`` with :meth:`KVCache.advance`; the
compiled forward and decode kernels get ``k``/``v`` (and store the new rows
in place) and ``length`` moves with :meth:`KVCache.advance` too. Nothing else
assigns ``length`` or ``prefill_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvfast.model.config import ModelConfig
from kvfast.model.validate import require_config, require_numerics
from kvfast.numerics import Numerics
from kvfast.validation import require_int


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
        config = require_config(config)
        numerics = require_numerics(numerics)
        capacity = require_int(config.max_pos if capacity is None else capacity, "capacity", 1, config.max_pos)
        shape = (config.n_layer, capacity, config.d_model)
        return cls(config, numerics.storage, capacity, np.zeros(shape), np.zeros(shape))

    def require_fits(self, config: ModelConfig, numerics: Numerics, extra: int) -> None:
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

    # --- writes (no validation: the public functions check first) -------------------------------

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store ``k``, ``v`` (T, d) of ``layer`` at positions ``length .. length+T-1``.

        Returns the layer's key and value buffers ``(capacity, d)``, which
        attention reads. ``length`` does not move: :meth:`advance` moves it once
        every layer holds the new rows.
        """
        n = k.shape[0]
        self.k[layer, self.length : self.length + n] = k
        self.v[layer, self.length : self.length + n] = v
        return self.k[layer], self.v[layer]

    def advance(self, n: int, prefill: bool = False) -> None:
        """``n`` more positions are stored in every layer; ``prefill``: a batched forward stored them."""
        self.length += n
        if prefill:
            self.prefill_len = self.length

    def truncate(self, length: int) -> None:
        """Forget positions ``length ..`` (their rows stay in the buffers until overwritten).

        For benchmarks that repeat one decode step at the same position.
        """
        self.length = require_int(length, "length", 0, self.length)
