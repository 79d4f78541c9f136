"""The lossy cache formats kvfast emulates (:mod:`kvfast.check.lossy`), NumPy only: a leaf module, so that
both kvfast's own lossy cache and the Hugging Face adapter's emulation (:func:`kvfast.check.hf.wrap_round_trip`) use
the one round trip."""

from __future__ import annotations

import numpy as np

#: Lossy cache formats kvfast emulates: ``{name: (description, expected relative error per value)}``.
LOSSY_FORMATS: dict[str, tuple[str, float]] = {
    "int8": ("symmetric int8 per row, scale absmax / 127", 0.5 / 127),
    "fp8": ("float8 e4m3 per row, scale absmax / 448", 2.0**-4),
    # transformers' fp8 QuantizedCache: one scale per layer's keys (and values), from the first store
    "fp8-tensor": ("float8 e4m3, one scale per tensor (absmax / 448) frozen at the first store", 2.0**-4),
}
#: The formats kvfast's own cache takes (``fp8-tensor`` needs a frozen scale: the Hugging Face emulation's).
ROW_FORMATS = ("int8", "fp8")
FP8_MAX = 448.0


def _int_round_trip(x: np.ndarray, levels: int) -> np.ndarray:
    scale = np.abs(x).max(axis=-1, keepdims=True) / levels
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(x / safe), -levels, levels) * safe


def _fp8_round_trip(x: np.ndarray, scale: np.ndarray | float | None = None) -> np.ndarray:
    if scale is None:
        scale = np.abs(x).max(axis=-1, keepdims=True) / FP8_MAX
    y = x / np.where(scale > 0, scale, 1.0)
    _, e = np.frexp(y)  # |y| in [2^(e-1), 2^e): 3 mantissa bits space it 2^(e-4); subnormals 2^-9
    spacing = np.ldexp(1.0, np.maximum(e, -5) - 4)
    return np.clip(np.round(y / spacing) * spacing, -FP8_MAX, FP8_MAX) * np.where(scale > 0, scale, 1.0)


def round_trip(fmt: str, x: np.ndarray, scale: float | None = None) -> np.ndarray:
    """``x`` (float64, rows on the last axis) stored in format ``fmt`` and read back (``fp8-tensor``: with
    the given ``scale``; values beyond 448 scales saturate)."""
    if fmt == "fp8-tensor":
        if scale is None:
            raise ValueError("scale: None is not allowed for fmt 'fp8-tensor'; allowed: the tensor's frozen scale")
        return _fp8_round_trip(x, scale)
    if fmt == "fp8":
        return _fp8_round_trip(x)
    # int8 (127 levels); int4 (kvfast.bugs.lossy) and the other widths of quanto and HQQ
    if fmt.startswith("int") and fmt[3:].isdigit() and 2 <= int(fmt[3:]) <= 8:
        return _int_round_trip(x, 2 ** (int(fmt[3:]) - 1) - 1)
    raise ValueError(f"fmt: {fmt!r} is not allowed; allowed: {', '.join(LOSSY_FORMATS)}")
