"""Control mode: is the cache's deviation rounding or a bug?

This is the one place in kvfast with a tolerance, and the tolerance is
measured, not chosen: it is the model's own order-noise floor.

Method
------
Where prefill and decode run different kernels (a batched matrix product
against a one-row product, another split of the keys), the cache path sums in
another order than the recompute and an exact check flags rounding. Control
mode measures, at every position, how far computations that differ ONLY in how
they add up land from the reference recompute:

1. ``recompute_variants`` (the model's optional hook): full recomputes of the
   same tokens batched differently, or in the decode kernel's order, never
   through the cache. kvfast's own adapter offers the recompute in its decode
   numerics; the NumPy reference model offers a one-row-at-a-time recompute.
2. batch shape: when the model's recompute is not append-invariant (its rows
   depend on how many rows the batch has, as with BLAS matrix products), the
   per-step references ``recompute(prefix)[-1]`` are compared with the rows of
   ``recompute(whole sequence)``.

``floor[t]`` is the largest of these deviations at step ``t`` (step 0: over
every prompt row). Order noise is a random draw at each position, and one draw
can be a lucky zero (the batch-shape source is even zero by construction at the
last step, where the prefix is the whole sequence), so a step is judged against

    bound[t] = max(largest floor within ``window`` steps of t, median floor over all steps)

(default window 2: five steps). A step is ``rounding`` when
``deviation[t] <= margin * bound[t]`` and ``bug`` otherwise, with
``ratio[t] = deviation[t] / bound[t]`` (``0`` for a zero deviation, ``inf`` when
the bound is 0 and the deviation is not). The default margin is 4. Measured
on 6 random models (d_model 32, 2 layers, prompt of 7, 30 decode steps; the
script is the control tests' setup): correct models whose cache path adds up
differently from their recompute reached ratios of at most 2 (kvfast's model
with a pairwise prefill and a sequential decode, f32 and bf16 storage with a
bf16 accumulator; an independent float32 NumPy model, whole-matrix recompute
against one-row decode, with or without its one-row variant), while every
catalogue bug reached a ratio of at least 7.1 (bf16 accumulator) and 4e5
(float32). The margin sits between; the gap is narrowest in bfloat16.

Limits
------
- The floor is only as good as the control computations. A model with an
  append-invariant recompute and no ``recompute_variants`` has floor 0: control
  mode then says ``bug`` for any deviation (it reduces to exact mode), and the
  report notes it.
- The control computations must not go through the cache: a variant computed
  with the cache under test would carry its bug into the floor and hide it.
- A bug whose deviation is within ``margin`` times the order noise (a tiny
  effect in a low-precision format) is called ``rounding``. Exact mode has no
  such blind spot: use it wherever prefill and decode can share one order.
- ``margin`` trades the two errors: raise it when a correct model's variants
  do not reproduce its decode kernel's order closely; lower it to catch
  smaller bugs.
"""

from __future__ import annotations

import math

import numpy as np

from kvfast.check.protocol import check_logits, has, variants_of

DEFAULT_MARGIN = 4.0
DEFAULT_WINDOW = 2


def check_margin(margin: object) -> float:
    ok = not isinstance(margin, bool) and isinstance(margin, int | float | np.floating)
    if not ok or not math.isfinite(margin) or margin < 1:
        raise ValueError(f"margin: {margin!r} is not allowed; allowed: a finite number >= 1")
    return float(margin)


def order_noise(
    model, prompt: np.ndarray, final: np.ndarray, rows: np.ndarray, vocab: int, invariant: bool
) -> tuple[np.ndarray, list[str]]:
    """Per-position order-noise floor ``(len(final),)`` against the reference ``rows``, and notes."""
    T = prompt.shape[0]
    n = final.shape[0]
    floor = np.zeros(n)
    notes: list[str] = []
    sources: list[str] = []
    if not invariant:
        full = check_logits(model.recompute(final), "recompute", n, vocab, "of the whole sequence")
        floor = np.maximum(floor, np.abs(full - rows).max(axis=1))
        sources.append("batch shape")
    if has(model, "recompute_variants"):
        whole = variants_of(model, final, vocab)
        per_step = not invariant
        if invariant and whole:
            head = variants_of(model, prompt, vocab)
            per_step = any(not np.array_equal(head[k], whole[k][:T]) for k in whole)
            if per_step:
                notes.append("recompute_variants is not append-invariant; computed it once per step")
        if per_step:
            head = variants_of(model, prompt, vocab)
            got = {k: np.empty((n, vocab)) for k in head}
            for k in head:
                got[k][:T] = head[k]
            for p in range(T, n):
                step = variants_of(model, final[: p + 1], vocab)
                for k in got:
                    got[k][p] = step[k][-1]
            whole = got
        for k, v in whole.items():
            floor = np.maximum(floor, np.abs(v - rows).max(axis=1))
            sources.append(f"variant {k!r}")
    if not sources:
        notes.append(
            "control mode found no order-noise source (the recompute is append-invariant and the model has no "
            "recompute_variants()); its floor is 0 and it reduces to exact mode"
        )
    else:
        notes.append(f"order-noise floor from: {', '.join(sources)}")
    return floor, notes


def step_floor(floor_by_position: np.ndarray, prompt_len: int) -> np.ndarray:
    """Per-step floor: step 0 is the largest over the prompt rows, step t the row of position T+t-1."""
    T = prompt_len
    out = np.empty(floor_by_position.shape[0] - T + 1)
    out[0] = floor_by_position[:T].max()
    out[1:] = floor_by_position[T:]
    return out


def judge(
    deviation: np.ndarray, floor: np.ndarray, margin: float, window: int
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """``(bound, ratio, verdicts)`` per step: ``rounding`` iff ``deviation <= margin * bound``."""
    n = deviation.shape[0]
    typical = float(np.median(floor))
    bound = np.array([max(floor[max(0, t - window) : t + window + 1].max(), typical) for t in range(n)])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(deviation == 0, 0.0, deviation / bound)
    verdicts = tuple("rounding" if deviation[t] <= margin * bound[t] else "bug" for t in range(n))
    return bound, ratio, verdicts
