"""``Numerics``: the storage format, the accumulator format and the summation order.

Names are validated here and turned into the small integer codes the kernels
take, so that one compiled kernel serves every combination.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfast.kernels.attention import ATTENTION_CODES
from kvfast.kernels.precision import FORMAT_CODES, Formats
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.validation import require_choice, require_int

PRESETS: dict[str, tuple[str, str]] = {
    "f64": ("f64", "f64"),
    "f32": ("f32", "f32"),
    "bf16": ("bf16", "f32"),
}

# The block size (online, splitkv) or number of splits (splitcount) used when
# ``attn_block`` is left at 0.
DEFAULT_ATTN_BLOCK: dict[str, int] = {"standard": 0, "online": 4, "splitkv": 4, "splitcount": 2}


@dataclass(frozen=True)
class Numerics:
    """How a forward pass computes.

    - ``storage``: the format every materialised value is rounded to (weights,
      activations, residual stream, K/V cache entries, logits).
    - ``accum``: the format every running sum is held in (products and adds are
      rounded to it after every operation).
    - ``order``: the summation order of every reduction (matmul dots, attention
      scores, softmax sum, weighted sum of values, RMSNorm mean).
    - ``attention``: how attention combines its keys (:mod:`kvfast.kernels.attention`):
      ``standard`` (one softmax over the row, the default), ``online`` (flash
      attention: blocks of ``attn_block`` keys aligned to absolute positions,
      running max and sum), ``splitkv`` (flash-decoding: chunks of ``attn_block``
      keys aligned to absolute positions, combined by log-sum-exp weights) or
      ``splitcount`` (split-KV into ``attn_block`` chunks of the call's current
      key range, so the boundaries move as the cache grows). Inside a block the
      sums follow ``order``.
    - ``attn_block``: the block size (``online``, ``splitkv``) or number of
      splits (``splitcount``); 0 picks :data:`DEFAULT_ATTN_BLOCK`; must be 0 for
      ``standard``.

    Invalid values raise ``ValueError`` naming the field, the value and what is allowed.
    """

    storage: str = "f64"
    accum: str = "f64"
    order: str = "sequential"
    attention: str = "standard"
    attn_block: int = 0

    def __post_init__(self) -> None:
        require_choice(self.storage, "storage", FORMAT_CODES)
        require_choice(self.accum, "accum", FORMAT_CODES)
        require_choice(self.order, "order", ORDER_CODES)
        require_choice(self.attention, "attention", ATTENTION_CODES)
        block = require_int(self.attn_block, "attn_block", 0)
        if self.attention == "standard" and block != 0:
            raise ValueError(f"attn_block: {block!r} is not allowed with attention='standard'; allowed: 0")
        object.__setattr__(self, "attn_block", block if block else DEFAULT_ATTN_BLOCK[self.attention])

    @classmethod
    def preset(cls, name: str, order: str = "sequential", attention: str = "standard", attn_block: int = 0) -> Numerics:
        """``f64`` = f64/f64, ``f32`` = f32/f32, ``bf16`` = bf16 storage with an f32 accumulator."""
        require_choice(name, "preset", PRESETS)
        storage, accum = PRESETS[name]
        return cls(storage=storage, accum=accum, order=order, attention=attention, attn_block=attn_block)

    @property
    def codes(self) -> Formats:
        """``(storage, accum, order)`` as kernel codes."""
        return Formats(FORMAT_CODES[self.storage], FORMAT_CODES[self.accum], ORDER_CODES[self.order])

    @property
    def attention_codes(self) -> tuple[int, int]:
        """``(attention mode, attn_block)`` as kernel codes."""
        return ATTENTION_CODES[self.attention], self.attn_block

    @property
    def name(self) -> str:
        """A short label such as ``bf16/f32/pairwise`` (``.../online4`` with a real kernel's attention)."""
        base = f"{self.storage}/{self.accum}/{self.order}"
        return base if self.attention == "standard" else f"{base}/{self.attention}{self.attn_block}"
