"""The near-tied study: do tokens flip when prefill and decode sum in different orders, and is that the cache?

The near-tied model ("twin head"). Take a model (``model``: ``random``,
:func:`kvfast.init_params` of ``seed``; or ``trained``, the cycle-task model of
:mod:`kvfast.studies.bugs` for the architecture, the configuration closer to the
seed's) and rebuild its output head in twins: for every even token ``2i``,
column ``2i + 1`` is a copy of column ``2i`` plus ``2**-twin_exp`` times an
independent N(0, 1/d_model) column::

    w_out[:, 2i+1] = w_out[:, 2i] + 2**-twin_exp * g_i

So whichever token leads, its twin is right behind it: the top-two margin is
about ``2**-twin_exp * |h . g_i|`` while the logits are O(1), at every step of
every generation. (A scaled-down head, the other obvious construction, scales
the margin and every rounding error by the same factor in floating point, so it
does not make the top two any closer in units of the rounding error.) The
margins are measured and reported (``margin_*``), from the reference path.

Prompts: ``prompt_len`` uniformly random tokens for the random model; for the
trained model an in-distribution prompt of the cycle task (its free prefix
drawn from ``seed``), which the trained model then continues confidently up to the twin tie.

One run = one model and prompt (``seed``), one storage and accumulator format,
one twin gap. Order A = ``prefill_order`` (the batched paths), order B = the
other one. Greedy generation of ``steps`` tokens after a ``prompt_len``-token prompt:

- reference: full recompute at every step in order A (no cache);
- ``flip_cached``: the cached run (prefill in A, every decode step in B) generates
  different tokens than the reference;
- ``flip_control``: a full recompute in order B (no cache) generates different
  tokens than the reference: two recomputes that differ only in how they add up;
- ``same_exact``: the cached run with the same order A in prefill and decode
  equals the reference bit for bit (every logit of every step) and in its tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.kernels.precision import FORMAT_CODES
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.model.config import ModelConfig, init_params
from kvfast.model.generation import generate_prepared
from kvfast.model.transformer import Weights
from kvfast.numerics import PRESETS, Numerics
from kvfast.studies import bugs as bugstudy
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
)
from kvfast.studies.criteria import EXACT, TEST, judged, mcnemar_exact_p
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Claim, Fact, Figure
from kvfast.validation import require_int

VERSION = "1"

FORMATS = tuple(FORMAT_CODES)  # f64, f32, bf16
ORDERS = tuple(ORDER_CODES)  # sequential, pairwise
SAME_SIZE_LEVEL = 0.05  # "as often": the paired exact McNemar test does not reject at this level
MODEL_KINDS = bugstudy.MODEL_KINDS  # random, trained
CLAIMS_MODEL = "random"  # the seed's claims are judged on the random twin-head models; trained ones are reported beside

CONFIG_FIELDS = {
    "model": pa.string(),
    "seed": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "prompt_len": pa.int64(),
    "steps": pa.int64(),
    "twin_exp": pa.int64(),
    "storage": pa.string(),
    "accum": pa.string(),
    "prefill_order": pa.string(),
}
RESULT_FIELDS = {
    "margin_min": pa.float64(),
    "margin_median": pa.float64(),
    "rel_margin_median": pa.float64(),
    "twin_top2_frac": pa.float64(),
    "flip_cached": pa.bool_(),
    "first_flip_cached": pa.int64(),
    "flip_control": pa.bool_(),
    "first_flip_control": pa.int64(),
    "cached_max_diff": pa.float64(),
    "control_max_diff": pa.float64(),
    "same_exact": pa.bool_(),
    "same_max_diff": pa.float64(),
    "tokens": pa.string(),
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_config_choice(config, "model", MODEL_KINDS)
    require_model_shape(config, min_vocab=2)
    for name in ("prompt_len", "steps"):
        require_int(config.get(name), name, 1, 4096)
    if config["model"] == "trained" and config["prompt_len"] + config["steps"] > bugstudy.MAX_POS:
        raise ValueError(
            f"steps: {config['steps']} is not allowed with prompt_len={config['prompt_len']} and model=trained; "
            f"allowed: prompt_len + steps <= {bugstudy.MAX_POS} (the trained model's positions)"
        )
    require_int(config.get("twin_exp"), "twin_exp", 0, 60)
    require_config_choice(config, "storage", FORMATS)
    require_config_choice(config, "accum", FORMATS)
    require_config_choice(config, "prefill_order", ORDERS)
    if config["vocab"] % 2:
        raise ValueError(f"vocab: {config['vocab']} is not allowed; allowed: an even number (tokens come in twins)")


def twin_head_model(config: dict) -> tuple[ModelConfig, dict, np.ndarray]:
    """The near-tied model of a run (module docstring) and its prompt, all from ``seed``."""
    if config["model"] == "trained":
        cfg, params = bugstudy.model_for(config)
        params = dict(params)  # the trained arrays are shared and read-only; w_out is replaced below
    else:
        cfg = model_config(config, config["prompt_len"] + config["steps"])
        params = init_params(cfg, config["seed"])
    rng = np.random.default_rng([config["seed"], 23])
    d, v = cfg.d_model, cfg.vocab
    g = rng.standard_normal((d, v // 2)) / np.sqrt(d)
    w_out = params["w_out"].copy()
    w_out[:, 1::2] = w_out[:, 0::2] + 2.0 ** -config["twin_exp"] * g
    params["w_out"] = w_out
    if config["model"] == "trained":
        head = rng.integers(0, v, size=bugstudy.TASK_PREFIX)
        prompt = bugstudy.task_for(v).complete(head, config["prompt_len"])
    else:
        prompt = rng.integers(0, v, size=config["prompt_len"]).astype(np.int64)
    return cfg, params, prompt


def run(config: dict) -> dict:
    """One run (see the module docstring); returns :data:`RESULT_FIELDS`."""
    validate_config(config)
    cfg, params, prompt = twin_head_model(config)
    order_a = config["prefill_order"]
    order_b = ORDERS[1 - ORDERS.index(order_a)]
    nx_a = Numerics(config["storage"], config["accum"], order_a)
    nx_b = Numerics(config["storage"], config["accum"], order_b)
    w = Weights.prepare(cfg, params, nx_a)
    steps = config["steps"]
    t_ref, l_ref = generate_prepared(cfg, w, prompt, steps, nx_a, use_cache=False)
    t_mix, l_mix = generate_prepared(cfg, w, prompt, steps, nx_a, use_cache=True, decode_numerics=nx_b)
    t_ctl, l_ctl = generate_prepared(cfg, w, prompt, steps, nx_b, use_cache=False)
    t_same, l_same = generate_prepared(cfg, w, prompt, steps, nx_a, use_cache=True)

    top2 = np.sort(l_ref, axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    order = np.argsort(-l_ref, axis=1, kind="stable")[:, :2]
    twins = (order[:, 0] // 2) == (order[:, 1] // 2)
    first_mix = first_index(t_mix != t_ref)
    first_ctl = first_index(t_ctl != t_ref)
    # logits are compared only up to the first flip (after it the two runs read different tokens)
    upto_mix = steps if first_mix < 0 else first_mix + 1
    upto_ctl = steps if first_ctl < 0 else first_ctl + 1
    return {
        "margin_min": float(margins.min()),
        "margin_median": float(np.median(margins)),
        "rel_margin_median": float(np.median(margins / np.abs(top2[:, 1]))),
        "twin_top2_frac": float(twins.mean()),
        "flip_cached": bool(first_mix >= 0),
        "first_flip_cached": first_mix,
        "flip_control": bool(first_ctl >= 0),
        "first_flip_control": first_ctl,
        "cached_max_diff": float(np.abs(l_mix[:upto_mix] - l_ref[:upto_mix]).max()),
        "control_max_diff": float(np.abs(l_ctl[:upto_ctl] - l_ref[:upto_ctl]).max()),
        "same_exact": bool(bits_equal(l_same, l_ref).all() and (t_same == t_ref).all()),
        "same_max_diff": float(np.abs(l_same - l_ref).max()),
        "tokens": ",".join(map(str, t_ref)),
    }


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, twin_exp, storage, accum): flips of the cached run and of the control (of N runs), margins,
    exact cache."""
    formats = pd.CategoricalDtype(FORMATS, ordered=True)
    categories = {"model": pd.CategoricalDtype(MODEL_KINDS, ordered=True), "storage": formats, "accum": formats}
    return aggregated(
        ok_rows(df).astype(categories),
        ["model", "twin_exp", "storage", "accum"],
        runs=("run_id", "size"),
        flips_cached=("flip_cached", "sum"),
        flips_control=("flip_control", "sum"),
        margin_median=("margin_median", "median"),
        rel_margin_median=("rel_margin_median", "median"),
        margin_min=("margin_min", "min"),
        twin_top2=("twin_top2_frac", "mean"),
        same_exact=("same_exact", "sum"),
    )


@listed
def flips_per_gap(df: pd.DataFrame) -> Iterator[tuple[int, int, int, int, float]]:
    """bf16 storage + bf16 accumulator runs of ``df``, per twin gap: ``(twin_exp, runs, cached flips, control
    flips, exact McNemar p)`` (the cached run and the control of the same model paired)."""
    ok = ok_rows(df)
    for exp, s in ok[(ok["storage"] == "bf16") & (ok["accum"] == "bf16")].groupby("twin_exp"):
        only_c = int((s["flip_cached"] & ~s["flip_control"]).sum())
        only_n = int((~s["flip_cached"] & s["flip_control"]).sum())
        p = mcnemar_exact_p(only_c, only_n)
        yield int(exp), len(s), int(s["flip_cached"].sum()), int(s["flip_control"].sum()), p


def flips_text(per_gap: list[tuple[int, int, int, int, float]]) -> str:
    """``"2^-E: C/N vs K/N (McNemar p P); ..."`` for :func:`flips_per_gap`'s rows."""
    return "; ".join(f"2^-{e}: {fc}/{n} vs {fn}/{n} (McNemar p {p:.2f})" for e, n, fc, fn, p in per_gap)


@listed
def claims(df: pd.DataFrame) -> Iterator[Claim]:
    """The seed's near-tied claims (bf16 storage, every twin gap) and the same-order cache in the presets, on the
    :data:`CLAIMS_MODEL` runs (the trained twin-head runs are in the summary, not closer to the seed's figures).

    "As often" is an exact McNemar test on the runs paired by model (the cached run and the control of
    the same seed and gap), two-sided at level :data:`SAME_SIZE_LEVEL`, at every gap."""
    ok = ok_rows(df)
    ok = ok[ok["model"] == CLAIMS_MODEL]
    b16 = ok[ok["storage"] == "bf16"]
    rows = flips_per_gap(ok)
    per_gap = flips_text(rows)
    conditions = [(f"gap 2^-{e}: McNemar p >= {SAME_SIZE_LEVEL}", p >= SAME_SIZE_LEVEL) for e, _, _, _, p in rows]
    if per_gap:
        yield judged(
            "near-tied model, bf16 storage + bf16 accumulator: tokens flip as often in cached runs "
            "(prefill/decode in different orders) as in the no-cache control (two recomputes)",
            "3 of 24 cached vs 2 of 24 control",
            "twin gap: cached vs control flips: " + per_gap,
            TEST,
            conditions,
        )
    wide = b16[b16["accum"] != "bf16"]
    if len(wide):
        flips = int(wide["flip_cached"].sum() + wide["flip_control"].sum())
        yield judged(
            "near-tied model, bf16 storage with an f32 or f64 accumulator: no token flips from order",
            "order matters only with a bf16 accumulator",
            f"{flips} flips in {2 * len(wide)} cached and control runs",
            EXACT,
            [("no flip in any cached or control run", flips == 0)],
        )
    presets = ok[[(s, a) in PRESETS.values() for s, a in zip(ok["storage"], ok["accum"], strict=True)]]
    if len(presets):
        yield judged(
            "near-tied model, same order in prefill and decode: the cache is bit-exact in all three presets",
            "bit-exact in all three formats",
            f"{int(presets['same_exact'].sum())} of {len(presets)} preset runs bit-exact "
            f"({int(ok['same_exact'].sum())} of {len(ok)} over all format pairs)",
            EXACT,
            [
                ("every preset run bit-exact", bool(presets["same_exact"].all())),
                ("every run of every format pair bit-exact", bool(ok["same_exact"].all())),
            ],
        )


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


def neartied_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per model kind, storage/accumulator pair and twin gap (in name order): the summary's runs, flips of the
    mixed-order cached run and of the control, and the median top-2 margin."""
    keys = ["model", "storage", "accum", "twin_exp"]
    columns = [*keys, "runs", "flips_cached", "flips_control", "margin_median"]
    summary = summarize(df)
    if summary.empty:
        return pd.DataFrame(columns=columns)
    return summary.astype(dict.fromkeys(keys[:3], str)).sort_values(keys, ignore_index=True)[columns]


def _draw_flips(df: pd.DataFrame, table: pd.DataFrame):
    """Per model kind, flips of the cached run and of the control against the twin gap, per accumulator."""
    models = [m for m in ("random", "trained") if m in set(table["model"])]
    fig, axes = pyplot().subplots(1, len(models), figsize=(6.2 * len(models), 4.8), sharey=True, squeeze=False)
    styles = {"bf16": "-", "f32": "--", "f64": ":"}
    runs = int(table["runs"].max()) if len(table) else 0
    exps = sorted(set(table["twin_exp"]))
    for ax, model in zip(axes[0], models, strict=True):
        mine = table[(table["model"] == model) & (table["storage"] == "bf16")]
        for accum, g in mine.groupby("accum"):
            ls = styles[accum]
            ax.plot(g["twin_exp"], g["flips_cached"], ls, marker="o", color="#9467bd", label=f"cached, {accum} acc")
            ax.plot(g["twin_exp"], g["flips_control"], ls, marker="s", color="#8c564b", label=f"control, {accum} acc")
        ax.axhline(3, color="#9467bd", lw=0.8, alpha=0.5)
        ax.axhline(2, color="#8c564b", lw=0.8, alpha=0.5)
        ax.text(0.02, 3.3, "seed: cached 3 / 24", fontsize=8, color="#9467bd", transform=ax.get_yaxis_transform())
        ax.text(0.02, 1.0, "seed: control 2 / 24", fontsize=8, color="#8c564b", transform=ax.get_yaxis_transform())
        ax.set_xticks(exps, [f"$2^{{-{e}}}$" for e in exps])
        ax.set_xlabel("twin gap (smaller = closer tie)")
        ax.set_ylim(-0.5, runs + 0.5)
        ax.set_title(f"twin head on the {model} model{'s' if model == 'random' else ''}")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(f"runs whose tokens flip (of {runs})")
    axes[0, -1].legend(loc="center right", fontsize=9)
    fig.suptitle("Near-tied model, bf16 storage: cached (mixed orders) vs no-cache control")
    fig.tight_layout()
    return fig


@listed
def facts(df: pd.DataFrame) -> Iterator[Fact]:
    """The quoted figures per model kind: the bf16 accumulator's largest logit move and (twin head on the trained
    model) the flips and the median margin per twin gap."""
    ok = ok_rows(df)
    for model in [m for m in MODEL_KINDS if m in set(ok["model"])]:
        runs = ok[ok["model"] == model]
        b = runs[runs["accum"] == "bf16"]
        if not len(b):
            continue
        suffix = "" if model == CLAIMS_MODEL else f"_{model}"
        about = f"near-tied model{f' (twin head on the {model} model)' if suffix else ''}"
        yield Fact(
            f"neartied_bf16_logit_move{suffix}",
            f"{about}, bf16 accumulator: largest logit move of the mixed-order cached run (to its first flip)",
            f"{float(b['cached_max_diff'].max()):.3g}",
        )
        if suffix:
            margins = runs[runs["storage"] == "f64"].groupby("twin_exp")["margin_median"].median()
            yield Fact(
                f"neartied_flips{suffix}",
                f"{about}, bf16 storage + bf16 accumulator, per twin gap: cached vs control flips (paired "
                "exact McNemar p)",
                flips_text(flips_per_gap(runs)),
            )
            yield Fact(
                f"neartied_margin{suffix}",
                f"{about}: median top-2 margin per twin gap (f64 preset)",
                "; ".join(f"2^-{int(e)}: {float(m):.3g}" for e, m in margins.items()),
            )


FIGURES = (
    Figure(
        "neartied",
        "Near-tied flips against the tie gap, cached vs control",
        "A twin-head model makes every step nearly tied. Cached: prefill in sequential order, every decode step in "
        "pairwise; control: a full recompute in pairwise order, no cache. Both against a sequential recompute. "
        "Left: the twin head on random models; right: on the trained cycle-task model (in-distribution prompts). "
        "With an f32 or f64 accumulator no run flips; with a bf16 accumulator the cache flips about as often as the "
        "control at every gap, on both.",
        neartied_table,
        _draw_flips,
    ),
)


STUDY = study_of(
    globals(),
    "neartied",
    "near-tied (twin-head) model: token flips of mixed-order cached runs vs a no-cache control",
    rank=40,
)
