"""The Hugging Face studies (hf_matrix, hf_score) through the real command line: a reduced grid of each on two
workers, resumed, shown, and drawn by the report; torch stays optional (importing the studies does not import
it, and a grid of them without it is refused in one line)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from shared import HF, HF_SMALL_GRIDS, ROOT, environment
from shared import kvfast as run_kvfast

from kvfast.studies import STUDIES


@pytest.mark.subprocess
def test_importing_the_studies_imports_no_torch():
    code = "import sys, kvfast.studies.hf_matrix, kvfast.studies.hf_score; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_without_torch_a_grid_is_refused_in_one_line(monkeypatch):

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    for name in ("hf_matrix", "hf_score"):
        with pytest.raises(ValueError, match=rf"^study {name}: needs torch; allowed: install kvfast\[hf\]"):
            STUDIES[name].validate_config({})


def test_they_are_experiments_not_in_reproduce():
    assert not STUDIES["hf_matrix"].reproduce and not STUDIES["hf_score"].reproduce
    # the experiments that need optional extras: the Hugging Face studies and the engines study
    assert all(s.reproduce for n, s in STUDIES.items() if not n.startswith("hf_") and n != "engines")
    assert not STUDIES["engines"].reproduce


def kvfast(*args: str) -> subprocess.CompletedProcess:
    return run_kvfast(*args, script=True, env=environment(OMP_NUM_THREADS="1"))


def run_both_studies(root: Path, two_workers: bool) -> list[list[str]]:
    """Run the reduced grid of each study into ``root/<study>`` (on two workers through a real ``kvfast``
    process, or with ``--jobs 1`` in this process), check the stored rows; return the two command lines."""
    from kvfast.cli import main

    commands = []
    for name, body in HF_SMALL_GRIDS.items():
        toml = root.parent / f"{name}.toml"
        toml.write_text(f'study = "{name}"\n{body}')
        cmd = ["run", str(toml), "--out", str(root / name), "--jobs", "2" if two_workers else "1", "--quiet"]
        if two_workers:
            first = kvfast(*cmd)
            assert first.returncode == 0, first.stderr
        else:
            assert main(cmd) == 0
        commands.append(cmd)
    matrix = pd.read_parquet(root / "hf_matrix").set_index("bug")
    assert (matrix["status"] == "ok").all() and matrix.loc["none", "verdict"] == "rounding"
    assert (matrix.loc[["posoff", "replay"], "logic_verdict"] == "bug").all()
    assert matrix.loc[["posoff", "replay"], "logic_right_step"].all()
    score = pd.read_parquet(root / "hf_score").set_index("bug")
    assert score.loc["posoff", "kvfast_promoted_flag"] and not score.loc["none", "kvfast_promoted_flag"]
    return commands


@pytest.mark.skipif(not HF, reason="needs kvfast[hf] (torch and transformers)")
def test_both_studies_run(tmp_path):
    """The runs and their verdicts, in this process. On two workers through a real ``kvfast`` process, resumed,
    shown and drawn by `kvfast report`: the ``-m slow`` twin below (Hugging Face models checked on two workers
    through ``kvfast run``: tests/sweep/test_sweep_check_hf.py; the resume and show of any sweep:
    tests/sweep/test_sweep_cli.py; these studies' figures and facts in the report: tests/report/test_report.py)."""
    run_both_studies(tmp_path / "results", two_workers=False)


@pytest.mark.slow
@pytest.mark.skipif(not HF, reason="needs kvfast[hf] (torch and transformers)")
def test_both_studies_run_resume_show_and_report(tmp_path):
    root = tmp_path / "results"
    for cmd in run_both_studies(root, two_workers=True):
        again = kvfast(*cmd)
        assert again.returncode == 0 and "3 already stored, 0 run now" in again.stdout, again.stdout
        shown = kvfast("show", cmd[3])  # its --out
        assert shown.returncode == 0 and "3 runs stored: ok 3" in shown.stdout, shown.stdout
    report = kvfast("report", str(root), "--out", str(tmp_path / "rep"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "rep" / "report.html").read_text()
    for study in ("hf_matrix", "hf_score"):
        for figure in STUDIES[study].figures:
            assert figure.title.replace("'", "&#x27;") in page
    facts = kvfast("report", str(root), "--markdown", "facts")
    assert "hf_matrix study: clean runs" in facts.stdout and "hf_score study, float32 sdpa" in facts.stdout
