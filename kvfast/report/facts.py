"""Figures the README and docs quote beside the claims, each computed from the stored runs.

:func:`facts` returns one row per figure: a key, the figure in words, its value
and the study whose runs it comes from. ``kvfast report DIR --markdown facts``
prints them; the report shows them under the claims table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvfast.model.bugs import BUGS
from kvfast.studies import detector, neartied, training
from kvfast.studies.common import ok_rows
from kvfast.studies.detector import scored

COLUMNS = ["key", "figure", "value", "study"]


_ok = ok_rows


def _bugs(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    ok = _ok(df)
    rows = []
    for model, g in ok.groupby("model"):
        rows.append(
            (
                f"margin_median_{model}",
                f"{model} models: median over runs of the smallest top-1 minus top-2 logit margin of the clean "
                "generation",
                f"{float(g['clean_margin_min'].median()):.3g} ({len(g)} runs)",
            )
        )
    ev = ok[ok["bug"] == "evict"]
    for (model, n_layer), g in ev.groupby(["model", "n_layer"]):
        changed = g[g["tokens_changed"]]
        prompts = ", ".join(str(p) for p in sorted(set(changed["prompt_len"].astype(int))))
        rows.append(
            (
                f"evict_changed_{model}_{int(n_layer)}layer",
                f"evict changes the output: {model} models with {int(n_layer)} layer(s)",
                f"{100 * float(g['tokens_changed'].mean()):.0f}% of {len(g)} runs"
                + (f" (prompt lengths {prompts})" if len(changed) else ""),
            )
        )
    return rows


def _detector(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    s = scored(df)
    rows = []
    summary = detector.summarize(df)
    for model in detector.model_kinds(s):
        m = s[s["model"] == model]
        suffix = "" if model == detector.CLAIMS_MODEL else f"_{model}"
        words = f"{model} models" if model == "random" else f"the {model} model"
        bugged = m[m["bug_present"]]
        same = bugged[~bugged["output_changed"]]
        changed = bugged[bugged["output_changed"]]
        if len(same) and len(changed):
            hi = same.loc[same["every_step_score"].idxmax()]
            lo = changed.loc[changed["every_step_score"].idxmin()]
            rows.append(
                (
                    f"largest_unchanged_dev{suffix}",
                    "largest all-steps deviation of a bugged run whose output did not change"
                    + (f" ({words})" if suffix else ""),
                    f"{hi['every_step_score']:.2g} ({hi['bug']})",
                )
            )
            rows.append(
                (
                    f"smallest_changed_dev{suffix}",
                    "smallest all-steps deviation of a bugged run whose output changed"
                    + (f" ({words})" if suffix else ""),
                    f"{lo['every_step_score']:.2g} ({lo['bug']})",
                )
            )
        rows.append(
            (
                f"margin_median_detector{suffix}",
                "detector runs"
                + (f" ({words})" if suffix else "")
                + ": median of the clean generation's smallest top-1 minus top-2 margin",
                f"{float(m['clean_margin_min'].median()):.3g} ({len(m)} runs)",
            )
        )
        if suffix:
            seed = detector.SEED_FIGURES["one-step"]
            one = summary[
                (summary["model"] == model)
                & (summary["detector"] == "one-step")
                & (summary["scope"] == "all")
                & (summary["label"] == "output changed")
            ].iloc[0]
            per_bug = ", ".join(
                f"{bug} {int(bugged.loc[bugged['bug'] == bug, 'output_changed'].sum())}"
                for bug in BUGS
                if (bugged["bug"] == bug).any()
            )
            rows.append(
                (
                    f"detector_changed{suffix}",
                    f"detector study, {words}: bugged runs whose output changed (of 30 per bug)",
                    f"{len(changed)} of {len(bugged)} ({per_bug})",
                )
            )
            rows.append(
                (
                    f"detector_one_step{suffix}",
                    f'detector study, {words}: one-step exact check on "output changed" (seed: recall '
                    f"{seed['recall']:.3f}, AUC {seed['auc']:.3f})",
                    f"recall {one['recall']:.3f}, AUC {one['auc']:.3f}",
                )
            )
    return rows


def _precision(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    ok = _ok(df)
    rows = []
    std = ok[(ok["attention"] == "standard") & (ok["decode_attention"] == "same")]
    split = std[(std["storage"] == "bf16") & (std["accum"] == "f32") & (std["fwd_pos_agree"] < 1.0)]
    for _, r in split.sort_values(["d_model", "seed", "prefill_order"]).iterrows():
        rows.append(
            (
                f"f32_accum_split_d{int(r['d_model'])}_seed{int(r['seed'])}_{r['prefill_order']}",
                f"bf16 storage + f32 accumulator, d_model {int(r['d_model'])}, seed {int(r['seed'])}, prefill "
                f"{r['prefill_order']}: positions / values agreeing, first split",
                f"{100 * r['fwd_pos_agree']:.1f}% / {100 * r['fwd_values_agree']:.2f}%, {r['fwd_first_diff']}",
            )
        )
    b = ok[(ok["accum"] == "bf16") & (ok["attention"] == "standard") & (ok["decode_attention"] == "same")]
    for d, g in b.groupby("d_model"):
        rows.append(
            (
                f"bf16_accum_logit_diff_d{int(d)}",
                f"bf16 accumulator, d_model {int(d)}: largest logit difference between the two orders (forward)",
                f"{float(g['fwd_logits_max_diff'].max()):.3g}",
            )
        )
    return rows


def _neartied(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    ok = _ok(df)
    rows = []
    for model in [m for m in neartied.MODEL_KINDS if m in set(ok["model"])]:
        runs = ok[ok["model"] == model]
        b = runs[runs["accum"] == "bf16"]
        if not len(b):
            continue
        suffix = "" if model == neartied.CLAIMS_MODEL else f"_{model}"
        words = "" if not suffix else f" (twin head on the {model} model)"
        rows.append(
            (
                f"neartied_bf16_logit_move{suffix}",
                f"near-tied model{words}, bf16 accumulator: largest logit move of the mixed-order cached run "
                "(to its first flip)",
                f"{float(b['cached_max_diff'].max()):.3g}",
            )
        )
        if suffix:
            rows.append(
                (
                    f"neartied_flips{suffix}",
                    f"near-tied model{words}, bf16 storage + bf16 accumulator, per twin gap: cached vs control "
                    "flips (paired exact McNemar p)",
                    neartied.flips_text(neartied.flips_per_gap(runs)),
                )
            )
            rows.append(
                (
                    f"neartied_margin{suffix}",
                    f"near-tied model{words}: median top-2 margin per twin gap (f64 preset)",
                    "; ".join(
                        f"2^-{int(e)}: {float(g['margin_median'].median()):.3g}"
                        for e, g in runs[runs["storage"] == "f64"].groupby("twin_exp")
                    ),
                )
            )
    return rows


def _training(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    ok = _ok(df)
    rows = []
    at = ok[ok["prefix_len"] == 6]
    for steps, g in at.groupby("train_steps"):
        g = g.sort_values("seed")
        rows.append(
            (
                f"training_per_seed_{int(steps)}",
                f"training at prefix 6 of 12, {int(steps)} steps, per seed: gradient cosine; suffix loss full / cached",
                "; ".join(
                    f"seed {int(r['seed'])}: {r['grad_cosine']:.3f}; {r['suffix_loss_full']:.3f} / "
                    f"{r['suffix_loss_cached']:.3f}"
                    for _, r in g.iterrows()
                ),
            )
        )
    return rows


def _training_curves(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    ok = _ok(df)
    if "curve_cosine_full" not in ok.columns:
        return []
    at6 = ok[ok["prefix_len"] == 6]
    rows = []
    for steps, g in at6.groupby("train_steps"):
        for variant in ("full", "cached"):
            at, curve = training.mean_curve(g, f"curve_cosine_{variant}")
            rows.append(
                (
                    f"training_cosine_curve_{variant}_{int(steps)}",
                    f"training at prefix 6 of 12, {int(steps)} steps: gradient cosine along {variant} training "
                    "(mean over seeds), step: cosine",
                    ", ".join(f"{int(a)}: {c:.3f}" for a, c in zip(at, curve, strict=True)),
                )
            )
        for variant in ("full", "cached"):
            at, curve = training.mean_curve(g, f"curve_suffix_loss_{variant}")
            rows.append(
                (
                    f"training_loss_curve_{variant}_{int(steps)}",
                    f"training at prefix 6 of 12, {int(steps)} steps: held-out suffix loss of {variant} training "
                    "(mean over seeds), step: loss",
                    ", ".join(f"{int(a)}: {c:.3g}" for a, c in zip(at, curve, strict=True)),
                )
            )
    main = at6[at6["train_steps"] == at6["train_steps"].min()]
    names = list(main["tensor_names"].iloc[0])
    init = np.array([np.asarray(list(c)[0], dtype=np.float64) for c in main["curve_tensor_cosine_full"]]).mean(axis=0)
    order = np.argsort(init, kind="stable")
    rows.append(
        (
            "training_tensor_cosine_init",
            "training at prefix 6 of 12: gradient cosine per parameter tensor at initialisation (mean over seeds), "
            "lowest first",
            ", ".join(f"{names[i]} {init[i]:.3f}" for i in order),
        )
    )
    return rows


def _gradcheck(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    ok = _ok(df)
    rows = []
    for n_layer, g in ok.groupby("n_layer"):
        rows.append(
            (
                f"gradcheck_{int(n_layer)}layer",
                f"gradient check, {int(n_layer)} layer(s): tensors per model, worst relative error",
                f"{int(g['tensors'].max())} tensors, {float(g['worst_rel_err'].max()):.2g}",
            )
        )
    return rows


FACTS = {
    "bugs": _bugs,
    "detector": _detector,
    "precision": _precision,
    "neartied": _neartied,
    "training": lambda df: _training(df) + _training_curves(df),
    "gradcheck": _gradcheck,
}


def facts(results: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every quoted figure that the stored ``results`` allow, as rows of :data:`COLUMNS`."""
    rows = []
    total = 0
    for name, df in sorted(results.items()):
        total += len(df)
        if name in FACTS and len(_ok(df)):
            rows += [{"key": k, "figure": f, "value": v, "study": name} for k, f, v in FACTS[name](df)]
    rows.append({"key": "runs", "figure": "runs stored over every study", "value": f"{total:,}", "study": "all"})
    out = pd.DataFrame(rows, columns=COLUMNS)
    return out.astype({"value": str}).replace({np.nan: ""})
