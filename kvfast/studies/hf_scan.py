"""The ``hf_scan`` study: every causal-LM architecture of the installed transformers, checked and scored (extra
``kvfast[hf]``; ``kvfast scan`` runs it).

One run is one :func:`kvfast.check_cache` in ``mode`` (``auto``, the default: ``exact`` where every step is
bit-equal, else judged against the model's order noise; or ``exact``, ``control``) of one scenario on a tiny
random model of one architecture (:func:`kvfast.studies.architectures.tiny_architecture`: ``architecture`` is a
model type of transformers' own ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; ``dtype``; ``attention``, ``auto`` for the
class's default; weight ``seed``), on the ``prompt``-th random prompt of the seed's stream (4 to 7 tokens,
``default_rng(3000 + seed)``) with a random continuation of ``steps`` tokens; ``bug``: ``"none"`` (clean) or a
bug of :data:`kvfast.bugs.hf.HF_BUGS` injected into the cache path; ``promote``: ``"float64"`` adds the
logic check.

Result columns: ``verdict`` (the check's; or ``skipped``, with ``skip_kind`` and ``reason``: ``config`` or
``model`` when transformers cannot make the tiny model, ``run`` when the model's own ``forward`` raises during
the check, ``adapter`` when kvfast refuses it as a model under test, e.g. no KV cache, or refuses to inject the
bug, even inside a model call: :func:`kind_of`; ``scenario`` when the scenario cannot run on the model, a check
that checked nothing and so never a pass), ``ratio``,
``worst_deviation``, ``floor_source`` (what set the bound at the worst step; null for a check judged bit for bit,
as ``ratio``), ``first_bug_step`` (-1: none),
``acting_step`` (where the bug first acts, -1: it never acts in this scenario or the run is clean),
``right_step``, the logic check's ``logic_verdict``, ``logic_ratio``, ``logic_step``, the seconds to build the
model (``build_s``, 0 when this worker had it already) and to check (``check_s``), the attention
implementation the model ran (``attention_used``) and ``transformers_version``.

The scoreboard (:func:`scoreboard`, the summary): per architecture, each dtype x scenario cell the clean runs'
verdicts; then, over the bugged runs where the bug acts, how many were found (``bug`` natively or in the
logic check), how many at the step where the bug first acts, the median steps from acting to detection, and
the false-positive rate of the clean runs. ``hf_scan_skipped``: the architectures skipped, with the reason.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.bugs.hf import HF_BUGS, first_acting_step, inject_hf_bug
from kvfast.check.checker import check_cache
from kvfast.check.options import MODES, PROMOTE, SCENARIOS
from kvfast.check.protocol import ModelUnderTestError
from kvfast.studies import hf_common as hf
from kvfast.studies.architectures import Unbuildable, adapter_of, causal_lm_types, pad_token, tiny_architecture
from kvfast.studies.common import declared_order, first_bug_step, ok_rows, require_config_choice, study_of, tabled
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Fact, Figure

VERSION = "2"  # 2: the mode field, auto by default
PROMPT_STREAM = 3000
PROMPT_LENGTHS = (4, 5, 6, 7)
DTYPES = ("float32", "float64", "bfloat16")
ATTENTION = ("auto", "sdpa", "eager")
SKIPPED = "skipped"
#: Verdicts from best to worst (a cell shows the worst of its runs first).
VERDICTS = ("exact", "rounding", "inconclusive", "length-dependent", "bug", SKIPPED)
VERDICT_RANK = {v: i for i, v in enumerate(VERDICTS)}  # a verdict's place in VERDICTS

CONFIG_FIELDS: dict[str, pa.DataType] = {
    "architecture": pa.string(),
    "dtype": pa.string(),
    "attention": pa.string(),
    "scenario": pa.string(),
    "seed": pa.int64(),
    "prompt": pa.int64(),
    "steps": pa.int64(),
    "bug": pa.string(),
    "promote": pa.string(),
    "mode": pa.string(),
}
RESULT_FIELDS: dict[str, pa.DataType] = {
    "verdict": pa.string(),
    "skip_kind": pa.string(),
    "reason": pa.string(),
    "ratio": pa.float64(),
    "worst_deviation": pa.float64(),
    "floor_source": pa.string(),
    "first_bug_step": pa.int64(),
    "acting_step": pa.int64(),
    "right_step": pa.bool_(),
    "logic_verdict": pa.string(),
    "logic_ratio": pa.float64(),
    "logic_step": pa.int64(),
    "build_s": pa.float64(),
    "check_s": pa.float64(),
    "attention_used": pa.string(),
    "transformers_version": pa.string(),
}


def scenarios() -> tuple[str, ...]:
    """The check's scenarios (:data:`kvfast.check.options.SCENARIOS`: new cache operations join as they land)."""
    return tuple(SCENARIOS)


def architectures() -> tuple[str, ...]:
    """Every causal-LM model type of the installed transformers (imports it)."""
    return tuple(causal_lm_types())


def validate_config(config: dict) -> None:
    """``ValueError`` naming the field (or the missing torch) before any run."""
    hf.require_torch("hf_scan")
    require_config_choice(config, "architecture", architectures())
    require_config_choice(config, "dtype", DTYPES)
    require_config_choice(config, "attention", ATTENTION)
    require_config_choice(config, "scenario", scenarios())
    hf.validate_case(config)
    require_config_choice(config, "promote", ("none", *PROMOTE))  # "none": promote=None
    require_config_choice(config, "mode", MODES)


@functools.lru_cache(maxsize=16)
def _model(architecture: str, dtype: str, attention: str, seed: int):
    """One tiny model per (architecture, dtype, attention, seed) per worker, shared by its runs (adapters never
    change it), or the :class:`~kvfast.studies.architectures.Unbuildable` that says why there is none."""
    import torch

    torch.set_num_threads(1)
    try:
        return tiny_architecture(architecture, dtype, attention, seed)
    except Unbuildable as exc:
        return exc


def _skipped(kind: str, reason: str, **extra) -> dict:
    return {**dict.fromkeys(RESULT_FIELDS), "verdict": SKIPPED, "skip_kind": kind, "reason": reason, **extra}


def _version() -> str:
    import transformers

    return str(transformers.__version__)


def _worst_source(report) -> str | None:
    b = next(iter(report.scenarios.values())).bounds
    if b is None or not len(b.ratio):
        return None
    return str(b.floor_source[int(np.nanargmax(b.ratio))])


def tokens(config: dict, pad: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The config's prompt and continuation, with the model's padding token ``pad`` replaced by the next id: a
    RoBERTa-style model gives a padding token no position (its position ids skip it), so a prompt holding one
    asks the cache a question no generation asks (measured: clean RoBERTa, CamemBERT, X-MOD called ``bug``)."""
    c = config
    prompt, continuation = hf.prompt_and_continuation(PROMPT_STREAM, c["seed"], c["prompt"], c["steps"], PROMPT_LENGTHS)
    if pad is not None:
        prompt[prompt == pad] = (pad + 1) % hf.TINY_VOCAB
        continuation[continuation == pad] = (pad + 1) % hf.TINY_VOCAB
    return prompt, continuation


def _check(config: dict, model):
    """The config's check of ``model`` (an adapter is made here, with the bug)."""
    c = config
    adapter = inject_hf_bug(adapter_of(model), hf.bug_of(c))
    prompt, continuation = tokens(c, pad_token(model))
    promote = None if c["promote"] == "none" else c["promote"]
    report = check_cache(
        adapter, prompt, mode=c["mode"], scenarios=(c["scenario"],), continuation=continuation, promote=promote
    )
    return report, len(prompt)


def run(config: dict) -> dict:
    """One check as the config names it (see the module doc); a model transformers cannot build or run, or that
    kvfast refuses, is a ``skipped`` row with the reason."""
    c = config
    version = _version()
    t0 = time.perf_counter()
    hits = _model.cache_info().hits
    model = _model(c["architecture"], c["dtype"], c["attention"], c["seed"])
    build_s = 0.0 if _model.cache_info().hits > hits else time.perf_counter() - t0
    if isinstance(model, Unbuildable):
        kind = model.reason.split(":", 1)[0]
        return _skipped(kind, model.reason, build_s=build_s, transformers_version=version)
    attention_used = str(getattr(model.config, "_attn_implementation", None) or "eager")
    extra = {"build_s": build_s, "attention_used": attention_used, "transformers_version": version}
    t1 = time.perf_counter()
    try:
        report, prompt_len = _check(c, model)
    except ModelUnderTestError as exc:
        reason = " ".join(str(exc).split())[:400]
        return _skipped(kind_of("run", reason), reason, **extra)
    except ValueError as exc:  # kvfast refuses the model (no KV cache, no logits, a bug it cannot take)
        return _skipped("adapter", " ".join(str(exc).split())[:400], **extra)
    if not report.ran:  # the scenario cannot run on this model (no hook, or the release declines it): not a pass
        return _skipped("scenario", " ".join(report.skipped_line().split())[:400], **extra)
    bug = hf.bug_of(c)
    acting = None if bug is None else first_acting_step(bug, c["scenario"], prompt_len)
    step = first_bug_step(report)
    logic = report.promoted
    return {
        **extra,
        "verdict": report.verdict,
        "skip_kind": None,
        "reason": "; ".join(report.notes)[:400] or None,
        "ratio": report.max_ratio,
        "worst_deviation": float(report.max_deviation),
        "floor_source": _worst_source(report),
        "first_bug_step": step,
        "acting_step": -1 if acting is None else int(acting),
        "right_step": None if acting is None else step == acting,
        "logic_verdict": None if logic is None else logic.verdict,
        "logic_ratio": None if logic is None else logic.max_ratio,
        "logic_step": None if logic is None else first_bug_step(logic),
        "check_s": time.perf_counter() - t1,
    }


def logic_check_for(dtype: str) -> str:
    """The ``promote`` a scan gives ``dtype``: the float64 logic check for bfloat16 (natively a logic bug there
    often moves the logits by one unit in the last place), none otherwise."""
    return "float64" if dtype == "bfloat16" else "none"


def scan_spec(
    families: list[str],
    dtypes: list[str] = ("float32", "bfloat16"),
    scenario_names: list[str] | None = None,
    seeds: int = 2,
    prompts: int = 2,
    steps: int = 16,
    attention: str = "auto",
    bugs: list[str] | None = None,
    mode: str = "auto",
) -> dict:
    """The grid spec of a scan (the form of ``hf_scan.toml``): ``families`` x ``scenario_names`` (default: every
    scenario), each check in ``mode``; clean runs in every dtype (bfloat16 with the logic check:
    :func:`logic_check_for`) x ``seeds`` x ``prompts``; each of ``bugs`` (default: every injected bug; ``[]``:
    none) in the first dtype, seed 0, prompt 0, in the scenarios where it acts
    (:func:`kvfast.bugs.hf.first_acting_step`)."""
    names = list(scenario_names or scenarios())
    union = [
        {
            "description": "clean",
            "fixed": {"bug": hf.NO_BUG},
            "axes": {"seed": list(range(seeds)), "prompt": list(range(prompts))},
            "tied": [{"dtype": list(dtypes), "promote": [logic_check_for(d) for d in dtypes]}],
        }
    ]
    fixed = {"dtype": dtypes[0], "promote": logic_check_for(dtypes[0]), "seed": 0, "prompt": 0}
    injected = HF_BUGS if bugs is None else bugs
    for scenario in names:
        acting = [b for b in injected if first_acting_step(b, scenario, min(PROMPT_LENGTHS)) is not None]
        if acting:
            union.append(
                {"description": f"injected bugs, {scenario}", "fixed": {**fixed, "scenario": scenario},
                 "axes": {"bug": acting}}
            )  # fmt: skip
    return {
        "study": "hf_scan",
        "description": "kvfast scan",
        "fixed": {"steps": steps, "attention": attention, "mode": mode},
        "axes": {"architecture": list(families), "scenario": names},
        "union": union,
    }


# --- the scoreboard ----------------------------------------------------------------------------------------


def _ordered(df: pd.DataFrame) -> pd.DataFrame:
    ok = ok_rows(df)
    if not len(ok):
        return ok
    rank = declared_order({"dtype": DTYPES, "scenario": scenarios()})
    return ok.sort_values(["architecture", "dtype", "scenario", "seed", "prompt"], key=rank, kind="stable")


def verdict_cell(verdicts: pd.Series) -> str:
    """The verdicts of a cell's runs, worst first: ``"rounding 4"``, ``"bug 1, rounding 3"``."""
    counts = verdicts.value_counts()
    names = sorted(counts.index, key=lambda v: -VERDICT_RANK.get(v, len(VERDICTS)))
    return ", ".join(f"{v} {int(counts[v])}" for v in names)


def _found(g: pd.DataFrame) -> pd.Series:
    """Bugged runs found: ``bug`` natively or in the logic check."""
    return (g["verdict"] == "bug") | (g["logic_verdict"] == "bug")


@tabled()
def scoreboard(df: pd.DataFrame) -> Iterator[dict]:
    """Per architecture (skipped ones apart: :func:`skipped_table`): each ``dtype/scenario`` cell the clean runs'
    verdicts; ``bugs_found`` (found of the bugged runs where the bug acts), ``at_right_step``, the median steps
    from acting to detection, and ``fpr`` (clean runs called ``bug`` over clean runs)."""
    ok = _ordered(df)
    for arch, g in ok.groupby("architecture", sort=False) if len(ok) else ():
        if (g["verdict"] == SKIPPED).all():
            continue
        clean, bugged = g[g["bug"] == hf.NO_BUG], g[(g["bug"] != hf.NO_BUG) & (g["acting_step"] >= 0)]
        row = {"architecture": arch, "attention": ",".join(sorted(set(g["attention_used"].dropna())))}
        for (dtype, scenario), cell in clean.groupby(["dtype", "scenario"], sort=False):
            row[f"{dtype}/{scenario}"] = verdict_cell(cell["verdict"])
        judged = bugged[bugged["verdict"] != SKIPPED]
        found = judged[_found(judged)]
        steps = found[["first_bug_step", "logic_step"]].where(lambda x: x >= 0).min(axis=1) - found["acting_step"]
        judged_clean = clean[clean["verdict"] != SKIPPED]
        yield {
            **row,
            "bugs_found": f"{len(found)}/{len(judged)}" if len(judged) else "",
            "at_right_step": int(found["right_step"].astype(bool).sum()) if len(judged) else None,
            "steps_to_detect": float(steps.median()) if len(found) else None,
            "fpr": float((judged_clean["verdict"] == "bug").mean()) if len(judged_clean) else None,
        }


#: The form of kvfast's own refusals (:func:`kvfast.validation.not_allowed`): a model-call error with it is the
#: adapter refusing the model (no cache returned, a bug it cannot take), not the model's own failure.
REFUSAL = " is not allowed; allowed: "


def kind_of(kind: str | None, reason: str | None) -> str | None:
    """A skipped run's kind, with a ``run`` failure that is kvfast's refusal (:data:`REFUSAL`, raised inside a
    model call and so reported as that call's) counted as ``adapter``."""
    return "adapter" if kind == "run" and reason and REFUSAL in reason else kind


@tabled(["architecture", "skipped", "kind", "reason"])
def skipped_table(df: pd.DataFrame) -> Iterator[dict]:
    """Per architecture whose clean runs were skipped (every one, or some: ``skipped`` counts them): the kind and
    the first reason. A bug that cannot be injected into a model that runs is in :func:`bug_table`."""
    ok = _ordered(df)
    clean = ok[ok["bug"] == hf.NO_BUG] if len(ok) else ok
    skipped = clean[clean["verdict"] == SKIPPED] if len(clean) else clean
    for arch, g in skipped.groupby("architecture", sort=False) if len(skipped) else ():
        total = int((clean["architecture"] == arch).sum())
        first = g.iloc[0]
        yield {
            "architecture": arch,
            "skipped": f"{len(g)}/{total}",
            "kind": kind_of(first["skip_kind"], first["reason"]),
            "reason": first["reason"],
        }


BUG_COLUMNS = ("bug", "dtype", "runs", "found", "at_right_step", "missed_on", "not_injectable_on")


@tabled(BUG_COLUMNS)
def bug_table(df: pd.DataFrame) -> Iterator[dict]:
    """Per injected bug and dtype, over every architecture: runs where it acts, found, at the right step, the
    architectures where it was missed, and those (checked clean) where it could not be injected (the adapter
    refuses it, e.g. a position bug on a model whose ``forward`` takes no ``position_ids``)."""
    ok = _ordered(df)
    bugged = ok[ok["bug"] != hf.NO_BUG] if len(ok) else ok
    ran = set(ok.loc[(ok["bug"] == hf.NO_BUG) & (ok["verdict"] != SKIPPED), "architecture"]) if len(ok) else set()
    for (bug, dtype), all_runs in bugged.groupby(["bug", "dtype"], sort=False) if len(bugged) else ():
        g = all_runs[(all_runs["verdict"] != SKIPPED) & (all_runs["acting_step"] >= 0)]
        refused = all_runs[(all_runs["verdict"] == SKIPPED) & all_runs["architecture"].isin(ran)]
        found = _found(g)
        yield {
            "bug": bug,
            "dtype": dtype,
            "runs": len(g),
            "found": int(found.sum()),
            "at_right_step": int(g.loc[found, "right_step"].astype(bool).sum()),
            "missed_on": ", ".join(sorted(set(g.loc[~found, "architecture"]))),
            "not_injectable_on": ", ".join(sorted(set(refused["architecture"]))),
        }


def coverage(df: pd.DataFrame) -> tuple[int, int]:
    """``(architectures with at least one checked clean run, architectures in the runs)``."""
    ok = _ordered(df)
    if not len(ok):
        return 0, 0
    clean = ok[(ok["bug"] == hf.NO_BUG) & (ok["verdict"] != SKIPPED)]
    return int(clean["architecture"].nunique()), int(ok["architecture"].nunique())


def facts(df: pd.DataFrame) -> list[Fact]:
    """Coverage, clean verdict counts, bugs found and the median check time."""
    ok = _ordered(df)
    if not len(ok):
        return []
    checked, total = coverage(df)
    clean = ok[(ok["bug"] == hf.NO_BUG) & (ok["verdict"] != SKIPPED)]
    bugged = ok[(ok["bug"] != hf.NO_BUG) & (ok["verdict"] != SKIPPED) & (ok["acting_step"] >= 0)]
    versions = ", ".join(sorted(set(ok["transformers_version"].dropna())))
    return [
        Fact("hf_scan_coverage", f"hf_scan: architectures checked (transformers {versions})", f"{checked} of {total}"),
        Fact("hf_scan_clean", "hf_scan: clean runs by verdict", verdict_cell(clean["verdict"]) if len(clean) else ""),
        Fact(
            "hf_scan_bugs",
            "hf_scan: bugged runs found (where the bug acts)",
            f"{int(_found(bugged).sum())} of {len(bugged)}",
        ),
        Fact(
            "hf_scan_check_s",
            "hf_scan: median seconds per check (largest)",
            f"{ok['check_s'].median():.3f} ({ok['check_s'].max():.2f})",
        ),
    ]


def heatmap_table(df: pd.DataFrame) -> pd.DataFrame:
    """Architecture x ``dtype/scenario``: the worst clean verdict of the cell (``skipped`` when every run was)."""
    ok = _ordered(df)
    clean = ok[ok["bug"] == hf.NO_BUG] if len(ok) else ok
    if not len(clean):
        return pd.DataFrame()
    checked = clean[clean["verdict"] != SKIPPED]
    worst = functools.partial(max, key=lambda v: VERDICT_RANK.get(v, len(VERDICTS)))
    cells = checked.assign(cell=checked["dtype"] + "/" + checked["scenario"])
    table = cells.pivot_table(index="architecture", columns="cell", values="verdict", aggfunc=worst, sort=False)
    table = table.reindex(clean["architecture"].unique()).fillna(SKIPPED)
    return table.reset_index()


COLOURS = {
    "exact": "#1a9850",
    "rounding": "#91cf60",
    "inconclusive": "#fee08b",
    "length-dependent": "#fc8d59",
    "bug": "#d73027",
    SKIPPED: "#d9d9d9",
}


def _draw_heatmap(df: pd.DataFrame, table: pd.DataFrame):
    """One row per architecture, one column per dtype/scenario, coloured by the worst clean verdict."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    cells = table.set_index("architecture")
    codes = cells.apply(lambda col: col.map(VERDICT_RANK)).to_numpy(dtype=float)
    fig, ax = pyplot().subplots(figsize=(2.0 + 1.3 * cells.shape[1], 1.0 + 0.14 * cells.shape[0]))
    ax.imshow(codes, aspect="auto", cmap=ListedColormap([COLOURS[v] for v in VERDICTS]), vmin=0, vmax=len(VERDICTS) - 1)
    ax.set_yticks(range(len(cells)), cells.index, fontsize=6)
    ax.set_xticks(range(cells.shape[1]), cells.columns, fontsize=8, rotation=30, ha="right")
    ax.legend(handles=[Patch(color=COLOURS[v], label=v) for v in VERDICTS], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    ax.set_title("Clean runs: the worst verdict per architecture and cell")
    fig.tight_layout()
    return fig


FIGURES = (
    Figure(
        "hf_scan",
        "Every causal-LM architecture of transformers: clean verdicts",
        "Tiny random models of every model type in transformers' causal-LM auto mapping, checked per scenario "
        "(decode, resume) in the default mode. Each cell is the worst verdict over its clean runs: green is exact "
        "or rounding, red a bug called on a correct model, grey an architecture transformers cannot build or run here "
        "(the table hf_scan_skipped gives the reasons). The summary table adds, per architecture, how many injected "
        "cache bugs were found.",
        heatmap_table,
        _draw_heatmap,
    ),
)

STUDY = study_of(
    globals(),
    "hf_scan",
    "every causal-LM architecture of the installed transformers, checked and scored (needs kvfast[hf])",
    summarize=scoreboard,
    claims=None,  # a scoreboard, not a claim: the verdicts issue owns what clean runs must give
    tables=(("hf_scan_skipped", skipped_table), ("hf_scan_bugs", bug_table)),
    validate_groups=(),
    rank=120,
    reproduce=False,
)
