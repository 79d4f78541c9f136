"""Reproducers for a scan's ``bug`` rows (``kvfast scan --repro``): each written beside the results, never inside
the Parquet dataset (``DIR.repro/``), one per architecture, dtype, scenario and bug (its first row), shrunk.

Which rows: ``findings`` (the clean runs kvfast called ``bug``: findings about transformers) or ``all`` (the
injected catalogue bugs' rows too). A run called ``bug`` only by the float64 logic check (a bfloat16 run whose
own verdict is ``rounding`` or ``inconclusive``: the difference hides in bfloat16's rounding) is a finding too; its
reproducer is the logic check's (the bfloat16 model run in float64, :attr:`kvfast.repro.case.ReproCase.promote`), and
its listing's note says so. The listing (:func:`kvfast.repro.findings.findings_table`, new findings
first) is written as ``findings.md`` and ``findings.csv`` in the same folder.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from kvfast.studies import hf_common as hf

WHICH = ("findings", "all")


def repro_dir(results_dir) -> Path:
    """``DIR.repro`` beside the results directory ``DIR``."""
    path = Path(results_dir).absolute()
    return path.with_name(path.name + ".repro")


def logic_only(row) -> bool:
    """Whether ``row`` is ``bug`` by the float64 logic check alone (its own verdict is not ``bug``)."""
    return row["verdict"] != "bug" and row.get("logic_verdict") == "bug"


def bug_rows(df: pd.DataFrame, which: str = "findings") -> pd.DataFrame:
    """The first ``bug`` row per architecture, dtype, scenario and bug (``which``: :data:`WHICH`): called ``bug``
    natively (preferred) or by the logic check alone (:func:`logic_only`)."""
    from kvfast.validation import require_choice

    require_choice(which, "which", WHICH)
    if not len(df):
        return df
    logic = df["logic_verdict"] == "bug" if "logic_verdict" in df else False
    rows = df[(df["verdict"] == "bug") | logic]
    if which == "findings" and len(rows):
        rows = rows[rows["bug"] == hf.NO_BUG]
    if not len(rows):
        return rows
    rows = rows.assign(_logic=rows["verdict"] != "bug")
    order = ["architecture", "dtype", "scenario", "bug", "_logic", "seed", "prompt"]
    return rows.sort_values(order).drop_duplicates(["architecture", "dtype", "scenario", "bug"]).drop(columns="_logic")


def write_scan_reproducers(df: pd.DataFrame, results_dir, which: str = "findings", seconds: float = 60.0):
    """A reproducer for each of :func:`bug_rows` in ``DIR.repro/ARCH-DTYPE-SCENARIO-BUG/``; the findings table."""
    from kvfast.repro.case import SCRIPT_SCENARIOS, find_case, inject
    from kvfast.repro.findings import Finding, findings_table, write_case, write_findings
    from kvfast.studies.architectures import adapter_of, pad_token
    from kvfast.studies.hf_scan import _model, tokens

    where = repro_dir(results_dir)
    found = []
    for row in bug_rows(df, which).to_dict("records"):
        name = f"{row['architecture']}-{row['dtype']}-{row['scenario']}-{row['bug']}"
        bug = None if row["bug"] == hf.NO_BUG else ("hf", row["bug"])
        if row["scenario"] not in SCRIPT_SCENARIOS:
            why = f"no script replays {row['scenario']!r}"
            step = int(row["first_bug_step"])
            found.append(
                Finding(row["architecture"], row["dtype"], row["scenario"], row["bug"], "", None, step, None, why)
            )
            continue
        model = _model(row["architecture"], row["dtype"], row["attention"], int(row["seed"]))
        adapter = inject(adapter_of(model), bug)
        prompt, continuation = tokens(row, pad_token(model))
        command = (
            f"kvfast scan --families {row['architecture']} --dtypes {row['dtype']} --scenarios {row['scenario']} "
            f"--steps {row['steps']} --repro"
        )
        promote = row["promote"] if logic_only(row) else None
        case = find_case(adapter, prompt, row["scenario"], continuation=continuation, seed=int(row["seed"]),
                         command=command, promote=promote)  # fmt: skip
        finding = write_case(case, where / (name + ("-logic" if promote else "")), seconds)
        if promote:
            why = f"{row['dtype']} says {row['verdict']!r}; the {promote} logic check says 'bug' (the script runs it)"
            finding = replace(finding, note="; ".join(n for n in (why, finding.note) if n))
        found.append(finding)
    table = findings_table(found)
    if len(found):
        write_findings(table, where)
    return table
