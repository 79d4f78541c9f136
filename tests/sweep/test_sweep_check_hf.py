"""A check sweep over tiny Hugging Face models (examples/hf_check_study.py, examples/hf_check.toml) through
the real command line on 2 workers: every check stored, resumable, readable by pandas and DuckDB.

It is also the regression test for forking after torch: the warm-up run imports torch, whose thread
pools do not survive a fork, so the engine must start fresh workers instead (a forked worker hung).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from shared import ROOT

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch  # noqa: F401
else:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

KVFAST = str(Path(sys.executable).with_name("kvfast"))


def test_a_check_sweep_of_hugging_face_models_on_two_workers(tmp_path):
    text = (ROOT / "examples" / "hf_check.toml").read_text()
    small = text.replace('dtype = ["float32", "bfloat16"]', 'dtype = ["float32"]').replace(
        'attention = ["sdpa", "eager"]', 'attention = ["sdpa"]'
    )
    toml = tmp_path / "hf_check.toml"
    toml.write_text(small)
    out = tmp_path / "out"
    cmd = [KVFAST, "run", str(toml), "--out", str(out), "--jobs", "2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert first.returncode == 0, first.stderr
    assert "4 runs in the grid, 0 already stored, 4 run now" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0 and "4 already stored, 0 run now" in again.stdout
    df = pd.read_parquet(out).set_index(["family", "mode"])
    assert len(df) == 4 and (df["status"] == "ok").all()
    # stock sdpa attention sums a batch and a single row in different orders: control mode calls it rounding
    assert set(df.xs("control", level="mode")["verdict"]) == {"rounding"}
    assert df.xs("control", level="mode")["passed"].all()
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.connect().execute(f"select count(*) from read_parquet('{out}/*.parquet')").fetchone()
    assert rows == (4,)
