"""A user study for kvfast's sweep engine: how far float32 sums drift from the exact sum, by order.

Sweep it like a built-in study (the grid names it ``study = "examples.sum_order_study:STUDY"``)::

    kvfast run examples/sum_order.toml --out results/sum_order --jobs 2
    kvfast show results/sum_order

A run draws ``n`` float32 values from ``seed`` (normal, times ``scale``), adds them up in float32 in
``order`` (``sequential``: left to right; ``pairwise``: a balanced tree; ``sorted``: smallest
magnitude first, left to right), and compares with the exact sum (``math.fsum`` of the same float32
values, in float64 -- exact to the last bit of a double for these sizes). Result columns:
``total`` (the float32 sum), ``abs_err`` (|total - exact|) and ``ulps`` (that error in float32 ulps
of the exact sum).

The :class:`kvfast.sweep.Study` contract, in this file's terms:

- ``config_fields`` / ``result_fields``: column name -> Arrow type; the grid must set every config
  field, and ``run`` must return exactly the result fields (else the run is an ``error`` row).
- ``run(config) -> dict``: one run; its numbers depend only on the config (seeds derive from it).
  A run that raises is stored as an ``error`` row and the sweep goes on.
- ``validate_config(config)``: raise ``ValueError("FIELD: VALUE is not allowed; allowed: WHAT")``;
  called before any run. ``validate_groups``: fields checked together (here none: each field alone),
  so the engine validates each axis value once instead of every run.
- ``summarize(df)``: the table ``kvfast show`` prints; ``claims(df)``: optional checked statements.
- ``version``: part of every run id; bump it when ``run``'s numbers change.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.sweep import Claim, Study
from kvfast.validation import not_allowed, require_int

ORDERS = ("sequential", "pairwise", "sorted")


def validate_config(config: dict) -> None:
    """``ValueError`` naming the field, the value and what is allowed."""
    require_int(config.get("seed"), "seed", 0)
    require_int(config.get("n"), "n", 1, 1 << 20)
    scale = config.get("scale")
    if not isinstance(scale, float) or not 0 < scale < 1e30:
        raise not_allowed("scale", scale, "a float in (0, 1e30)")
    if config.get("order") not in ORDERS:
        raise not_allowed("order", config.get("order"), ", ".join(ORDERS))


def _pairwise(x: np.ndarray) -> np.float32:
    while len(x) > 1:
        if len(x) % 2:
            x = np.append(x, np.float32(0))
        x = x[0::2] + x[1::2]  # float32 + float32 -> float32, elementwise: one tree level
    return x[0]


def run(config: dict) -> dict:
    """One run (see the module docstring)."""
    rng = np.random.default_rng([config["seed"], config["n"]])
    x = (rng.standard_normal(config["n"]) * config["scale"]).astype(np.float32)
    if config["order"] == "pairwise":
        total = _pairwise(x)
    else:
        if config["order"] == "sorted":
            x = x[np.argsort(np.abs(x), kind="stable")]
        total = np.float32(0)
        for v in x:
            total = np.float32(total + v)
    exact = math.fsum(x.astype(np.float64).tolist())
    err = abs(float(total) - exact)
    ulp = float(np.spacing(np.float32(abs(exact)))) if exact else float(np.finfo(np.float32).tiny)
    return {"total": float(total), "abs_err": err, "ulps": err / ulp}


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per order and size: runs, median and worst error in ulps."""
    ok = df[df["status"] == "ok"]
    return (
        ok.groupby(["order", "n"])
        .agg(runs=("run_id", "size"), median_ulps=("ulps", "median"), worst_ulps=("ulps", "max"))
        .reset_index()
    )


def claims(df: pd.DataFrame) -> list[Claim]:
    """Pairwise summation's worst error is below sequential's at the largest size."""
    ok = df[df["status"] == "ok"]
    big = ok[ok["n"] == ok["n"].max()]
    worst = big.groupby("order")["ulps"].max()
    holds = bool(worst.get("pairwise", math.inf) < worst.get("sequential", -math.inf))
    figure = ", ".join(f"{k} {v:.1f}" for k, v in worst.items())
    return [
        Claim("pairwise float32 sums drift less than sequential ones", "(textbook)", f"worst ulps: {figure}", holds)
    ]


STUDY = Study(
    name="sum_order",
    version="1",
    description="float32 sums in three orders against the exact sum",
    run=run,
    config_fields={"seed": pa.int64(), "n": pa.int64(), "scale": pa.float64(), "order": pa.string()},
    result_fields={"total": pa.float64(), "abs_err": pa.float64(), "ulps": pa.float64()},
    validate_config=validate_config,
    summarize=summarize,
    claims=claims,
    validate_groups=(),
)
