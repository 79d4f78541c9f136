"""Control mode: is the cache's deviation rounding, a bug, or inconclusive?

This is the one place in kvfast with a tolerance, and the tolerance is
measured, not chosen: the model's own order noise, and never less than what
the logits' format can resolve.

Method
------
Where prefill and decode run different kernels (a batched matrix product
against a one-row product, another attention kernel, another split of the
keys), the cache path sums in another order than the recompute and an exact
check flags rounding. Control mode measures how far computations that differ
ONLY in how they add up land from the reference rows (the recompute):

1. ``recompute_variants`` (the model's optional hook), computed once on the
   final sequence: full recomputes batched differently, in another kernel's
   order, never through the cache. kvfast builds them for Hugging Face models
   (:mod:`kvfast.check.hf`: the other attention implementation, a batch of
   two, every linear layer one row at a time); kvfast's own adapter offers the
   recompute in its decode numerics.
2. batch shape, when the recompute is not append-invariant (its rows depend
   on how many rows the batch has): a few prefix recomputes against the same
   rows of the reference (the fast path), or the whole-sequence recompute
   against the per-step references (``fast=False``).

The noise is POOLED over the run, relative to the logits' magnitude: with
``scale[p] = max |reference row p|`` and ``noise[p]`` the largest deviation of
any source at position ``p``, ``rel = max_p noise[p] / scale[p]``. Order noise is
a random draw at each position and one draw can be a lucky zero; the largest
relative draw over every measured position is a level every position can
reach. A step (step 0: the prompt rows it covers; step ``t``: one decode row)
is judged against

    bound[t] = max(rel * scale[t], ulp(format, scale[t]))

where ``ulp(format, x)`` is the spacing of the logits' own format (bfloat16,
float16, float32 or float64, read from what the model returns) at magnitude
``x``: a deviation of one unit in the last place of the logits is never more
than rounding, and the bound is never 0, so the ratio ``deviation / bound`` is
always finite. Verdicts per step: ``rounding`` when ``ratio <= margin``
(default 4), ``bug`` when ``ratio > decisive`` (default 16), ``inconclusive``
between. A scenario's verdict is its worst step's. Each step's report names
the source that set its bound (``floor_source``).

The noise is measured in :mod:`kvfast.check.reference` (:func:`~kvfast.check.reference.order_noise`);
this module judges against it.

Measured (the ``hf_matrix`` study, ``kvfast study hf_matrix``, gives the matrix and its rates): see
docs/check.md, section "Rounding or bug?".

Limits
------
- The floor is only as good as the control computations: a cache path whose
  order noise is larger than every variant's (another kernel nobody mirrored)
  can reach ``inconclusive`` or ``bug`` on a correct model; give the model a
  variant in that kernel's order, or raise ``decisive``.
- The control computations must not go through the cache: a variant computed
  with the cache under test would carry its bug into the floor and hide it.
- A bug whose effect is within ``margin`` times the order noise is called
  ``rounding``, and one within ``decisive`` times ``inconclusive``: in
  bfloat16 many real bugs move logits by a few units in the last place only.
  The logic check (``promote="float64"``) runs the same model in float64, where
  the order noise is ~1e-16 relative and such bugs stand out by many orders.
  Exact mode has no such blind spot: use it wherever prefill and decode can
  share one order.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_MARGIN = 4.0
DEFAULT_DECISIVE = 16.0
VERDICTS = ("rounding", "lossy", "inconclusive", "bug")  # lossy: a quantized cache within its format

#: Precision (significand bits, implicit bit included) and smallest normal of each logits format.
FORMATS: dict[str, tuple[int, float]] = {
    "bfloat16": (8, 2.0**-126),
    "float16": (11, 2.0**-14),
    "float32": (24, 2.0**-126),
    "float64": (53, 2.0**-1022),
}


def check_margin(margin: object, field: str = "margin", minimum: float = 1.0) -> float:
    ok = not isinstance(margin, bool) and isinstance(margin, int | float | np.integer | np.floating)
    if not ok or not math.isfinite(margin) or margin < minimum:
        raise ValueError(f"{field}: {margin!r} is not allowed; allowed: a finite number >= {minimum:g}")
    return float(margin)


def ulp(fmt: str, magnitude: np.ndarray | float) -> np.ndarray:
    """The spacing of format ``fmt`` at ``magnitude`` (at least the spacing of its smallest normal)."""
    bits, tiny = FORMATS[fmt]
    m = np.maximum(np.abs(np.asarray(magnitude, dtype=np.float64)), tiny)
    return np.ldexp(1.0, (np.frexp(m)[1] - 1) - (bits - 1))


#: How far rounding alone may move a row of a recompute when the same rows are computed in a batch of another
#: length, in units in the last place of the row's largest logit in its lowest internal format (see
#: :func:`length_ceiling` and docs/check.md, "A recompute that depends on the length").
LENGTH_ULPS = 64.0


def lowest_format(fmt: str) -> str:
    """The lowest precision a model whose logits come in ``fmt`` may compute in inside: ``float32`` for
    ``float64`` logits (eager attentions run their softmax in float32 inside a float64 model: Llama, Bloom),
    else ``fmt`` itself."""
    return "float32" if fmt == "float64" else fmt


def length_ceiling(fmt: str, scale: np.ndarray | float) -> np.ndarray:
    """The largest deviation rounding can explain between a row of ``recompute(prefix)`` and the same row of
    ``recompute(longer)`` whose largest logit is ``scale``: :data:`LENGTH_ULPS` units in the last place of
    ``scale`` in :func:`lowest_format` (``fmt``)."""
    return LENGTH_ULPS * ulp(lowest_format(fmt), scale)


def pooled_noise(sources: dict[str, np.ndarray], scale: np.ndarray) -> tuple[float, str]:
    """``(rel, where)``: the largest ``noise / scale`` over every source and position, and what set it."""
    best, where = 0.0, "none measured"
    safe = np.where(scale > 0, scale, np.inf)
    for name, noise in sources.items():
        rel = noise / safe
        p = int(np.argmax(rel))
        if rel[p] > best:
            best, where = float(rel[p]), f"{name} at position {p}"
    return best, where


def judge(
    deviation: np.ndarray,
    scale: np.ndarray,
    rel: float,
    where: str,
    fmt: str,
    margin: float,
    decisive: float,
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], tuple[str, ...]]:
    """``(bound, ratio, verdicts, floor_sources)`` per step (see the module doc); every ratio is finite."""
    noise = rel * scale
    res = ulp(fmt, scale)
    bound = np.maximum(noise, res)
    with np.errstate(over="ignore"):
        ratio = np.minimum(deviation / bound, np.finfo(np.float64).max)
    verdicts = tuple("rounding" if r <= margin else "bug" if r > decisive else "inconclusive" for r in ratio)
    sources = tuple(
        f"order noise ({where}, {rel:.3g} relative)" if noise[t] >= res[t] else f"{fmt} resolution (1 ulp)"
        for t in range(deviation.shape[0])
    )
    return bound, ratio, verdicts, sources


def worst(verdicts) -> str:
    """The worst of control verdicts (``bug`` > ``inconclusive`` > ``rounding``)."""
    return max(verdicts, key=VERDICTS.index) if verdicts else "rounding"
