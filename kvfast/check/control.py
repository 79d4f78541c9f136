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
   against the per-step references (``fast=False``). The prefix lengths are
   odd (:func:`prefix_length`; "Odd prefix lengths" below).

The noise is POOLED over the run, relative to the logits' magnitude: with
``scale[p] = max |reference row p|`` and ``noise[p]`` the largest deviation of
any source at position ``p``, ``rel = max_p noise[p] / scale[p]``. Order noise is
a random draw at each position and one draw can be a lucky zero; the largest
relative draw over every measured position is a level every position can
reach. A step (step 0: the prompt rows it covers; step ``t``: one decode row)
is judged against

    bound[t] = max(g * rel * scale[t], ulp(format, scale[t]))

(``g``: the steps factor, below), where ``ulp(format, x)`` is the spacing of the logits' own format (bfloat16,
float16, float32 or float64, read from what the model returns) at magnitude
``x``: a deviation of one unit in the last place of the logits is never more
than rounding, and the bound is never 0, so the ratio ``deviation / bound`` is
always finite. Verdicts per step: ``rounding`` when ``ratio <= margin``
(default 4), ``bug`` when ``ratio > decisive`` (default 16), ``inconclusive``
between. A scenario's verdict is its worst step's. Each step's report names
the source that set its bound (``floor_source``).

Odd prefix lengths (the plain protocol's only noise source)
-----------------------------------------------------------
A model with no ``recompute_variants`` gives control mode nothing but its
recompute, so the batch-shape draws must reach the decode's kind of noise.
A reduction over the keys is split by its kernel into lanes plus a tail
whose size depends on the number of keys in the batch: NumPy's sum (the
softmax's denominator here) adds eight interleaved lanes and then the last
``n mod 8`` terms in sequence. Row ``p`` of a causal batch has zeros past key
``p``, so when both lengths are multiples of 8 its non-zero terms fall in
the same lanes and the row comes out bit for bit the same. With every prefix
length a multiple of 8 (a prompt of 8 or 16 tokens and 32 or 64 steps:
lengths 16, 24, 32, 40 against 48) the prefix recomputes equalled the whole
recompute, the recompute looked append-invariant, NO noise was measured, and
the correct one-row decode (up to 9 float32 units off the batched rows) was
judged against one unit: ``inconclusive`` (issue 18). An odd length leaves
a tail for every lane count that is even, so the rows that reach into it
are summed in another order: a draw of the order noise a reduction over
another number of keys (the decode's) makes. Each prefix is still the
true prefix at its true positions (a permuted batch would change positions).
The invariance check's prefix is odd too, so exact mode also sees such a
recompute as what it is (not append-invariant) and goes per step.

The steps factor ``g``
----------------------
``rel`` is the largest of ``M`` draws (:func:`noise_draws`: the ``(source,
position)`` pairs whose deviation is not 0; a 0 is a row a source computed in
the reference's own order, no draw of the noise). A scenario compares ``S``
reference rows (step 0's prompt rows and one per decode step), each a draw of
the cache path's noise. Were both samples of one distribution, the largest of
``S`` would still exceed the largest of ``M`` with probability ``S / (S + M)``,
by a factor growing with ``S / M``; an odd prefix of an otherwise aligned
batch yields only the rows in its tail (often one), so ``M = 3`` against ``S =
65`` happens. The rounding error of a long sum is close to Gaussian (a sum of
many independent rounding errors), so ``|noise|`` is half-normal; the median of
the largest of ``N`` half-normal draws is ``m(N) = Phi^-1((1 + 2^(-1/N)) / 2)``
and the pooled noise is scaled by ``g = max(1, m(S) / m(M))`` (:func:`steps_factor`):
1 when ``M >= S`` (every model with variants at every position: Hugging Face
models, kvfast's own), 2.02 for ``S = 65, M = 3``, at most ``m(S) / m(1)``
(3.8 at ``S = 65``). Why it cannot hide a bug where the old bound did not: it
only scales noise that was measured and admitted (``M = 0`` leaves the bound
at the format's resolution), it grows like ``sqrt(log S)``, and where noise was
measured at every position it is 1: the catalogue margins are unchanged
(``benchmarks/control_margin.py``, figures in docs/check.md).

The noise is measured in :mod:`kvfast.check.reference` (:meth:`~kvfast.check.reference.SharedReference.order_noise`);
this module judges against it.

Measured (the ``hf_matrix`` study, ``kvfast study hf_matrix``, gives the matrix and its rates): see
docs/check.md, section 3 "The modes" (the method in words: "How a step is judged against order noise").

Limits
------
- The floor is only as good as the control computations: a cache path whose
  order noise is larger than every variant's (another kernel nobody mirrored)
  can reach ``inconclusive`` or ``bug`` on a correct model; give the model a
  variant in that kernel's order, or raise ``decisive``.
- The plain protocol's noise is the batch shape alone: a recompute that is
  invariant at every length (each row computed alone, or every length padded
  to the lanes) while the decode runs another kernel gives no draw, and the
  bound stays at the format's resolution: offer ``recompute_variants``. A
  kernel whose lane count is odd need not leave a tail at an odd length.
  The half-normal model is an assumption: noise with a heavier tail
  (a near-tie in a softmax, a cancellation) can pass ``g * rel``, which the
  ``margin`` (4) absorbs; measured on the batched-prefill example the largest
  clean ratio is 2.74 over 200 float32 runs (docs/check.md).
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
from statistics import NormalDist

import numpy as np

from kvfast.check.formats import ulp  # the formats and their spacing: kvfast.check.formats owns rounding

DEFAULT_MARGIN = 4.0
DEFAULT_DECISIVE = 16.0
VERDICTS = ("rounding", "lossy", "inconclusive", "bug")  # lossy: a quantized cache within its format


def check_margin(margin: object, field: str = "margin", minimum: float = 1.0) -> float:
    ok = not isinstance(margin, bool) and isinstance(margin, int | float | np.integer | np.floating)
    if not ok or not math.isfinite(margin) or margin < minimum:
        raise ValueError(f"{field}: {margin!r} is not allowed; allowed: a finite number >= {minimum:g}")
    return float(margin)


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


def noise_draws(sources: dict[str, np.ndarray]) -> int:
    """How many draws of order noise ``sources`` hold: the ``(source, position)`` pairs whose deviation is not 0
    (a 0 is a row the source computed exactly as the reference did, not a draw of the noise)."""
    return int(sum(np.count_nonzero(v) for v in sources.values()))


def _median_max(n: int) -> float:
    """The median of the largest of ``n`` independent half-normal draws (standard scale):
    ``Phi^-1((1 + 2^(-1/n)) / 2)``."""
    return NormalDist().inv_cdf((1.0 + 2.0 ** (-1.0 / n)) / 2.0)


def steps_factor(compared: int, draws: int) -> float:
    """How far the largest of ``compared`` rows' order noise may typically exceed the largest of ``draws``
    measured draws: ``median_max(compared) / median_max(draws)`` for half-normal noise, at least 1 (1 when
    nothing was measured or ``draws >= compared``); see the module doc."""
    if draws <= 0 or compared <= draws:
        return 1.0
    return max(1.0, _median_max(compared) / _median_max(draws))


def prefix_length(q: int) -> int:
    """The length a prefix recompute of about ``q`` tokens uses: odd (``q | 1``), so that a reduction over its
    keys split into an even number of lanes has a tail and its last rows add up in another order than in a
    longer batch (see the module doc)."""
    return q | 1


def judge(
    deviation: np.ndarray,
    scale: np.ndarray,
    rel: float,
    where: str,
    fmt: str,
    margin: float,
    decisive: float,
    compared: int | None = None,
    draws: int | None = None,
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], tuple[str, ...]]:
    """``(bound, ratio, verdicts, floor_sources)`` per step (see the module doc); every ratio is finite.

    ``compared`` (the reference rows the steps cover) and ``draws`` (:func:`noise_draws`) scale the pooled
    noise by :func:`steps_factor`; without them the factor is 1."""
    factor = 1.0 if compared is None or draws is None else steps_factor(compared, draws)
    noise = factor * rel * scale
    res = ulp(fmt, scale)
    bound = np.maximum(noise, res)
    with np.errstate(over="ignore"):
        ratio = np.minimum(deviation / bound, np.finfo(np.float64).max)
    verdicts = tuple("rounding" if r <= margin else "bug" if r > decisive else "inconclusive" for r in ratio)
    scaled = "" if factor == 1.0 else f", x{factor:.3g} for {compared} rows against {draws} draws"
    sources = tuple(
        f"order noise ({where}, {rel:.3g} relative{scaled})" if noise[t] >= res[t] else f"{fmt} resolution (1 ulp)"
        for t in range(deviation.shape[0])
    )
    return bound, ratio, verdicts, sources


def worst(verdicts) -> str:
    """The worst of control verdicts (``bug`` > ``inconclusive`` > ``rounding``)."""
    return max(verdicts, key=VERDICTS.index) if verdicts else "rounding"
