"""The number formats inside a model under test, and the noise they can explain (issue 18, rules 1, 3, 4).

Control mode judges a cache's deviation against order noise (:mod:`kvfast.check.control`). How much
noise is rounding depends on the LOWEST precision anywhere in the computation, not only on the
logits' format: a float16 KV cache, int8 activations or a float32 softmax inside a float64 model
round more coarsely than the logits show. This module holds

- :data:`FORMATS`: every format kvfast knows, with its precision in bits (significand bits, the
  implicit bit included) and the smallest magnitude its spacing is measured at;
- :class:`NoiseFormats`: the formats one check works with: the format that sets the floor of every
  step's bound (``floor``: 1 unit in the last place of it), the format whose rounding sets the
  admission ceiling of every order-noise source and the length ceiling (``ceiling``:
  :data:`CEILING_ULPS` units of it), and where they came from (``declared`` by the model's
  ``internal_formats`` attribute, ``measured`` by its adapter, or ``assumed``);
- :func:`noise_formats`: those formats for a model under test and its logits' format;
- :func:`admission`: rule 1, which order-noise sources can be rounding at all.

The admission ceiling
---------------------
Two computations of the same row that differ only in how they add up (another batch shape,
another kernel's order) land a few units in the last place apart in the format they round in. A
source may raise the bound only if, at every position, ``noise[p] <= CEILING_ULPS *
ulp(ceiling format, scale[p])`` (``scale[p]``: the row's largest logit). :data:`CEILING_ULPS` = 64:
measured stock models' sources stay within 2.3 units (float32 and float64 Llama, sdpa and eager;
2 bfloat16 units), a 28x margin for deeper models and longer sums, while the smallest logical
difference measured (dynamic NTK crossing its limit, 5.4e-5 in float32) is 28x above it. A source
above it is not order noise: the report notes it with its size, the ceiling and why.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from kvfast.check.protocol import read_attribute

#: Precision in bits (significand bits, implicit bit included) and the smallest magnitude at which the format's
#: spacing is measured (its smallest normal; the scaled formats, int8 and float8, carry a per-tensor or per-block
#: scale, so only their relative spacing counts: float32's smallest normal). int8: 127 steps over a tensor's
#: range, a step of 1/127 of its largest value, counted as 7 bits (a spacing of 2^-6 to 2^-7 of the value,
#: never below one step).
FORMATS: dict[str, tuple[int, float]] = {
    "float8_e5m2": (3, 2.0**-126),
    "float8_e4m3": (4, 2.0**-126),
    "int8": (7, 2.0**-126),
    "bfloat16": (8, 2.0**-126),
    "float16": (11, 2.0**-14),
    "float32": (24, 2.0**-126),
    "float64": (53, 2.0**-1022),
}

#: The scaled formats (a scale per tensor, row or block): a KV cache stored in one of them is quantized, an
#: approximation by design (a lossy cache: the model's ``lossy_cache``), never order noise.
SCALED = ("int8", "float8_e4m3", "float8_e5m2")

#: How many units in the last place of the ceiling format order noise may reach (see the module doc).
CEILING_ULPS = 64.0


def ulp(fmt: str, magnitude: np.ndarray | float) -> np.ndarray:
    """The spacing of format ``fmt`` (:data:`FORMATS`) at ``magnitude``."""
    bits, tiny = FORMATS[fmt]
    m = np.maximum(np.abs(np.asarray(magnitude, dtype=np.float64)), tiny)
    return np.ldexp(1.0, (np.frexp(m)[1] - 1) - (bits - 1))


def ceiling(fmt: str, scale: np.ndarray | float) -> np.ndarray:
    """The largest deviation rounding in ``fmt`` can explain at rows whose largest logit is ``scale``:
    :data:`CEILING_ULPS` units in the last place of ``fmt`` at ``scale``."""
    return CEILING_ULPS * ulp(fmt, scale)


#: How far rounding alone may move a row of a recompute when the same rows are computed in a batch of another
#: length, in units in the last place of the row's largest logit in its lowest internal format (see
#: :func:`length_ceiling` and docs/check.md, "A recompute that depends on the length").
LENGTH_ULPS = 64.0


def lowest_format(fmt: str) -> str:
    """The lowest precision a model whose logits come in ``fmt`` may compute in inside, when it declares none:
    ``float32`` for ``float64`` logits (eager attentions run their softmax in float32 inside a float64 model:
    Llama, Bloom), else ``fmt`` itself."""
    return "float32" if fmt == "float64" else fmt


def length_ceiling(fmt: str, scale: np.ndarray | float) -> np.ndarray:
    """The largest deviation rounding can explain between a row of ``recompute(prefix)`` and the same row of
    ``recompute(longer)`` whose largest logit is ``scale``: :data:`LENGTH_ULPS` units in the last place of
    ``scale`` in :func:`lowest_format` (``fmt``)."""
    return LENGTH_ULPS * ulp(lowest_format(fmt), scale)


def lowest(formats) -> str:
    """The format of least precision among ``formats`` (names of :data:`FORMATS`)."""
    return min(formats, key=lambda f: FORMATS[f][0])


def check_internal_formats(value: object, field: str = "model.internal_formats") -> dict[str, str]:
    """``value`` (a model's ``internal_formats``: ``{what: format}``) validated; ``ValueError`` naming the
    field and the allowed formats otherwise."""
    allowed = f"a dict {{what: format}} with formats {', '.join(FORMATS)}"
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: {value!r} is not allowed; allowed: {allowed}")
    out = {}
    for what, fmt in value.items():
        if not isinstance(what, str) or not isinstance(fmt, str) or fmt not in FORMATS:
            raise ValueError(f"{field}: {{{what!r}: {fmt!r}}} is not allowed; allowed: {allowed}")
        out[what] = fmt
    return out


def quantized_cache(internal: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``internal`` (a model's ``internal_formats``, validated) that store the KV cache
    (``what`` contains ``cache`` or the word ``kv``) in a scaled format (:data:`SCALED`): a quantized
    cache, lossy by design (declare it with ``lossy_cache``), not a format whose rounding is order noise."""
    return {
        what: fmt
        for what, fmt in internal.items()
        if fmt in SCALED and ("cache" in what.lower() or "kv" in re.split(r"[^a-z0-9]+", what.lower()))
    }


@dataclass(frozen=True)
class NoiseFormats:
    """The formats one control check works with (see the module doc).

    ``logits``: the logits' format; ``internal``: ``{what: format}`` declared or measured (empty when
    assumed); ``source``: ``declared``, ``measured`` or ``assumed``; ``floor``: the format whose 1 ulp
    is the least bound of every step; ``ceiling``: the format whose :data:`CEILING_ULPS` ulps admit an
    order-noise source (and bound a recompute's length dependence)."""

    logits: str
    internal: dict[str, str]
    source: str
    floor: str
    ceiling: str
    probe: str | None = None
    probed: bool = False

    def after_probe(self, admitted: Mapping[str, np.ndarray] | None) -> NoiseFormats:
        """These formats once the order noise is known: when the model's rounding probe (``probe``, a variant that
        moves every value computed in the lowest internal format by one unit of it) was measured and admitted,
        that format's effect on the logits is measured, not assumed, and the floor falls to the lowest of the
        other formats (the logits' included); else unchanged."""
        if self.probe is None or not admitted or f"variant {self.probe!r}" not in admitted:
            return self
        low = lowest(self.internal.values())
        rest = [self.logits, *(f for f in self.internal.values() if f != low)]
        return replace(self, floor=lowest(rest), probed=True)

    def line(self) -> str:
        """One phrase: the lowest internal format, what computes in it and where that came from."""
        if self.source == "assumed":
            return f"{self.floor} (assumed: the logits' format; admission ceiling in {self.ceiling})"
        if self.probed:
            inside = [w for w, f in self.internal.items() if f == self.ceiling]
            return (
                f"{self.ceiling} ({self.source}: {', '.join(inside)}; its rounding measured by the variant "
                f"{self.probe!r}, the floor in {self.floor})"
            )
        inside = [w for w, f in sorted(self.internal.items()) if f == self.floor]  # what computes in the floor format
        return f"{self.floor} ({self.source}: {', '.join((['logits'] if self.floor == self.logits else []) + inside)})"

    def cache_note(self) -> str | None:
        """The note a report carries when the internal formats hold a quantized cache (:func:`quantized_cache`),
        else ``None``."""
        found = quantized_cache(self.internal)
        if not found:
            return None
        what, fmt = next(iter(found.items()))
        return (
            f"internal_formats puts the KV cache in {fmt} ({what!r}): a quantized cache is lossy by design, not "
            f"order noise, yet it is judged here as rounding inside the model (the floor and the admission "
            f"ceiling in {self.floor}), which can pass a cache worse than its format allows; declare it as "
            f"lossy_cache = {'int8' if fmt == 'int8' else 'fp8'!r} with lossless() instead, to have every step "
            "judged lossy against the format's expected error"
        )

    def note(self) -> str | None:
        """The note a report carries when the formats were assumed, else ``None``."""
        if self.source != "assumed":
            return None
        return (
            f"the model declares no internal formats (internal_formats) and kvfast measured none: assumed it computes "
            f"in its logits' {self.logits} inside (the floor of every bound: 1 {self.logits} ulp), admitted "
            f"batch-shape noise up to {CEILING_ULPS:g} {self.ceiling} ulps"
            + (" (a float64 model may run a float32 softmax inside)" if self.ceiling != self.logits else "")
            + " and its recompute_variants as they are; declare internal_formats ({what: format}) to have every "
            "noise source tested against what rounding can produce"
        )


def noise_formats(logits: str, internal: Mapping[str, str] | None, source: str = "declared") -> NoiseFormats:
    """The :class:`NoiseFormats` of a model whose logits come in ``logits`` and whose ``internal`` formats
    (``None``: unknown) come from ``source`` (``declared`` or ``measured``)."""
    if internal is None:
        return _assumed(logits)
    internal = check_internal_formats(internal)
    low = lowest([logits, *internal.values()])
    return NoiseFormats(logits, dict(internal), source, low, low)


@functools.lru_cache(maxsize=16)
def _assumed(logits: str) -> NoiseFormats:
    """The formats of a model that declares none, whose logits come in ``logits`` (one object per format: a
    :class:`NoiseFormats` is never changed, only replaced)."""
    return NoiseFormats(logits, {}, "assumed", logits, lowest_format(logits))  # the ceiling: what may be inside


def formats_of(model: object, logits: str) -> NoiseFormats:
    """``model``'s :class:`NoiseFormats`: its ``internal_formats`` attribute (``{what: format}``; source
    ``declared``, or what its optional ``internal_formats_source`` attribute says, e.g. ``measured``; ``None``
    or absent: ``assumed``). Each attribute is read as the model's code
    (:func:`~kvfast.check.protocol.read_attribute`: what it raises is the model's failure). ``ValueError`` when
    the model declares its cache quantized both ways: lossy (``lossy_cache``) and a scaled internal format
    (:func:`quantized_cache`); a quantized cache is ``lossy_cache``."""
    internal = read_attribute(model, "internal_formats")
    if internal is None:
        return noise_formats(logits, None)
    source = read_attribute(model, "internal_formats_source")
    source = source if isinstance(source, str) and source in ("declared", "measured") else "declared"
    probe = read_attribute(model, "rounding_probe")
    found = noise_formats(logits, internal, source)
    cache, both = read_attribute(model, "lossy_cache"), quantized_cache(found.internal)
    if isinstance(cache, str) and cache and both:
        raise ValueError(
            f"model.internal_formats: {both!r} declares the cache quantized, and model.lossy_cache declares it "
            f"lossy ({cache!r}); allowed: a quantized cache as lossy_cache alone (its rounding is not order "
            "noise), internal_formats for the formats the model computes in"
        )
    return replace(found, probe=probe) if isinstance(probe, str) else found


@dataclass(frozen=True)
class Refused:
    """An order-noise source not admitted: its largest relative deviation ``rel`` at ``position``, and the
    ceiling there (absolute ``limit``, ``limit_rel`` relative)."""

    name: str
    rel: float
    position: int
    limit: float
    limit_rel: float

    def line(self, fmt: NoiseFormats, why: str) -> str:
        return (
            f"{self.name} ({self.rel:.3g} relative) not admitted: above what {fmt.ceiling} rounding can produce "
            f"({CEILING_ULPS:g} ulps, {self.limit_rel:.3g} relative at position {self.position}); {why}"
        )


def admission(
    sources: Mapping[str, np.ndarray], scale: np.ndarray, fmt: NoiseFormats
) -> tuple[dict[str, np.ndarray], list[Refused]]:
    """Rule 1: ``(admitted, refused)``. A source (per-position deviation from the reference rows whose largest
    logits are ``scale``) is admitted only if it stays within :func:`ceiling` (``fmt.ceiling``) at every
    position. When the formats are ``assumed`` (nothing declared or measured), only the batch-shape sources
    are tested (what kvfast did before internal formats were known): a model's own variants may then compute
    in a format nobody named, and refusing them would call a correct model a bug (:meth:`NoiseFormats.note`)."""
    limit = ceiling(fmt.ceiling, scale)
    safe = np.where(scale > 0, scale, np.inf)
    admitted, refused = {}, []
    for name, noise in sources.items():
        over = noise / limit
        p = int(np.argmax(over))
        tested = fmt.source != "assumed" or name.startswith("batch shape")
        if tested and over[p] > 1.0:
            rel = noise / safe
            refused.append(Refused(name, float(rel.max()), p, float(limit[p]), float(limit[p] / safe[p])))
        else:
            admitted[name] = noise
    return admitted, refused
