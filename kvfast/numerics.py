"""``Numerics``: the storage format, the accumulator format and the summation order.

Names are validated here and turned into the small integer codes the kernels
take, so that one compiled kernel serves every combination.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfast.kernels.precision import FORMAT_CODES
from kvfast.kernels.reduce import ORDER_CODES

PRESETS: dict[str, tuple[str, str]] = {
    "f64": ("f64", "f64"),
    "f32": ("f32", "f32"),
    "bf16": ("bf16", "f32"),
}


def _check_choice(field: str, value: object, allowed: dict) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{field}: {value!r} is not allowed; allowed: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class Numerics:
    """How a forward pass computes.

    - ``storage``: the format every materialised value is rounded to (weights,
      activations, residual stream, K/V cache entries, logits).
    - ``accum``: the format every running sum is held in (products and adds are
      rounded to it after every operation).
    - ``order``: the summation order of every reduction (matmul dots, attention
      scores, softmax sum, weighted sum of values, RMSNorm mean).
    """

    storage: str = "f64"
    accum: str = "f64"
    order: str = "sequential"

    def __post_init__(self) -> None:
        _check_choice("storage", self.storage, FORMAT_CODES)
        _check_choice("accum", self.accum, FORMAT_CODES)
        _check_choice("order", self.order, ORDER_CODES)

    @classmethod
    def preset(cls, name: str, order: str = "sequential") -> Numerics:
        """``f64`` = f64/f64, ``f32`` = f32/f32, ``bf16`` = bf16 storage with an f32 accumulator."""
        _check_choice("preset", name, PRESETS)
        storage, accum = PRESETS[name]
        return cls(storage=storage, accum=accum, order=order)

    @property
    def codes(self) -> tuple[int, int, int]:
        """``(storage, accum, order)`` as kernel codes."""
        return FORMAT_CODES[self.storage], FORMAT_CODES[self.accum], ORDER_CODES[self.order]

    @property
    def name(self) -> str:
        """A short label such as ``bf16/f32/pairwise``."""
        return f"{self.storage}/{self.accum}/{self.order}"
