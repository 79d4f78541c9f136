"""Reproducers for what a check or a scan found: :func:`reproduce_report` (every ``bug`` scenario of one check's
report: ``kvfast check ... --repro DIR``) and :class:`Finding` with :func:`findings_table` (the listing, new
findings first, each with its reproducer's path), kept beside the reproducers as :data:`FINDINGS_CSV` and
:data:`FINDINGS_MD` (:func:`write_findings`) and read back by :func:`read_findings` (``kvfast report`` and the
scan's scoreboard list them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfast.repro.case import SCRIPT_SCENARIOS, base_scenario, find_case
from kvfast.repro.known import LABELS
from kvfast.repro.script import finding_label, write_reproducer
from kvfast.repro.shrink import DEFAULT_SECONDS, GRACE_S, shrink_apart

#: What one reproducer may take beyond its shrinking's budget and :data:`~kvfast.repro.shrink.GRACE_S`: its case
#: found on the model (kvfast's control check of one scenario), the shrinking process's start, the files written.
SLACK_S = 120.0


@dataclass(frozen=True)
class Finding:
    """One finding and its reproducer: what (``architecture``, ``dtype``, ``scenario``, ``bug``: an injected
    catalogue bug or ``"none"``), its ``label`` (new, known, injected) and ``reference``, the first bug
    ``step`` of the shrunk case, its ``reproducer`` path (or ``None``) and a ``note`` (why there is none, what
    did not shrink); ``stopped``: why its shrinking stopped before its result (:attr:`Shrunk.stopped
    <kvfast.repro.shrink.Shrunk.stopped>`: the reproducer is then the case as found), not a column of the
    listing."""

    architecture: str
    dtype: str
    scenario: str
    bug: str
    label: str
    reference: str | None
    step: int | None
    reproducer: str | None
    note: str = ""
    stopped: str = ""


#: The listing's columns, in order.
COLUMNS = ("label", "architecture", "dtype", "scenario", "bug", "step", "reproducer", "reference", "note")
#: The listing's files, in the folder that holds the reproducers.
FINDINGS_CSV, FINDINGS_MD = "findings.csv", "findings.md"


def findings_table(findings: list[Finding]):
    """The findings as a DataFrame (:data:`COLUMNS`), new first (then known, then injected; a finding with no
    reproducer, unlabelled, last), each with its reproducer."""
    import pandas as pd

    return ordered(pd.DataFrame([{c: getattr(f, c) for c in COLUMNS} for f in findings], columns=list(COLUMNS)))


def ordered(table):
    """``table`` (rows of :data:`COLUMNS`) sorted new first, then known, then injected, then unlabelled; by
    architecture, dtype and scenario within a label; the index renumbered."""
    rank = {label: i for i, label in enumerate(LABELS)}

    def key(column):  # a label by its rank (any other, or none, last); the other columns as they are
        return column.map(rank).fillna(len(rank)) if column.name == "label" else column

    order = table.sort_values(["label", "architecture", "dtype", "scenario"], key=key, kind="stable")
    return order.reset_index(drop=True)


def write_findings(table, directory) -> Path:
    """``table`` (:func:`findings_table`) as :data:`FINDINGS_CSV` in ``directory`` (made if missing); its path.
    (The Markdown twin, :data:`FINDINGS_MD`, is the command's to write: Markdown tables are the report's.)"""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / FINDINGS_CSV, index=False, lineterminator="\n")
    return out / FINDINGS_CSV


def read_findings(directory):
    """The listing kept in ``directory`` (:data:`FINDINGS_CSV`), new first, empty cells as ``""`` (the step
    an integer or ``<NA>``); ``None`` where there is none; ``ValueError`` naming the file where it cannot be read
    as one (not CSV, not UTF-8, a step that is not an integer)."""
    import pandas as pd

    path = Path(directory) / FINDINGS_CSV
    if not path.is_file():
        return None
    try:
        table = pd.read_csv(path, dtype={"step": "Int64"}, encoding="utf-8").reindex(columns=list(COLUMNS))
    except (ValueError, TypeError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        from kvfast.validation import one_line

        why = one_line(f"{type(exc).__name__}: {exc}")[:300]
        raise ValueError(f"findings: {str(path)!r} cannot be read as a listing of findings ({why})") from None
    text = [c for c in COLUMNS if c != "step"]
    table[text] = table[text].astype(object).where(table[text].notna(), "")
    return ordered(table)


def bound_seconds(count: int, seconds: float = DEFAULT_SECONDS) -> float:
    """The most ``count`` reproducers may take, each shrunk within ``seconds``: what ``kvfast check --repro``
    gives them after its report before it ends them."""
    return count * (seconds + GRACE_S + SLACK_S)


def write_case(case, directory, seconds: float = DEFAULT_SECONDS) -> Finding:
    """``case`` shrunk (within ``seconds``, in a process of its own: :func:`~kvfast.repro.shrink.shrink_apart`;
    ``0``: not shrunk) and written into ``directory`` (:func:`~kvfast.repro.script.write_reproducer`: a folder of
    its own, never overwritten): its finding."""
    notes, stopped = [], ""
    if seconds and case.verdict == "bug":
        shrunk = shrink_apart(case, seconds)
        case, notes, stopped = shrunk.case, list(shrunk.lines()), shrunk.stopped
    path = write_reproducer(case, directory)
    if notes:
        try:
            (Path(directory) / "SHRINK.txt").write_text("\n".join(notes) + "\n", encoding="utf-8")
        except OSError:  # (a full disk) no reproducer without its notes: the folder, made for it, goes
            import shutil

            shutil.rmtree(directory, ignore_errors=True)
            raise
    tag, reference = finding_label(case)
    bug = "none" if case.bug is None else f"{case.bug[0]}:{case.bug[1]}"
    return Finding(
        case.architecture, case.dtype, case.scenario, bug, tag, reference, case.first_bug_step, str(path),
        "; ".join(notes[1:-1]), stopped,
    )  # fmt: skip


def reproduce_report(
    model, prompt, report, directory, *, seconds: float = DEFAULT_SECONDS, seed: int = 0, command: str = ""
) -> list[Finding]:
    """A reproducer for every scenario of ``report`` called ``bug`` (a check of ``model``, a transformers causal
    LM or an :class:`~kvfast.check.hf.HFModel`, on ``prompt``), each in ``directory/SCENARIO/``, shrunk within
    ``seconds``. A scenario no script replays, a model that is not a Hugging Face one, or a reproducer that
    cannot be written (its folder there already, a full disk, a read-only folder) gets a finding with no
    reproducer and the reason."""
    from kvfast.check.hf import HFModel, is_hf_model

    out = []
    for name, s in report.scenarios.items():
        if s.verdict not in ("bug", "divergent"):
            continue
        if not (isinstance(model, HFModel) or is_hf_model(model)):
            why = f"no reproducer: kvfast writes them for Hugging Face models only, not {type(model).__name__}"
        elif name not in SCRIPT_SCENARIOS:
            why = f"no reproducer: a script replays {', '.join(SCRIPT_SCENARIOS)}, not {name!r}"
        else:
            try:
                main = report.scenarios.get(base_scenario(name), s)  # a second branch's run: its scenario's tokens
                case = find_case(model, prompt, name, continuation=list(main.tokens), seed=seed, command=command)
            except ValueError as exc:  # a cache a script does not build (a quantized cache, a class of its own)
                case, why = None, f"no reproducer: {exc}"
            if case is not None and case.verdict != "bug":
                why = f"no reproducer: kvfast's control check of {name!r} alone says {case.verdict!r}"
            elif case is not None:
                try:
                    out.append(write_case(case, Path(directory) / name, seconds))
                    continue
                except (OSError, ValueError) as exc:
                    why = f"no reproducer: {' '.join(str(exc).split())}"
        arch = str(getattr(getattr(getattr(model, "model", model), "config", None), "model_type", "?"))
        out.append(Finding(arch, "", name, "", "", None, s.first_bug_step, None, why))
    return out
