"""The per-layer invariance study: does appending a token move any earlier position's state?

One run: a random model (``init_params(seed)``, ``max_pos = prompt_len + 1``)
and ``prompt_len + 1`` random tokens (drawn from ``seed`` and ``prompt_len``).
Two forwards with the same numerics and the same mask setting: over the first
``prompt_len`` tokens, and over all of them. For every layer ``l`` (1-based)
the run reports the max abs change, over the earlier positions ``0 ..
prompt_len - 1``, of

- ``resid_dev[l - 1]``: the residual stream entering layer ``l``
  (``resid_dev[0]`` is the embedding, ``resid_dev[n_layer]`` the final stream),
- ``k_dev[l - 1]``, ``v_dev[l - 1]``: layer ``l``'s keys and values (what a cache stores),

and ``logits_dev``. With the causal mask (``causal = true``) every entry is
expected to be exactly 0.0: appending cannot move the past, so a cache is
exact. Without it, layer 1's keys and values are still exact (they are
computed from the embedding alone), and every layer from 2 on moves: layer
1's attention lets the new token reach earlier positions' residual streams,
which feed layer 2's keys and values.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.model.config import ModelConfig, init_params
from kvfast.model.transformer import Weights, forward_prepared
from kvfast.numerics import PRESETS, Numerics
from kvfast.studies.common import (
    MODEL_SHAPE_FIELDS,
    listed,
    model_config,
    ok_rows,
    require_config_choice,
    require_model_shape,
    study_of,
)
from kvfast.studies.criteria import EXACT, judged
from kvfast.studies.plotting import SYMLOG_FLOOR, pyplot
from kvfast.sweep.study import Claim, Figure
from kvfast.validation import require_int

VERSION = "1"

CONFIG_FIELDS = {
    "preset": pa.string(),
    "causal": pa.bool_(),
    "seed": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "prompt_len": pa.int64(),
}
RESULT_FIELDS = {
    "resid_dev": pa.list_(pa.float64()),
    "k_dev": pa.list_(pa.float64()),
    "v_dev": pa.list_(pa.float64()),
    "logits_dev": pa.float64(),
    "max_dev": pa.float64(),
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_config_choice(config, "preset", tuple(PRESETS))
    require_config_choice(config, "causal", (True, False))
    require_model_shape(config, max_layers=16, max_width=1024)
    require_int(config.get("prompt_len"), "prompt_len", 1, 1024)


def _trace(cfg: ModelConfig, w: Weights, tokens: np.ndarray, nx: Numerics, causal: bool) -> dict:
    trace: dict = {}
    trace["logits"] = forward_prepared(cfg, w, tokens, nx, None, causal, trace=trace)
    return trace


def run(config: dict) -> dict:
    """One prompt length x model x mask setting; see the module docstring."""
    p = config["prompt_len"]
    cfg = model_config(config, p + 1)
    nx = Numerics.preset(config["preset"])
    w = Weights.prepare(cfg, init_params(cfg, config["seed"]), nx)
    rng = np.random.default_rng([config["seed"], p, 0x1A7A])
    tokens = rng.integers(0, cfg.vocab, size=p + 1).astype(np.int64)
    short = _trace(cfg, w, tokens[:p], nx, config["causal"])
    full = _trace(cfg, w, tokens, nx, config["causal"])

    def dev(name: str) -> list[float]:
        return [float(np.abs(b[:p] - a).max()) for a, b in zip(short[name], full[name], strict=True)]

    resid, k, v = dev("resid"), dev("k"), dev("v")
    logits = float(np.abs(full["logits"][:p] - short["logits"]).max())
    return {
        "resid_dev": resid,
        "k_dev": k,
        "v_dev": v,
        "logits_dev": logits,
        "max_dev": max(*resid, *k, *v, logits),
    }


def per_layer(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run and layer ``l``: ``resid_in`` (entering ``l``), ``k``, ``v``, ``resid_out`` (leaving ``l``)."""
    ok = ok_rows(df)
    per_run = ok[["preset", "causal", "n_layer", "prompt_len"]].assign(
        layer=[list(range(1, len(k) + 1)) for k in ok["k_dev"]],
        resid_in=[list(r)[:-1] for r in ok["resid_dev"]],
        k=[list(k) for k in ok["k_dev"]],
        v=[list(v) for v in ok["v_dev"]],
        resid_out=[list(r)[1:] for r in ok["resid_dev"]],
    )
    long = per_run.explode(["layer", "resid_in", "k", "v", "resid_out"]).reset_index(drop=True)
    floats = dict.fromkeys(("resid_in", "k", "v", "resid_out"), np.float64)
    return long.astype({"causal": bool, "n_layer": np.int64, "prompt_len": np.int64, "layer": np.int64, **floats})


def layer_stats(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset, mask setting (``causal``, on first) and layer: runs, runs whose K and V at that layer are
    exactly unchanged (``exact_runs``), the max change over runs of the residual stream entering and leaving
    the layer, K and V, the min of K's and of the smaller of K's and V's (``kv_min``). Empty: :func:`per_layer`'s
    empty table."""
    pl = per_layer(df)
    if pl.empty:
        return pl
    pl = pl.assign(kv=np.minimum(pl["k"], pl["v"]), exact=(pl["k"] == 0.0) & (pl["v"] == 0.0))
    out = (
        pl.groupby(["preset", "causal", "layer"])
        .agg(
            runs=("k", "size"),
            exact_runs=("exact", "sum"),
            resid_in=("resid_in", "max"),
            k=("k", "max"),
            v=("v", "max"),
            k_min=("k", "min"),
            kv_min=("kv", "min"),
            resid_out=("resid_out", "max"),
        )
        .reset_index()
    )
    out["exact_runs"] = out["exact_runs"].astype(np.int64)
    return out.sort_values(["preset", "causal", "layer"], ascending=[True, False, True]).reset_index(drop=True)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset, mask setting and layer: runs, and the max (and, for ``k``, the min) change over runs."""
    stats = layer_stats(df)
    if stats.empty:
        return stats
    seed = np.where(stats["causal"], "0 (exact)", np.where(stats["layer"] == 1, "exact", "wrong"))
    return stats[["preset", "causal", "layer", "runs", "resid_in", "k", "v", "k_min", "resid_out"]].assign(seed=seed)


@listed
def claims(df: pd.DataFrame) -> Iterator[Claim]:
    """Mask on: 0.0 everywhere. Mask off: layer 1 exact, every layer from 2 moved in every run."""
    pl = per_layer(df)
    if pl.empty:
        return
    on = pl[pl["causal"]]
    if len(on):
        worst = float(on[["resid_in", "k", "v", "resid_out"]].to_numpy().max())
        presets = ", ".join(sorted(on["preset"].unique()))
        yield judged(
            "with the causal mask, appending a token moves no earlier residual stream, K or V at any layer",
            "exactly 0 at every layer",
            f"max {worst!r} over {on['layer'].size} run-layers ({presets})",
            EXACT,
            [("max change of residual stream, K and V over every run-layer == 0.0", worst == 0.0)],
        )
    off = pl[~pl["causal"]]
    if len(off):
        first = off[off["layer"] == 1]
        worst1 = float(first[["resid_in", "k", "v"]].to_numpy().max())
        later = off[off["layer"] >= 2]
        least = float(later[["resid_in", "k", "v"]].to_numpy().min()) if len(later) else float("nan")
        yield judged(
            "without the mask, layer 1's K and V are still exact",
            "exact at layer 1",
            f"max {worst1!r} over {len(first)} runs",
            EXACT,
            [("max change of layer 1's input, K and V == 0.0", worst1 == 0.0)],
        )
        yield judged(
            "without the mask, every layer from 2 moves (residual stream in, K and V)",
            "wrong from layer 2",
            f"min {least:.3g} over {len(later)} run-layers",
            EXACT,
            [("min change over every layer >= 2 of every run > 0.0", bool(len(later) and least > 0.0))],
        )


# --- the report: its figure (kvfast.report shows it: see Figure) ---------------------------------------------

LAYER_COLUMNS = ["preset", "mask", "layer", "runs", "exact_runs", "k_max", "v_max", "resid_in_max", "kv_min"]


def layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per preset, mask setting (``on``/``off``) and layer: runs, runs whose K and V at that layer are exactly
    unchanged (``exact_runs``), the largest change over runs of K, V and the residual stream entering the layer,
    and the smallest over runs of the smaller of its K and V changes (``kv_min``: above 0, K and V moved in every
    run)."""
    stats = layer_stats(df)
    if stats.empty:
        return pd.DataFrame(columns=LAYER_COLUMNS)
    out = stats.assign(mask=np.where(stats["causal"], "on", "off"))
    return out.rename(columns={"k": "k_max", "v": "v_max", "resid_in": "resid_in_max"})[LAYER_COLUMNS]


def _draw_layers(df: pd.DataFrame, table: pd.DataFrame):
    """Per preset, the change of K and V per layer with the mask off (largest and smallest over runs) and on."""
    presets = [p for p in PRESETS if p in set(table["preset"])]
    fig, axes = pyplot().subplots(1, len(presets), figsize=(4.4 * len(presets), 4.2), sharey=True, squeeze=False)
    top = 20.0 * float(table[["k_max", "v_max"]].to_numpy().max()) if len(table) else 1.0
    for ax, preset in zip(axes[0], presets, strict=True):
        off = table[(table["preset"] == preset) & (table["mask"] == "off")]
        on = table[(table["preset"] == preset) & (table["mask"] == "on")]
        ax.plot(off["layer"], off["k_max"], "-o", color="#d62728", label="mask off: K, largest")
        ax.plot(off["layer"], off["v_max"], "--s", color="#ff7f0e", label="mask off: V, largest")
        ax.plot(off["layer"], off["kv_min"], ":^", color="#9467bd", label="mask off: smaller of K, V, least run")
        ax.plot(on["layer"], on[["k_max", "v_max"]].max(axis=1), "-D", color="#2ca02c", label="mask on: K, V")
        for _, row in pd.concat([off, on]).iterrows():
            y, color = (0.93, "#d62728") if row["mask"] == "off" else (0.05, "#2ca02c")  # counts: off on top
            text = f"{row['exact_runs']}/{row['runs']}"
            ax.text(row["layer"], y, text, transform=ax.get_xaxis_transform(), ha="center", fontsize=8, color=color)
        ax.set_yscale("symlog", linthresh=SYMLOG_FLOOR)
        ax.set_ylim(0, top)
        ax.set_xticks(sorted(set(table["layer"])))
        ax.set(xlabel="layer", title=f"preset {preset}")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("max |change| at earlier positions\n(symlog, 0 at bottom)")
    axes[0, -1].legend(loc="center right", fontsize=8)
    note = "numbers: runs whose K and V are exact\n(top: mask off; bottom: mask on)"
    axes[0, 0].text(0.4, 0.4, note, fontsize=8, transform=axes[0, 0].transAxes)
    fig.suptitle("Appending a token: how far each layer's K and V at earlier positions move")
    fig.tight_layout()
    return fig


FIGURES = (
    Figure(
        "invariance",
        "Invariance: how far appending a token moves earlier positions' K and V, per layer",
        "Two forwards, over the prompt and over the prompt plus one token; the change of every earlier "
        "position's keys and values at each layer (the y axis is symmetric-log, so exactly 0.0 is the bottom "
        "axis). With the causal mask every layer is exact in every run, so a cache is exact. Without it layer "
        "1's K and V are still exact (computed from the embedding alone) and every later layer moves in every "
        "run: layer 1's attention lets the new token reach the earlier residual streams. Layers 3 and 4 are "
        "the 4-layer models only.",
        layer_table,
        _draw_layers,
    ),
)


STUDY = study_of(
    globals(),
    "invariance",
    "per layer, how much appending a token moves earlier positions' residual stream, K and V",
    rank=75,
)
