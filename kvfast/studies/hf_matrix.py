"""The ``hf_matrix`` study: the measured matrix behind control mode's claims on Hugging Face models, false
positives and misses (extra ``kvfast[hf]``).

One run is one :func:`kvfast.check_cache` of a tiny random model (:mod:`kvfast.studies.hf_common`:
``family``, ``dtype``, ``attention``, weight ``seed``) on the ``prompt``-th random prompt of the seed's
stream (4 to 7 tokens, ``default_rng(1000 + seed)``), with every axis of the check a config field:

- ``bug``: ``"none"`` (clean) or a bug of :data:`kvfast.bugs.hf.HF_BUGS` injected into the cache path;
- ``feed``: ``"given"`` (the stream's random continuation of ``steps`` tokens) or ``"greedy"`` (``steps``
  greedy tokens, no continuation);
- ``mode`` (``exact``, ``control``), ``scenarios`` (``decode``, ``resume``, ``both``), ``promote``
  (``"none"``, or ``"float64"``: the logic check, ``check_cache(..., promote="float64")``);
- ``variants``: ``"builtin"`` (the adapter's recompute variants) or ``"padded"`` (also a left-padded
  recompute, :class:`PaddedVariant`: measured, not kept; its fully masked pad rows give NaN logits in
  float64 eager attention, stored as the verdict ``"nan-logits"``).

Result columns: ``verdict``, ``ratio`` (the largest deviation over its floor), ``worst_deviation``,
``first_step`` (the earliest first ``bug`` step over the scenarios, -1 if none), ``right_step`` (bugged
runs: every scenario that says ``bug`` says it where the bug first acts,
:func:`kvfast.bugs.hf.first_acting_step`), and the same for the logic check (``logic_*``, null without
``promote``). A false positive is a clean ``bug``; a miss is a bugged run that is not ``bug``.

The built-in grid (``hf_matrix.toml``, 1,584 runs: Llama, GPT-2, Mistral with a sliding window, Qwen2;
float32, float64, bfloat16; sdpa and eager; 3 seeds x 3 prompts, 24 steps, control mode, both scenarios):
the clean runs with the given continuation, one greedy clean run per model (prompt 0), and every bug with
the float64 logic check. ``kvfast study hf_matrix`` runs it (not ``kvfast reproduce``: it needs torch and
takes long); its tables are the summary (clean runs) and ``hf_matrix_bugs``
(``kvfast report DIR --markdown tables``). More axes (architectures, scenarios) are more values of these
fields: the scan (issue 20) builds on them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.bugs.hf import first_acting_step, inject_hf_bug
from kvfast.check.checker import check_cache
from kvfast.check.hf import HFModel
from kvfast.check.options import PROMOTE as CHECK_PROMOTE
from kvfast.studies import hf_common as hf
from kvfast.studies.check import MODES, SCENARIO_CHOICES
from kvfast.studies.common import first_bug_step, require_config_choice, study_of, tabled
from kvfast.studies.criteria import EXACT, judged
from kvfast.studies.plotting import ratio_bars
from kvfast.sweep.study import Claim, Fact, Figure

VERSION = "1"
PROMPT_STREAM = 1000
PROMPT_LENGTHS = (4, 5, 6, 7)
FEEDS = ("given", "greedy")
PROMOTE = ("none", *CHECK_PROMOTE)  # "none": promote=None
VARIANTS = ("builtin", "padded")
NAN_LOGITS = "nan-logits"
PAD = 3

CONFIG_FIELDS: dict[str, pa.DataType] = {
    **hf.MODEL_FIELDS,
    **hf.CASE_FIELDS,
    "feed": pa.string(),
    "mode": pa.string(),
    "scenarios": pa.string(),
    "promote": pa.string(),
    "variants": pa.string(),
}
RESULT_FIELDS: dict[str, pa.DataType] = {
    "verdict": pa.string(),
    "ratio": pa.float64(),
    "worst_deviation": pa.float64(),
    "first_step": pa.int64(),
    "right_step": pa.bool_(),
    "logic_verdict": pa.string(),
    "logic_ratio": pa.float64(),
    "logic_step": pa.int64(),
    "logic_right_step": pa.bool_(),
}


class PaddedVariant(HFModel):
    """:class:`HFModel` whose variants also include ``"padded"``: the sequence after ``PAD`` pad tokens that the
    attention mask hides, positions from 0 at the first real token, on a deep copy (measured, not kept)."""

    def recompute_variants(self, tokens) -> dict:
        import torch

        out = super().recompute_variants(tokens)
        ids = self._ids(tokens, 0)
        pad = torch.zeros(1, PAD, dtype=torch.long)
        mask = torch.cat([pad, torch.ones_like(ids)], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if "padded" not in self._copies:
            self._copies["padded"] = copy.deepcopy(self.model).eval()
        kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
        logits, _ = self._call(self._copies["padded"], input_ids=torch.cat([pad, ids], 1), **kwargs)
        out["padded"] = logits[0, PAD:]
        return out


def validate_config(config: dict) -> None:
    """``ValueError`` naming the field (or the missing torch) before any run."""
    hf.validate_model_and_case(config, "hf_matrix")
    require_config_choice(config, "feed", FEEDS)
    require_config_choice(config, "mode", MODES)
    require_config_choice(config, "scenarios", tuple(SCENARIO_CHOICES))
    require_config_choice(config, "promote", PROMOTE)
    require_config_choice(config, "variants", VARIANTS)


def right_step(report, bug: str | None) -> bool | None:
    """Whether every scenario that says ``bug`` says it where the (injected) ``bug`` first acts (``None`` for a
    clean run)."""
    if bug is None:
        return None
    T = report.prompt.shape[0]
    acting = {name: first_acting_step(bug, name, T) for name in report.scenarios}
    return all(
        s.first_bug_step == acting[name]
        for name, s in report.scenarios.items()
        if acting[name] is not None and s.verdict == "bug"
    )


def _check(config: dict):
    """The config's :func:`check_cache` report."""
    c = config
    model = hf.base_model(c["family"], c["dtype"], c["attention"], c["seed"])
    adapter = inject_hf_bug((PaddedVariant if c["variants"] == "padded" else HFModel)(model), hf.bug_of(c))
    prompt, continuation = hf.prompt_and_continuation(PROMPT_STREAM, c["seed"], c["prompt"], c["steps"], PROMPT_LENGTHS)
    kwargs = {"mode": c["mode"], "scenarios": SCENARIO_CHOICES[c["scenarios"]]}
    if c["promote"] != "none":
        kwargs["promote"] = c["promote"]
    if c["feed"] == "greedy":
        return check_cache(adapter, prompt, c["steps"], **kwargs)
    return check_cache(adapter, prompt, continuation=continuation, **kwargs)


def run(config: dict) -> dict:
    """One check as the config names it: verdict, ratio, worst deviation and first bug step (and right step),
    natively and in the logic check."""
    try:
        report = _check(config)
    except ValueError as exc:  # the padded recompute's fully masked pad rows (float64 eager)
        if config["variants"] != "padded" or "logits hold nan" not in str(exc):
            raise
        return {**dict.fromkeys(RESULT_FIELDS), "verdict": NAN_LOGITS, "first_step": -1}
    bug = hf.bug_of(config)
    logic = report.promoted
    return {
        "verdict": report.verdict,
        "ratio": report.max_ratio,
        "worst_deviation": float(report.max_deviation),
        "first_step": first_bug_step(report),
        "right_step": right_step(report, bug),
        "logic_verdict": None if logic is None else logic.verdict,
        "logic_ratio": None if logic is None else logic.max_ratio,
        "logic_step": None if logic is None else first_bug_step(logic),
        "logic_right_step": None if logic is None else right_step(logic, bug),
    }


@tabled(["dtype", "runs", "bug", "inconclusive", "largest_ratio"])
def clean_table(df: pd.DataFrame) -> Iterator[dict]:
    """The clean runs per dtype, then ``all``: runs, ``bug`` verdicts (false positives), ``inconclusive``, the
    largest ratio (the summary)."""
    ok = hf.ordered_ok_rows(df)
    clean = ok[ok["bug"] == hf.NO_BUG] if len(ok) else ok
    for dtype, g in [*clean.groupby("dtype", sort=False), ("all", clean)] if len(clean) else ():
        yield {
            "dtype": dtype,
            "runs": len(g),
            **{verdict: int((g["verdict"] == verdict).sum()) for verdict in ("bug", "inconclusive")},
            "largest_ratio": float(g["ratio"].max()),
        }


@tabled()
def bug_table(df: pd.DataFrame) -> Iterator[dict]:
    """The bugged runs per bug and dtype: native verdict counts, catches at the right step, the logic check's
    catches (at the right step) and its smallest ratio."""
    ok = hf.ordered_ok_rows(df)
    bugs = ok[ok["bug"] != hf.NO_BUG] if len(ok) else ok
    for (bug, dtype), g in bugs.groupby(["bug", "dtype"], sort=False) if len(bugs) else ():
        v = g["verdict"]
        caught = g[v == "bug"]
        logic = g[g["logic_verdict"] == "bug"]
        yield {
            "bug": bug,
            "dtype": dtype,
            "runs": len(g),
            **{f"native_{verdict}": int((v == verdict).sum()) for verdict in ("bug", "inconclusive", "rounding")},
            "native_right_step": int(caught["right_step"].astype(bool).sum()),
            "logic_bug": len(logic),
            "logic_right_step": int(logic["logic_right_step"].astype(bool).sum()),
            "smallest_logic_ratio": float(g["logic_ratio"].min()),
        }


def miss_rates(df: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """``(misses, runs)``: logic bugs natively in float32/float64 and in bfloat16, and every bug in the logic
    check (a miss: any verdict but ``bug``)."""
    ok = hf.ordered_ok_rows(df)
    bugs = ok[ok["bug"] != hf.NO_BUG]
    logic = bugs[bugs["bug"] != "f16"]
    parts = {
        "logic bugs, float32/float64 native": (logic[logic["dtype"] != "bfloat16"], "verdict"),
        "logic bugs, bfloat16 native": (logic[logic["dtype"] == "bfloat16"], "verdict"),
        "all bugs, logic check in float64": (bugs[bugs["promote"] == "float64"], "logic_verdict"),
    }
    return {name: (int((sel[col] != "bug").sum()), len(sel)) for name, (sel, col) in parts.items()}


def claims(df: pd.DataFrame) -> list[Claim]:
    """No clean run is a ``bug``; every bugged run with the logic check is a ``bug`` there at the right step."""
    ok = hf.ordered_ok_rows(df)
    if not len(ok):
        return []
    clean = ok[ok["bug"] == hf.NO_BUG]
    logic = ok[(ok["bug"] != hf.NO_BUG) & (ok["promote"] == "float64")]
    false_pos = int((clean["verdict"] == "bug").sum())
    found = int(((logic["logic_verdict"] == "bug") & logic["logic_right_step"].astype(bool)).sum())
    return [
        judged(
            "Hugging Face models: control mode calls no clean run a bug, and its float64 logic check finds every "
            "injected bug where it first acts",
            "(not in the seed)",
            f"{false_pos} of {len(clean):,} clean runs bug; {found} of {len(logic):,} bugged runs found at the "
            "right step by the logic check",
            EXACT,
            [
                ("every run ok", len(ok) == len(df)),
                ("no clean run is bug", bool(len(clean)) and false_pos == 0),
                ("every bug found at the right step", bool(len(logic)) and found == len(logic)),
            ],
        )
    ]


def facts(df: pd.DataFrame) -> list[Fact]:
    """The clean runs' false positives and largest ratio, and each miss rate."""
    table = clean_table(df)
    if not len(table):
        return []
    total = table.iloc[-1]
    clean = Fact(
        "hf_matrix_clean",
        "hf_matrix study: clean runs, bug verdicts (false positives), inconclusive, largest ratio",
        f"{int(total['runs'])} runs, {int(total['bug'])} bug, {int(total['inconclusive'])} inconclusive, "
        f"largest ratio {total['largest_ratio']:.3g}",
    )
    rates = {name: (miss / runs if runs else np.nan, miss, runs) for name, (miss, runs) in miss_rates(df).items()}
    return [clean] + [
        Fact(f"hf_matrix_miss_{i}", f"hf_matrix study: miss rate, {name}", f"{rate:.3f} ({miss} of {runs})")
        for i, (name, (rate, miss, runs)) in enumerate(rates.items())
    ]


@tabled()
def ratio_table(df: pd.DataFrame) -> Iterator[dict]:
    """Per family and dtype: the largest clean ratio and the smallest bugged ratio, natively and in the logic
    check (what separates rounding from a bug)."""
    ok = hf.ordered_ok_rows(df)
    for (family, dtype), g in ok.groupby(["family", "dtype"], sort=False) if len(ok) else ():
        clean, bugged = g[g["bug"] == hf.NO_BUG], g[g["bug"] != hf.NO_BUG]
        yield {
            "family": family,
            "dtype": dtype,
            "clean_runs": len(clean),
            "largest_clean_ratio": float(clean["ratio"].max()) if len(clean) else np.nan,
            "bugged_runs": len(bugged),
            "bugged_native_bug": int((bugged["verdict"] == "bug").sum()),
            "smallest_bugged_logic_ratio": float(bugged["logic_ratio"].min()) if len(bugged) else np.nan,
        }


def _draw_ratios(df: pd.DataFrame, table: pd.DataFrame):
    """Per family and dtype: the largest clean ratio against the smallest bugged logic-check ratio (log scale)."""
    return ratio_bars(
        [f"{f}\n{d}" for f, d in zip(table["family"], table["dtype"], strict=True)],
        table["largest_clean_ratio"],
        table["smallest_bugged_logic_ratio"],
        bugged_label="smallest bugged ratio, logic check",
        line=1.0,
        floor=1e-3,
        ylabel="deviation / floor bound (log)",
        title="Clean runs stay under the floor (ratio < 1); injected bugs rise far above it",
        figsize=(11, 4.2),
    )


FIGURES = (
    Figure(
        "hf_matrix",
        "Hugging Face models: control mode's floor against clean and bugged runs",
        "Tiny random Llama, GPT-2, Mistral (sliding window) and Qwen2 in float32, float64 and bfloat16, sdpa and "
        "eager. A ratio is the largest cache-versus-recompute deviation over the floor control mode measures; "
        "above 1 is a bug. Green: the largest over the clean runs (no false positive while it stays below 1); red: "
        "the smallest over the bugged runs in the float64 logic check (every bug found while it stays above 1).",
        ratio_table,
        _draw_ratios,
    ),
)

STUDY = study_of(
    globals(),
    "hf_matrix",
    "control mode on tiny Hugging Face models: false positives and misses (needs kvfast[hf])",
    summarize=clean_table,
    tables=(("hf_matrix_bugs", bug_table),),
    rank=100,
    reproduce=False,
)
