"""How a claim is judged: a list of named conditions, all of which must hold.

Every claim of every study is built with :func:`judged`: the claim's words, the
seed's figure, kvfast's figure, the *kind* of its criterion, and the conditions
evaluated on the stored results, each ``(words, result)``. The claim holds when
every condition does; its criterion in words is the kind followed by the
conditions' words. The verifier count of ``kvfast reproduce`` is the number of
conditions evaluated over all claims, and how many of them hold.

Kinds:

- :data:`EXACT`: a bit-equality or exact-count statement (``== 0.0``, every run);
- :data:`VS_SEED`: a measured figure against the seed's, within a stated tolerance;
- :data:`DIRECTION`: only the sign of a difference is checked, not its size
  (labelled so in every claims table);
- :data:`TEST`: a statistical test at a stated level;
- :data:`BOUND`: a numerical error within a stated bound (where exactness is not the claim, as for
  central differences).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvfast.sweep.study import Claim

EXACT = "exact"
VS_SEED = "vs seed"
DIRECTION = "direction only"
TEST = "test"
BOUND = "bound"
KINDS = (EXACT, VS_SEED, DIRECTION, TEST, BOUND)


def judged(
    claim: str, seed_figure: str, kvfast_figure: str, kind: str, conditions: Sequence[tuple[str, bool]]
) -> Claim:
    """A :class:`Claim` that holds when every one of ``conditions`` (``(words, result)``) holds.

    ``kind`` is one of :data:`KINDS`. A claim with no condition does not hold.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not allowed; allowed: {', '.join(KINDS)}")
    conds = tuple((str(text), bool(ok)) for text, ok in conditions)
    holds = bool(conds) and all(ok for _, ok in conds)
    criterion = f"{kind}: " + "; ".join(text for text, _ in conds)
    return Claim(claim, seed_figure, kvfast_figure, holds, criterion, conds)


def within(value: float, target: float, tolerance: float) -> bool:
    """``|value - target| <= tolerance`` (False for NaN)."""
    return bool(abs(value - target) <= tolerance)


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pair counts (``a`` flipped and ``b`` did not,
    and the other way round): ``min(1, 2 P[X <= min(a, b)])`` for ``X ~ Binomial(a + b, 1/2)``;
    1.0 when there is no discordant pair."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2.0 * tail)
