"""The precision study: does summation order change what is stored, and does a cache?

One run = one model and token sequence (``seed``), one storage format, one
accumulator format and one attention kernel (``attention``: ``standard`` or a
real kernel's order such as ``online:4``) for the batched paths, and one for the
decode (``decode_attention``: ``same``, or another kernel, e.g. flash-decoding's
``splitkv:4`` after a flash-attention ``online:4`` prefill). The two summation
orders are ``sequential`` (A) and ``pairwise`` (B); ``prefill_order`` says which
of them the batched paths use (the other one is the decode's).

Three comparisons, every value compared by its bits (``==``):

``fwd_*``
    a forward in order A against a forward in order B over the whole
    sequence (:func:`kvfast.forward_trace`): the residual stream after the
    embedding and after every layer, K and V of every layer, and the logits.
    A position agrees when every one of its values does.
``cache_*``
    the cached path, a prefill of the prompt in ``prefill_order`` then a
    teacher-forced decode of the rest of the sequence in the other order,
    against a full recompute in ``prefill_order``. Compared: the logits of the
    decoded positions and K, V of every layer at every position (the fused
    decode kernel does not expose its residual stream). A decoded position
    agrees when its logits and all its K, V do.
``same_*``
    the cache control: prefill and decode both in ``prefill_order`` (the
    decode with ``decode_attention``), against the same full recompute.
    ``same_exact`` is True when every logit and every K, V entry is bit-identical.

Sequences are ``prompt_len + steps`` tokens drawn from ``seed``; parameters are
:func:`kvfast.init_params` of ``seed``. A run's numbers depend only on its config.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.kernels.attention import ATTENTION_CODES
from kvfast.kernels.precision import FORMAT_CODES
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.model.cache import KVCache
from kvfast.model.config import ModelConfig, init_params
from kvfast.model.generation import decode_prepared
from kvfast.model.transformer import Weights, forward_prepared
from kvfast.numerics import PRESETS, Numerics
from kvfast.studies.common import (
    MODEL_SHAPE_FIELDS,
    aggregated,
    bits_equal,
    first_index,
    listed,
    model_config,
    ok_rows,
    require_config_choice,
    require_model_shape,
    study_of,
    tabled,
)
from kvfast.studies.criteria import EXACT, judged
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Claim, Fact, Figure
from kvfast.validation import require_int

VERSION = "2"

FORMATS = tuple(FORMAT_CODES)  # f64, f32, bf16
ORDERS = tuple(ORDER_CODES)  # sequential (A), pairwise (B)
ATTENTION_KINDS = tuple(ATTENTION_CODES)  # standard, online, splitkv, splitcount
TRACED = ("resid", "k", "v", "logits")  # what a forward's trace compares, in this order

CONFIG_FIELDS = {
    "seed": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "prompt_len": pa.int64(),
    "steps": pa.int64(),
    "storage": pa.string(),
    "accum": pa.string(),
    "attention": pa.string(),
    "decode_attention": pa.string(),
    "prefill_order": pa.string(),
}
RESULT_FIELDS = {
    "positions": pa.int64(),
    "fwd_pos_agree": pa.float64(),
    "fwd_values_agree": pa.float64(),
    **{f"fwd_{kind}_agree": pa.float64() for kind in TRACED},
    "fwd_max_diff": pa.float64(),
    "fwd_logits_max_diff": pa.float64(),
    "fwd_first_diff": pa.string(),
    "cache_pos_agree": pa.float64(),
    "cache_kv_agree": pa.float64(),
    "cache_logits_agree": pa.float64(),
    "cache_max_diff": pa.float64(),
    "same_exact": pa.bool_(),
    "same_max_diff": pa.float64(),
}


def parse_attention(spec: object, field: str = "attention") -> tuple[str, int]:
    """``"standard"`` or ``"KIND:N"`` (``online:4``, ``splitkv:4``, ``splitcount:3``) -> ``(kind, N)``.

    Raises ``ValueError`` naming ``field``, the value and what is allowed.
    """
    allowed = "'standard', or 'online:N', 'splitkv:N', 'splitcount:N' with an integer N >= 1"
    if spec == "standard":
        return "standard", 0
    kind, _, n = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind not in ATTENTION_KINDS[1:] or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{field}: {spec!r} is not allowed; allowed: {allowed}")
    return kind, int(n)


def numerics_for(storage: str, accum: str, order: str, attention: str) -> Numerics:
    """The :class:`Numerics` of a run's formats, one order and an attention spec."""
    kind, block = parse_attention(attention)
    return Numerics(storage=storage, accum=accum, order=order, attention=kind, attn_block=block)


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_model_shape(config)
    for name in ("steps", "prompt_len"):
        require_int(config.get(name), name, 1, 4096)
    require_config_choice(config, "storage", FORMATS)
    require_config_choice(config, "accum", FORMATS)
    require_config_choice(config, "prefill_order", ORDERS)
    parse_attention(config.get("attention"))
    if config.get("decode_attention") != "same":
        parse_attention(config.get("decode_attention"), "decode_attention")


def model_for(config: dict) -> tuple[ModelConfig, dict, np.ndarray]:
    """The run's model, parameters and token sequence (``prompt_len + steps`` tokens), all from ``seed``."""
    n = config["prompt_len"] + config["steps"]
    cfg = model_config(config, n)
    params = init_params(cfg, config["seed"])
    rng = np.random.default_rng([config["seed"], n, 11])
    tokens = rng.integers(0, config["vocab"], size=n).astype(np.int64)
    return cfg, params, tokens


def full_trace(cfg: ModelConfig, w: Weights, tokens: np.ndarray, nx: Numerics) -> dict[str, np.ndarray]:
    """A forward over all ``tokens``: ``resid`` (L+1, T, d), ``k``/``v`` (L, T, d), ``logits`` (T, vocab)."""
    trace: dict = {}
    logits = forward_prepared(cfg, w, tokens, nx, trace=trace)
    return {"resid": np.stack(trace["resid"]), "k": np.stack(trace["k"]), "v": np.stack(trace["v"]), "logits": logits}


def cached_trace(
    cfg: ModelConfig, w: Weights, tokens: np.ndarray, prompt_len: int, prefill: Numerics, decode: Numerics
) -> dict[str, np.ndarray]:
    """Prefill ``tokens[:prompt_len]`` with ``prefill``, then decode every later token (teacher-forced) with ``decode``.

    Returns ``logits`` (T, vocab) (rows < prompt_len from the prefill) and the
    cache's ``k``/``v`` (L, T, d).
    """
    n = tokens.shape[0]
    cache = KVCache.empty(cfg, prefill, n)
    logits = np.empty((n, cfg.vocab))
    logits[:prompt_len] = forward_prepared(cfg, w, tokens[:prompt_len], prefill, cache)
    for t in range(prompt_len, n):
        logits[t] = decode_prepared(cfg, w, cache, int(tokens[t]), decode)
    return {"logits": logits, "k": cache.k.copy(), "v": cache.v.copy()}


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) if a.size else 0.0


def _first_diff(ta: dict, tb: dict) -> str:
    """The first differing value, in forward order (position, then layer: its K, V and the residual stream leaving
    it; the logits last), or ''."""
    n_layer = ta["k"].shape[0]
    order = [
        (kind, layer)
        for layer in range(n_layer + 1)
        for kind in ("k", "v", "resid")
        if kind == "resid" or layer < n_layer
    ]
    for t in range(ta["logits"].shape[0]):
        for kind, layer in [*order, ("logits", None)]:
            a, b = (ta[kind][t], tb[kind][t]) if layer is None else (ta[kind][layer, t], tb[kind][layer, t])
            j = first_index(~bits_equal(a, b))
            if j >= 0:
                where = f"layer={layer}, pos={t}" if layer is not None else f"pos={t}"
                return f"{kind}[{where}, col={j}]: {float(a[j])!r} vs {float(b[j])!r}"
    return ""


def _positions_agree(parts: list[np.ndarray], axis_of_pos: list[int], n: int) -> np.ndarray:
    ok = np.ones(n, dtype=bool)
    for eq, ax in zip(parts, axis_of_pos, strict=True):
        other = tuple(i for i in range(eq.ndim) if i != ax)
        ok &= eq.all(axis=other) if other else eq
    return ok


def run(config: dict) -> dict:
    """One run (see the module docstring); returns :data:`RESULT_FIELDS`."""
    validate_config(config)
    cfg, params, tokens = model_for(config)
    order_a = config["prefill_order"]
    order_b = ORDERS[1 - ORDERS.index(order_a)]
    nx_a = numerics_for(config["storage"], config["accum"], order_a, config["attention"])
    nx_b = numerics_for(config["storage"], config["accum"], order_b, config["attention"])
    dec = config["attention"] if config["decode_attention"] == "same" else config["decode_attention"]
    dec_a = numerics_for(config["storage"], config["accum"], order_a, dec)
    dec_b = numerics_for(config["storage"], config["accum"], order_b, dec)
    w = Weights.prepare(cfg, params, nx_a)
    n = tokens.shape[0]
    p = config["prompt_len"]

    ta = full_trace(cfg, w, tokens, nx_a)
    tb = full_trace(cfg, w, tokens, nx_b)
    eq = {kind: bits_equal(ta[kind], tb[kind]) for kind in TRACED}
    fwd_pos = _positions_agree(list(eq.values()), [1, 1, 1, 0], n)
    fwd_max = max(_max_diff(ta[kind], tb[kind]) for kind in TRACED)

    mixed = cached_trace(cfg, w, tokens, p, nx_a, dec_b)
    ckv = [bits_equal(mixed["k"], ta["k"]), bits_equal(mixed["v"], ta["v"])]
    clog = bits_equal(mixed["logits"][p:], ta["logits"][p:])
    cache_pos = _positions_agree([ckv[0][:, p:], ckv[1][:, p:], clog], [1, 1, 0], n - p)
    cache_max = max(_max_diff(mixed[kind], ta[kind]) for kind in ("k", "v", "logits"))

    same = cached_trace(cfg, w, tokens, p, nx_a, dec_a)
    same_exact = all(bits_equal(same[kind], ta[kind]).all() for kind in ("k", "v", "logits"))
    same_max = max(_max_diff(same[kind], ta[kind]) for kind in ("k", "v", "logits"))

    return {
        "positions": int(n),
        "fwd_pos_agree": float(fwd_pos.mean()),
        "fwd_values_agree": float(np.concatenate([e.ravel() for e in eq.values()]).mean()),
        **{f"fwd_{kind}_agree": float(agree.mean()) for kind, agree in eq.items()},
        "fwd_max_diff": fwd_max,
        "fwd_logits_max_diff": _max_diff(ta["logits"], tb["logits"]),
        "fwd_first_diff": _first_diff(ta, tb),
        "cache_pos_agree": float(cache_pos.mean()) if n > p else 1.0,
        "cache_kv_agree": float(np.concatenate([e.ravel() for e in ckv]).mean()),
        "cache_logits_agree": float(clog.mean()) if clog.size else 1.0,
        "cache_max_diff": cache_max,
        "same_exact": bool(same_exact),
        "same_max_diff": same_max,
    }


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (d_model, storage, accum, attention, decode_attention): mean agreement, worst differences, exact share."""
    ok = ok_rows(df)
    formats = pd.CategoricalDtype(FORMATS, ordered=True)
    kinds = [k for k in ("standard", *sorted(set(ok["attention"]) - {"standard"})) if k in set(ok["attention"])]
    ok = ok.astype({"storage": formats, "accum": formats, "attention": pd.CategoricalDtype(kinds, ordered=True)})
    return aggregated(
        ok,
        ["d_model", "storage", "accum", "attention", "decode_attention"],
        runs=("run_id", "size"),
        fwd_pos_agree=("fwd_pos_agree", "mean"),
        fwd_pos_agree_min=("fwd_pos_agree", "min"),
        fwd_values_agree=("fwd_values_agree", "mean"),
        fwd_logits_agree=("fwd_logits_agree", "mean"),
        fwd_max_diff=("fwd_max_diff", "max"),
        cache_pos_agree=("cache_pos_agree", "mean"),
        cache_max_diff=("cache_max_diff", "max"),
        same_exact=("same_exact", "mean"),
    )


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


@listed
def claims(df: pd.DataFrame) -> Iterator[Claim]:
    """The seed's order/precision claims as this grid measured them: the formats', then the kernels'."""
    ok = ok_rows(df)
    # the formats': standard attention, same kernel: which accumulator makes the summation order matter
    std = ok[(ok["attention"] == "standard") & (ok["decode_attention"] == "same")]
    b64, b32, b16 = (std[(std["storage"] == "bf16") & (std["accum"] == accum)] for accum in ("f64", "f32", "bf16"))
    if len(b64):
        pos = float(b64["fwd_pos_agree"].mean())
        cpos = float(b64["cache_pos_agree"].mean())
        yield judged(
            "bf16 storage + f64 accumulator: the two summation orders agree bit for bit at every position",
            "100% of positions",
            f"{_pct(pos)} of positions (forward A vs B), {_pct(cpos)} (cached mixed vs recompute), {len(b64)} runs",
            EXACT,
            [
                ("every position agrees, forward in order A vs B", pos == 1.0),
                ("every decoded position agrees, mixed-order cache vs recompute", cpos == 1.0),
            ],
        )
    if len(b16) and len(b64):
        pos64 = float(b64["fwd_pos_agree"].mean())
        pos32 = float(b32["fwd_pos_agree"].mean()) if len(b32) else float("nan")
        pos16 = float(b16["fwd_pos_agree"].mean())
        split32 = int((b32["fwd_pos_agree"] < 1.0).sum()) if len(b32) else 0
        yield judged(
            "only a bf16 accumulator makes order matter (bf16 storage)",
            "only a bfloat16 accumulator makes order matter",
            f"positions agreeing: f64 acc {_pct(pos64)}, f32 acc {_pct(pos32)} ({split32} of {len(b32)} runs "
            f"split), bf16 acc {_pct(pos16)}",
            EXACT,
            [
                ("f64 accumulator: 100% of positions agree", pos64 == 1.0),
                ("f32 accumulator: 100% of positions agree", pos32 == 1.0),
                ("bf16 accumulator: below 100%", bool(pos16 < 1.0)),
            ],
        )

    # the kernels': same order in both paths: aligned kernels keep the cache exact; count splits and mixed kernels
    # break it
    same_kernel = ok[ok["decode_attention"] == "same"]
    aligned = same_kernel[same_kernel["attention"].str.split(":").str[0].isin(["standard", "online", "splitkv"])]
    counted = same_kernel[same_kernel["attention"].str.startswith("splitcount")]
    if len(aligned):
        formats = zip(aligned["storage"], aligned["accum"], strict=True)
        presets = aligned[[pair in PRESETS.values() for pair in formats]]
        yield judged(
            "same order in prefill and decode: the cache is bit-exact (three presets; standard and "
            "aligned-block kernels)",
            "bit-exact in all three formats",
            f"{int(presets['same_exact'].sum())} of {len(presets)} preset runs exact; "
            f"{int(aligned['same_exact'].sum())} of {len(aligned)} runs over all 9 format pairs",
            EXACT,
            [
                ("every run of the three presets bit-exact", bool(len(presets) and presets["same_exact"].all())),
                ("every run of all 9 format pairs bit-exact", bool(aligned["same_exact"].all())),
            ],
        )
    broken = {  # claim -> (the seed's figure, the runs whose cache it says is broken)
        "split-KV by count (boundaries move as the cache grows) breaks the cache, same order in both paths": (
            "(not in the seed; flash-decoding practice)",
            counted,
        ),
        "a prefill kernel and a decode kernel that round in different places (flash-attention prefill, "
        "flash-decoding decode) break the cache, same order, every format": (
            "(not in the seed)",
            ok[ok["decode_attention"] != "same"],
        ),
    }
    for claim, (seed, runs) in broken.items():
        if len(runs):
            figure = f"{int((~runs['same_exact']).sum())} of {len(runs)} runs not bit-exact, worst deviation "
            figure += f"{float(runs['same_max_diff'].max()):.3g}"
            yield judged(claim, seed, figure, EXACT, [("no run bit-exact", bool((~runs["same_exact"]).all()))])


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


@tabled(["d_model", "storage", "accum", "comparison", "runs", "positions_agree"])
def precision_table(df: pd.DataFrame) -> Iterator[dict]:
    """Standard attention, same decode kernel: per d_model, storage, accumulator and comparison, the share of
    positions whose every value agrees bit for bit (mean over runs)."""
    ok = ok_rows(df)
    ok = ok[(ok["attention"] == "standard") & (ok["decode_attention"] == "same")]
    for (d, storage, accum), g in ok.groupby(["d_model", "storage", "accum"]):
        seq = g[g["prefill_order"] == "sequential"]
        pair = g[g["prefill_order"] == "pairwise"]
        for comparison, values in (
            ("forward: sequential vs pairwise", g["fwd_pos_agree"]),
            ("cache: prefill sequential, decode pairwise", seq["cache_pos_agree"]),
            ("cache: prefill pairwise, decode sequential", pair["cache_pos_agree"]),
        ):
            yield {
                "d_model": int(d),
                "storage": storage,
                "accum": accum,
                "comparison": comparison,
                "runs": len(values),
                "positions_agree": float(values.mean()) if len(values) else np.nan,
            }


def _draw_agreement(df: pd.DataFrame, table: pd.DataFrame):
    """Heatmaps, storage x accumulator, of the share of positions agreeing, per d_model and comparison."""
    dims = sorted(set(table["d_model"]))
    comps = list(dict.fromkeys(table["comparison"]))
    fig, axes = pyplot().subplots(
        len(dims), len(comps), figsize=(4.3 * len(comps) + 1.2, 3.5 * len(dims) + 0.6), squeeze=False,
        layout="constrained",
    )  # fmt: skip
    for r, d in enumerate(dims):
        for c, comp in enumerate(comps):
            ax = axes[r, c]
            g = table[(table["d_model"] == d) & (table["comparison"] == comp)]
            grid = np.full((3, 3), np.nan)
            for _, row in g.iterrows():
                grid[FORMATS.index(row["storage"]), FORMATS.index(row["accum"])] = row["positions_agree"]
            im = ax.imshow(100 * grid, vmin=0, vmax=100, cmap="viridis")
            for i in range(3):
                for j in range(3):
                    v = grid[i, j]
                    text = "" if np.isnan(v) else f"{100 * v:.1f}%"
                    ax.text(j, i, text, ha="center", va="center", color="white" if v < 0.6 else "black")
            ax.set_xticks(range(3), FORMATS)
            ax.set_yticks(range(3), FORMATS)
            ax.set(xlabel="accumulator", ylabel=f"d_model {d}: storage" if c == 0 else "storage")
            if r == 0:
                ax.set_title(comp.replace(": ", ":\n"), fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8, label="% of positions agreeing bit for bit")
    fig.suptitle("Share of positions whose every value agrees bit for bit (standard attention)")
    return fig


@listed
def facts(df: pd.DataFrame) -> Iterator[Fact]:
    """The quoted figures: each bf16-storage + f32-accumulator split, and the bf16 accumulator's logit difference."""
    ok = ok_rows(df)
    std = ok[(ok["attention"] == "standard") & (ok["decode_attention"] == "same")]
    split = std[(std["storage"] == "bf16") & (std["accum"] == "f32") & (std["fwd_pos_agree"] < 1.0)]
    for _, r in split.sort_values(["d_model", "seed", "prefill_order"]).iterrows():
        yield Fact(
            f"f32_accum_split_d{int(r['d_model'])}_seed{int(r['seed'])}_{r['prefill_order']}",
            f"bf16 storage + f32 accumulator, d_model {int(r['d_model'])}, seed {int(r['seed'])}, prefill "
            f"{r['prefill_order']}: positions / values agreeing, first split",
            f"{100 * r['fwd_pos_agree']:.1f}% / {100 * r['fwd_values_agree']:.2f}%, {r['fwd_first_diff']}",
        )
    for d, g in std[std["accum"] == "bf16"].groupby("d_model"):
        yield Fact(
            f"bf16_accum_logit_diff_d{int(d)}",
            f"bf16 accumulator, d_model {int(d)}: largest logit difference between the two orders (forward)",
            f"{float(g['fwd_logits_max_diff'].max()):.3g}",
        )


FIGURES = (
    Figure(
        "precision",
        "Summation order: share of positions that agree bit for bit",
        "Storage format (rows) x accumulator format (columns) x comparison (panels): the forward in sequential vs "
        "pairwise order, and a cache whose prefill and decode use different orders against a full recompute. "
        "Standard attention; 8 models per cell and order.",
        precision_table,
        _draw_agreement,
    ),
)


STUDY = study_of(
    globals(),
    "precision",
    "summation order x storage x accumulator: bit agreement of forwards and of mixed-order cached paths",
    rank=30,
)
