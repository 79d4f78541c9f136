"""A case as files a maintainer can run and read: :func:`render` (the standalone script,
:mod:`kvfast.repro.template`), :func:`issue_text` (ISSUE.md: the three-line summary first, then versions,
config, scenario, step, size and how it was found) and :func:`write_reproducer` (both, the case as JSON, and the
weights where the case carries them, into one folder that :func:`require_repro_dir` allows).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from kvfast.repro.case import ReproCase, torch_threads
from kvfast.repro.known import label
from kvfast.repro.patches import cached_path_source, patch_for
from kvfast.repro.template import DOCSTRING, TEMPLATE
from kvfast.validation import printable, shown

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


def scenario_text(case: ReproCase) -> str:
    """The scenario in words, with the sequence judged where it is a second one."""
    text = SCENARIO_TEXT[case.run_scenario]
    if case.judged == "branch":
        text += f"; judged: {BRANCH_TEXT[case.run_scenario]}, against the recompute of its own tokens"
    return text


def _versions_text(case: ReproCase) -> str:
    v = case.versions
    return f"python {v.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}"


def _cache_text(case: ReproCase) -> str:
    calls = case.calls
    if calls.get("cache_class"):
        return md_code(f"transformers.{calls['cache_class']}(config=..., max_cache_len={calls.get('max_cache_len')})")
    if calls.get("own_cache") or calls.get("cache_arg") == "cache_params":
        return "the model's own (no cache object given, as generate lets it)"
    return "a fresh `transformers.DynamicCache(config=...)`"


def title(case: ReproCase) -> str:
    """The summary's first line."""
    what = "the cached path disagrees with the full recompute" if case.verdict == "bug" else "cache vs recompute"
    bug = f" (injected bug {case.bug[0]}:{case.bug[1]})" if case.bug else ""
    dtype = case.dtype if case.promote is None else f"{case.dtype} run in {case.promote}"
    return f"{case.model_class} ({case.architecture}), {dtype}, {case.scenario}: {what}{bug}"


def py_text(text: str) -> str:
    """A Python string literal that evaluates to exactly ``text``: triple-quoted, so that lines stay lines; as
    written where that is exact (no backslash, no three quotes, no closing quote last, every character printable),
    else with every backslash and double quote escaped and every character that is not printable (but a newline)
    written as its escape."""
    if "\\" not in text and '"""' not in text and not text.endswith('"') and printable(text, "\n") == text:
        return f'"""{text}"""'
    return '"""' + printable(text.replace("\\", "\\\\").replace('"', '\\"'), "\n") + '"""'


def _fill(template: str, fields: dict[str, str]) -> str:
    """``template`` with each ``@NAME@`` of ``fields`` replaced, in one pass (a value is never read again)."""
    pattern = re.compile("@(" + "|".join(map(re.escape, fields)) + ")@")
    return pattern.sub(lambda m: fields[m.group(1)], template)


def render(case: ReproCase) -> str:
    """The standalone script of ``case`` (see :mod:`kvfast.repro.template`)."""
    from kvfast.check.scenarios.reorder import reorder_points

    weights = (
        f"seed {case.seed}: torch.manual_seed then _from_config"
        if case.seed is not None
        else f"weights from {WEIGHTS} beside it"
    )
    doc = {
        "TITLE": title(case),
        "MODEL_CLASS": case.model_class,
        "WEIGHTS_TEXT": weights,
        "SCENARIO_TEXT": scenario_text(case),
        "THRESHOLD_ORIGIN": case.threshold_origin,
        "COMMAND": case.command or "kvfast.repro (Python)",
    }
    values = {  # each field written as its repr: data, never code
        **{name.upper(): getattr(case, name) for name in ("seed", "dtype", "promote", "attention", "split", "calls")},
        **{name.upper(): list(getattr(case, name)) for name in ("prompt", "tokens", "branch_prompt", "branch_tokens")},
        "MODEL_CLASS_REPR": case.model_class,
        "WEIGHTS": None if case.seed is not None else WEIGHTS,
        "SCENARIO": case.run_scenario,
        "JUDGED": case.judged,
        "REORDER_AT": reorder_points(case.steps) if case.run_scenario == "reorder" else [],
        "DRAFTS": {int(k): list(v) for k, v in case.drafts.items()},
        "FOUND_ON": str(case.versions.get("transformers")),
        "THRESHOLD": [float(t) for t in case.threshold],
        "THREADS": torch_threads(),
        "FOUND_VERSIONS": _versions_text(case),
    }
    fields = {
        **{name: repr(value) for name, value in values.items()},
        "DOCSTRING": py_text(_fill(DOCSTRING, doc)),
        "CONFIG_JSON": py_text(json.dumps(case.config, indent=1, sort_keys=True)),
        "CACHED_PATH": cached_path_source(),
        "PATCH": patch_for(case.bug),
    }
    return _fill(TEMPLATE, fields)


def finding_label(case: ReproCase) -> tuple[str, str | None]:
    """``(label, reference)`` of ``case`` (:func:`kvfast.repro.known.label`)."""
    version = str(case.versions.get(case.library, ""))
    return label(case.library, version, case.architecture, case.scenario, injected=case.bug is not None)


#: The characters Markdown may act on inside a line (emphasis, code, links, images, raw HTML, entities, tables).
MARKDOWN_ACTIVE = "\\`*_[]<>&|~!"


def md_text(text: object) -> str:
    """``text`` as Markdown that shows it and does nothing else: every character Markdown could act on
    (:data:`MARKDOWN_ACTIVE`) backslash-escaped, every character that is not printable written as its escape
    (one line)."""
    return "".join("\\" + c if c in MARKDOWN_ACTIVE else c for c in printable(text))


def md_code(text: object) -> str:
    """``text`` as one Markdown code span that its content cannot close: fenced by one backtick more than its
    longest run of backticks (padded with a space where it starts or ends with one), every character that is
    not printable written as its escape (one line)."""
    text = printable(text)
    if not text:
        return ""
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_block(text: str, info: str = "") -> list[str]:
    """``text`` as a fenced Markdown code block that its content cannot close (a fence of backticks longer than
    any run of them in it, at least three); its lines, each character that is not printable (but a newline)
    written as its escape."""
    text = printable(text, "\n")
    fence = "`" * max(3, max(map(len, re.findall("`+", text)), default=0) + 1)
    return [fence + info, *text.split("\n"), fence]


def issue_text(case: ReproCase) -> str:
    """ISSUE.md: the three lines a maintainer reads first, then the details. What the case holds is shown as text
    (:func:`md_text`) or code (:func:`md_code`, :func:`md_block`), never as Markdown of its own."""
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
    versions = md_text(_versions_text(case))
    dtype, promote = md_text(case.dtype), md_text(case.promote)
    lines = [
        f"# {md_text(title(case))}",
        "",
        f"1. **What**: with a tiny random {md_text(case.model_class)}, the logits of `generate`'s cached path differ "
        f"from a full recompute of the same tokens at {where}{size}.",
        f"2. **Where**: scenario {md_code(case.scenario)} ({md_text(scenario_text(case))}); {versions}.",
        f"3. **Run**: `python {SCRIPT}` (torch and transformers only): exits 1 while the bug is present, 0 once the "
        "two paths agree within the threshold it states.",
        "",
        f"Label: **{tag}**" + (f" ({reference})" if reference else " (in no registry of known bugs kvfast keeps)"),
        "",
        "## Details",
        "",
        f"- versions: {versions}",
        f"- model: {md_code(case.model_class)}, model type {md_code(case.architecture)}, {dtype}, "
        f"{md_text(case.attention)} attention, "
        + (f"weights `torch.manual_seed({case.seed})`" if case.seed is not None else f"weights in `{WEIGHTS}`"),
        f"- size: {len(case.prompt)}-token prompt, {case.steps} decode steps"
        + (f", resume split {case.split}" if case.split else "")
        + (f"; second sequence: {len(case.branch_prompt)}-token prompt, {len(case.branch_tokens)} steps"
           if case.branch_prompt else ""),
        f"- cache: {_cache_text(case)}",
        f"- first step over the threshold: {step}; kvfast's verdict: {md_code(case.verdict)}"
        + (f" (of its logic check: the {dtype} model promoted to {promote})" if case.promote else ""),
        *([f"- precision: a finding of kvfast's logic check. In {dtype} the two paths differ by no more than "
           f"{dtype}'s rounding lets kvfast tell apart (its {dtype} verdict is not `bug`), so the script "
           f"builds the model in {dtype} (its weights rounded to {dtype}) and runs both paths in "
           f"{promote}, where the cache's difference stands far above the {promote} rounding. A maintainer "
           f"who runs the model in {dtype} sees the same cause as a drift within {dtype}'s rounding."]
          if case.promote else []),
        f"- threshold: {md_text(case.threshold_origin)}",
        f"- how it was found: {md_code(case.command or 'kvfast.repro (Python)')}",
        f"- injected bug: {md_code(f'{case.bug[0]}:{case.bug[1]}')} (carried by the script itself)" if case.bug else
        "- injected bug: none (a finding about the library)",
        "",
        "Config (`AutoConfig.for_model(**config)`):",
        "",
        *md_block(json.dumps(case.config, indent=1, sort_keys=True), "json"),
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def require_repro_dir(path, field: str = "--repro") -> Path:
    """``path`` as the folder reproducers are written into, checked before any work: ``ValueError`` naming
    ``field`` unless it is a folder that does not exist yet or is empty (kvfast never overwrites a reproducer),
    named in UTF-8, that this user can make and write into."""
    text = os.fspath(path)

    def refused(why: str, more: str = "") -> ValueError:
        allowed = "a folder that does not exist yet or is empty, which this user can write"
        return ValueError(f"{field}: {shown(text)} ({why}) is not allowed; allowed: {allowed}{more}")

    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise refused("a name that is not UTF-8", ", named in UTF-8") from None
    folder = Path(text)
    try:
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                raise refused("a file")
            if any(folder.iterdir()):
                why = "a folder that holds files: kvfast never overwrites a reproducer"
                raise refused(why, " (move or delete it, or name another)")
            probe = folder
        else:
            probe = next(p for p in folder.absolute().parents if p.exists())
            if not probe.is_dir():
                raise refused(f"{str(probe)!r} is a file")
        import tempfile

        os.rmdir(tempfile.mkdtemp(prefix=".kvfast-probe-", dir=probe))
    except OSError as exc:
        raise refused(f"{exc.strerror or type(exc).__name__}: {exc.filename or text}") from None
    return folder


def write_reproducer(case: ReproCase, directory) -> Path:
    """``reproduce.py``, ``ISSUE.md`` and ``case.json`` (and ``weights.pt`` where the case carries its weights)
    written into ``directory``, a folder of their own (made if missing); the script's path. A reproducer is never
    overwritten: ``ValueError`` naming ``directory`` where it is a file, a folder that holds anything or one this
    user cannot write (:func:`require_repro_dir`). A write that fails (a full disk) removes
    what it wrote and raises its ``OSError``."""
    out = require_repro_dir(directory, "directory")
    texts = {SCRIPT: render(case), ISSUE: issue_text(case), CASE: case.to_json() + "\n"}
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        for name, text in texts.items():
            written.append(out / name)
            (out / name).write_text(text, encoding="utf-8")
        if case.weights is not None:
            import torch

            written.append(out / WEIGHTS)
            torch.save(case.weights, out / WEIGHTS)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        if made:
            out.rmdir()
        raise
    return out / SCRIPT
