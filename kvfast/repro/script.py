"""A case as files a maintainer can run and read: :func:`render` (the standalone script,
:mod:`kvfast.repro.template`), :func:`issue_text` (ISSUE.md: the three-line summary first, then versions,
config, scenario, step, size and how it was found) and :func:`write_reproducer` (both, the case as JSON, and the
weights where the case carries them, into one folder).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfast.repro.case import Case
from kvfast.repro.known import label
from kvfast.repro.patches import patch_for
from kvfast.repro.template import TEMPLATE

SCRIPT = "reproduce.py"
ISSUE = "ISSUE.md"
CASE = "case.json"
WEIGHTS = "weights.pt"

SCENARIO_TEXT = {
    "decode": "prefill the prompt, then one token per decode step",
    "resume": "prefill the prompt's first chunk, continue the cache with the second chunk in one call, then one "
    "token per decode step",
    "rollback": "prefill, then before some decode steps a few draft tokens that cache.crop() removes again, one "
    "token per decode step",
    "fork": "prefill, snapshot (a deep copy of the cache); half the decode steps, snapshot; restore the prompt's "
    "snapshot and decode a second branch; restore the second snapshot and decode the rest",
    "reorder": "two beams of the prompt in one batch, each fed its own tokens; before some decode steps "
    "cache.reorder_cache([1, 0]) swaps their slots, as beam search does",
    "padded": "the prompt and a second one as one left-padded batch (the attention mask and positions generate "
    "builds), then one token per row per decode step",
}
#: What a second sequence's report judges (the script runs its scenario).
BRANCH_TEXT = {
    "fork": "the second branch, decoded from the prompt's snapshot",
    "reorder": "the second beam",
    "padded": "the batch's second row",
}


def scenario_text(case: Case) -> str:
    """The scenario in words, with the sequence judged where it is a second one."""
    text = SCENARIO_TEXT[case.run_scenario]
    if case.judged == "branch":
        text += f"; judged: {BRANCH_TEXT[case.run_scenario]}, against the recompute of its own tokens"
    return text


def _versions_text(case: Case) -> str:
    v = case.versions
    return f"python {v.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}"


def _promote_text(case: Case) -> str:
    return (
        f"- precision: a finding of kvfast's logic check. In {case.dtype} the two paths differ by no more than "
        f"{case.dtype}'s rounding lets kvfast tell apart (its {case.dtype} verdict is not `bug`), so the script "
        f"builds the model in {case.dtype} (its weights rounded to {case.dtype}) and runs both paths in "
        f"{case.promote}, where the cache's difference stands far above the {case.promote} rounding. A maintainer "
        f"who runs the model in {case.dtype} sees the same cause as a drift within {case.dtype}'s rounding."
    )


def _cache_text(case: Case) -> str:
    calls = case.calls
    if calls.get("cache_class"):
        return f"`transformers.{calls['cache_class']}(config=..., max_cache_len={calls.get('max_cache_len')})`"
    if calls.get("own_cache") or calls.get("cache_arg") == "cache_params":
        return "the model's own (no cache object given, as generate lets it)"
    return "a fresh `transformers.DynamicCache(config=...)`"


def title(case: Case) -> str:
    """The summary's first line."""
    what = "the cached path disagrees with the full recompute" if case.verdict == "bug" else "cache vs recompute"
    bug = f" (injected bug {case.bug[0]}:{case.bug[1]})" if case.bug else ""
    dtype = case.dtype if case.promote is None else f"{case.dtype} run in {case.promote}"
    return f"{case.model_class} ({case.architecture}), {dtype}, {case.scenario}: {what}{bug}"


def render(case: Case) -> str:
    """The standalone script of ``case`` (see :mod:`kvfast.repro.template`)."""
    weights = (
        f"seed {case.seed}: torch.manual_seed then _from_config"
        if case.seed is not None
        else f"weights from {WEIGHTS} beside it"
    )
    fields = {
        "TITLE": title(case),
        "MODEL_CLASS": case.model_class,
        "WEIGHTS_TEXT": weights,
        "SCENARIO_TEXT": scenario_text(case),
        "THRESHOLD_ORIGIN": case.threshold_origin,
        "COMMAND": case.command or "kvfast.repro (Python)",
        "MODEL_CLASS_REPR": repr(case.model_class),
        "CONFIG_JSON": json.dumps(case.config, indent=1, sort_keys=True),
        "SEED": repr(case.seed),
        "WEIGHTS": repr(None if case.seed is not None else WEIGHTS),
        "DTYPE": repr(case.dtype),
        "PROMOTE": repr(case.promote),
        "ATTENTION": repr(case.attention),
        "SCENARIO": repr(case.run_scenario),
        "JUDGED": repr(case.judged),
        "BRANCH_PROMPT": repr(list(case.branch_prompt)),
        "BRANCH_TOKENS": repr(list(case.branch_tokens)),
        "REORDER_AT": repr(_reorder_points(case)),
        "PROMPT": repr(list(case.prompt)),
        "TOKENS": repr(list(case.tokens)),
        "SPLIT": repr(case.split),
        "DRAFTS": repr({int(k): list(v) for k, v in case.drafts.items()}),
        "FOUND_ON": str(case.versions.get("transformers")),
        "CALLS": repr(case.calls),
        "THRESHOLD": repr([float(t) for t in case.threshold]),
        "THREADS": repr(_torch_threads()),
        "FOUND_VERSIONS": _versions_text(case),
        "PATCH": patch_for(case.bug),
    }
    text = TEMPLATE
    for key, value in fields.items():
        text = text.replace(f"@{key}@", value)
    return text


def _torch_threads() -> int:
    """torch's intra-op thread count in this process (where the case was checked), 1 without torch."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 1


def _reorder_points(case: Case) -> list[int]:
    if case.run_scenario != "reorder":
        return []
    from kvfast.check.scenarios.reorder import reorder_points

    return reorder_points(case.steps)


def finding_label(case: Case) -> tuple[str, str | None]:
    """``(label, reference)`` of ``case`` (:func:`kvfast.repro.known.label`)."""
    version = str(case.versions.get(case.library, ""))
    return label(case.library, version, case.architecture, case.scenario, injected=case.bug is not None)


def issue_text(case: Case) -> str:
    """ISSUE.md: the three lines a maintainer reads first, then the details."""
    tag, reference = finding_label(case)
    step = case.first_bug_step
    dev = case.deviation[step] if step is not None and step < len(case.deviation) else None
    thr = case.threshold[step] if step is not None and step < len(case.threshold) else None
    if step is None:
        where = "no step (kvfast found no bug: this reproducer exits 0)"
    else:
        judged = case.branch_prompt if case.judged == "branch" else case.prompt
        where = "the prompt's rows" if step == 0 else f"decode step {step} (position {len(judged) + step - 1})"
    size = "" if dev is None else f" by {dev:.4g} (threshold {thr:.3g}, {dev / thr:.3g}x)" if thr else f" by {dev:.4g}"
    lines = [
        f"# {title(case)}",
        "",
        f"1. **What**: with a tiny random {case.model_class}, the logits of `generate`'s cached path differ from a "
        f"full recompute of the same tokens at {where}{size}.",
        f"2. **Where**: scenario `{case.scenario}` ({scenario_text(case)}); {_versions_text(case)}.",
        f"3. **Run**: `python {SCRIPT}` (torch and transformers only): exits 1 while the bug is present, 0 once the "
        "two paths agree within the threshold it states.",
        "",
        f"Label: **{tag}**" + (f" ({reference})" if reference else " (in no registry of known bugs kvfast keeps)"),
        "",
        "## Details",
        "",
        f"- versions: {_versions_text(case)}",
        f"- model: `{case.model_class}`, model type `{case.architecture}`, {case.dtype}, {case.attention} attention, "
        + (f"weights `torch.manual_seed({case.seed})`" if case.seed is not None else f"weights in `{WEIGHTS}`"),
        f"- size: {len(case.prompt)}-token prompt, {case.steps} decode steps"
        + (f", resume split {case.split}" if case.split else "")
        + (f"; second sequence: {len(case.branch_prompt)}-token prompt, {len(case.branch_tokens)} steps"
           if case.branch_prompt else ""),
        f"- cache: {_cache_text(case)}",
        f"- first step over the threshold: {step}; kvfast's verdict: `{case.verdict}`"
        + (f" (of its logic check: the {case.dtype} model promoted to {case.promote})" if case.promote else ""),
        *([_promote_text(case)] if case.promote else []),
        f"- threshold: {case.threshold_origin}",
        f"- how it was found: `{case.command or 'kvfast.repro (Python)'}`",
        f"- injected bug: `{case.bug[0]}:{case.bug[1]}` (carried by the script itself)" if case.bug else
        "- injected bug: none (a finding about the library)",
        "",
        "Config (`AutoConfig.for_model(**config)`):",
        "",
        "```json",
        json.dumps(case.config, indent=1, sort_keys=True),
        "```",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def write_reproducer(case: Case, directory) -> Path:
    """``reproduce.py``, ``ISSUE.md`` and ``case.json`` (and ``weights.pt`` where the case carries its weights)
    written into ``directory`` (made if missing); the script's path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / SCRIPT).write_text(render(case))
    (out / ISSUE).write_text(issue_text(case))
    (out / CASE).write_text(case.to_json() + "\n")
    if case.weights is not None:
        import torch

        torch.save(case.weights, out / WEIGHTS)
    return out / SCRIPT
