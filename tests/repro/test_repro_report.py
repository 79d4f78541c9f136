"""The findings a scan's reproducers were written for, listed new first with their label, reference and
reproducer: read back from ``DIR.repro/findings.csv``, at the head of ``kvfast report``'s page and in its
output, and in the scan's ``scoreboard.md``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from shared import ROOT

from kvfast.report.scan_findings import findings_html, findings_text, scan_findings
from kvfast.repro.findings import COLUMNS, FINDINGS_CSV, read_findings
from kvfast.sweep.store import MANIFEST


def _row(label, arch, reproducer="", reference="", note="", step=1):
    return {"label": label, "architecture": arch, "dtype": "float32", "scenario": "decode", "bug": "none",
            "step": step, "reproducer": reproducer, "reference": reference, "note": note}  # fmt: skip


def _scan_dir(tmp_path: Path, rows: list[dict]) -> Path:
    """A results folder the report takes for an ``hf_scan`` one (its manifest), with ``rows`` as its listing."""
    results = tmp_path / "scan"
    results.mkdir()
    (results / MANIFEST).write_text(json.dumps({"study": "hf_scan"}))
    repro = tmp_path / "scan.repro"
    repro.mkdir()
    pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(repro / FINDINGS_CSV, index=False)
    return results


def test_the_listing_reads_back_new_first_each_with_its_reproducer_and_reference(tmp_path):
    script = str(tmp_path / "scan.repro" / "b-float32-decode-none" / "reproduce.py")
    rows = [
        _row("injected", "a", "x/reproduce.py", "kvfast's own bug catalogue"),
        _row("", "z", note="no reproducer: a script replays decode, not 'fork'", step=None),
        _row("known", "c", "y/reproduce.py", "docs/check.md, section 9"),
        _row("new", "b", script),
    ]
    results = _scan_dir(tmp_path, rows)
    table = scan_findings(results)
    assert list(table["label"]) == ["new", "known", "injected", ""]
    assert list(table["architecture"]) == ["b", "c", "a", "z"]
    assert table["step"].isna().tolist() == [False, False, False, True]
    assert table.loc[1, "reference"] == "docs/check.md, section 9" and table.loc[0, "reference"] == ""
    text = findings_text(table)
    assert text.startswith("4 findings: 1 new, 1 known, 1 injected; 3 with a reproducer")
    assert [line.split()[0] for line in text.splitlines()[3:6]] == ["new", "known", "injected"]
    page = findings_html(table, tmp_path / "scan.report")
    assert page.index(">new<") < page.index(">known<") < page.index(">injected<")
    assert '<a href="../scan.repro/b-float32-decode-none/reproduce.py">reproduce.py</a>' in page
    assert '<a href="../scan.repro/b-float32-decode-none/ISSUE.md">ISSUE.md</a>' in page
    assert "no reproducer: a script replays decode, not &#x27;fork&#x27;" in page


def test_no_listing_is_none(tmp_path):
    results = tmp_path / "scan"
    results.mkdir()
    (results / MANIFEST).write_text(json.dumps({"study": "hf_scan"}))
    assert scan_findings(results) is None and read_findings(tmp_path / "scan.repro") is None


@pytest.mark.slow  # a scan and two reports end to end: over a minute on the loaded 2-core machine
@pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("torch", "transformers")), reason="needs kvfast[hf]"
)
def test_a_scan_with_repro_lists_its_findings_in_the_scoreboard_and_the_report(tmp_path):
    """A small scan end to end: Mamba's resume (a known finding) and Llama with an injected bug; the scoreboard
    and ``kvfast report`` (page and output) list them, known before injected, each with its reproducer."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "scan"
    args = ["--families", "llama", "mamba", "--dtypes", "float32", "--scenarios", "resume", "--seeds", "1"]
    args += ["--prompts", "1", "--steps", "3", "--bugs", "restart", "--repro", "all", "--repro-seconds", "3"]
    args += ["--jobs", "1", "--quiet", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "kvfast.cli", "scan", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "findings, new first: 2 findings: 1 known, 1 injected; 2 with a reproducer" in done.stdout
    board = (tmp_path / "scan.report" / "scoreboard.md").read_text()
    listing = board[board.index("findings, new first") :]
    assert listing.index("| known | mamba |") < listing.index("| injected | llama |")
    assert str(tmp_path / "scan.repro" / "mamba-float32-resume-none" / "reproduce.py") in listing
    assert (tmp_path / "scan.repro" / "findings.md").read_text().startswith("| label | architecture |")
    report = subprocess.run([sys.executable, "-m", "kvfast.cli", "report", str(out)], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert re.search(r"^findings, new first: 2 findings: 1 known, 1 injected", report.stdout, re.M)
    page = (tmp_path / "scan.report" / "report.html").read_text()
    assert page.index('id="findings"') < page.index('id="claims"')
    assert '<a href="../scan.repro/mamba-float32-resume-none/reproduce.py">' in page
    md = subprocess.run([sys.executable, "-m", "kvfast.cli", "report", str(out), "--markdown", "findings"],
                        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert md.returncode == 0 and "| known | mamba | float32 | resume | none | 0 |" in md.stdout


EXACTNESS = """study = "exactness"
[fixed]
vocab = 11
d_model = 8
d_ff = 12
n_layer = 1
n_head = 2
prompt_len = 3
steps = 4
order = "sequential"
[axes]
seed = [0]
preset = ["f64"]
"""


@pytest.mark.subprocess
def test_a_damaged_listing_is_one_line_naming_it_and_the_rest_of_the_report_is_written(tmp_path):
    """``kvfast report`` of results whose listing is damaged (not UTF-8): one warning line names the file, on
    stderr and on the page; the page and its tables are written (exit 0). The control: the same listing whole is
    read and shown."""
    from kvfast.cli import main

    results = tmp_path / "exactness"
    (tmp_path / "grid.toml").write_text(EXACTNESS)
    assert main(["run", str(tmp_path / "grid.toml"), "--out", str(results), "--jobs", "1", "--quiet"]) == 0
    (tmp_path / "exactness.repro").mkdir()
    listing = tmp_path / "exactness.repro" / FINDINGS_CSV
    rows = [_row("new", "arch-a", str(tmp_path / "exactness.repro" / "x" / "reproduce.py"))]
    pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(listing, index=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def report():
        done = subprocess.run([sys.executable, "-m", "kvfast.cli", "report", str(results)], capture_output=True,
                              text=True, env=env, timeout=600)  # fmt: skip
        return done, (tmp_path / "exactness.report" / "report.html").read_text()

    done, page = report()
    assert done.returncode == 0 and not done.stderr and "arch-a" in page and "arch-a" in done.stdout  # the control
    listing.write_bytes(b"\xff\xfe" + listing.read_bytes())
    (tmp_path / "exactness.report" / "claims.csv").unlink()
    done, page = report()
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1 and f"kvfast: warning: findings: {str(listing)!r} cannot be read" in done.stderr
    assert "UnicodeDecodeError" in done.stderr and done.stderr.rstrip().endswith("the report leaves it out")
    assert "arch-a" not in page and "cannot be read as a listing" in page and "arch-a" not in done.stdout
    assert (tmp_path / "exactness.report" / "claims.csv").is_file() and "report: " in done.stdout
