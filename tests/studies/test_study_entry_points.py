"""The built-in studies are found like any installed package's: each is an entry point of the group
``kvfast.studies`` in pyproject.toml, so the sweep's Python API loads and runs a grid naming one without
``import kvfast.studies`` first, while ``kvfast.sweep`` itself imports nothing from the studies.

The subprocess tests put a distribution made from pyproject.toml's entry points on ``sys.path`` (an
environment installed before they were added has none in its metadata until it is reinstalled, as
``python3 dev.py`` does when pyproject.toml changes).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from shared import ROOT

GROUP = "kvfast.studies"


def declared(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    return tomllib.loads(pyproject.read_text())["project"].get("entry-points", {}).get(GROUP, {})


def problems(entries: dict[str, str]) -> list[str]:
    """What differs between the entry points ``entries`` and the built-in studies (one line each)."""
    from kvfast.studies import STUDIES

    out = [f"{name}: a built-in study without an entry point" for name in sorted(set(STUDIES) - set(entries))]
    out += [f"{name}: an entry point of no built-in study" for name in sorted(set(entries) - set(STUDIES))]
    for name in sorted(set(entries) & set(STUDIES)):
        module, _, attr = entries[name].partition(":")
        if getattr(importlib.import_module(module), attr, None) is not STUDIES[name]:
            out.append(f"{name}: {entries[name]} is not the registered study")
    return out


def test_every_builtin_study_is_an_entry_point():
    assert problems(declared()) == []


def test_a_study_left_out_or_misnamed_is_found():
    """The control: an entry point removed, and one pointing at another study, are each reported."""
    entries = declared()
    del entries["training"]
    entries["bugs"] = "kvfast.studies.detector:STUDY"
    assert problems(entries) == [
        "training: a built-in study without an entry point",
        "bugs: kvfast.studies.detector:STUDY is not the registered study",
    ]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """An environment whose ``sys.path`` holds a distribution with pyproject.toml's ``kvfast.studies`` entry
    points (and kvfast from this tree)."""
    info = tmp_path / "site" / "kvfast_studies_under_test-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvfast-studies-under-test\nVersion: 0\n")
    lines = [f"[{GROUP}]", *(f"{name} = {value}" for name, value in declared().items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "site")])}


GRID = """study = "exactness"
[fixed]
vocab = 32
d_model = 16
d_ff = 32
n_layer = 1
n_head = 1
prompt_len = 3
steps = 4
order = "sequential"
preset = "f64"
[axes]
seed = [0, 1]
"""

SWEEP = """
import sys
from kvfast.sweep import load_grid, run_sweep

assert "kvfast.studies" not in sys.modules, "importing kvfast.sweep imported the studies"
assert len(load_grid("exactness")) == 1296
report = run_sweep(load_grid(sys.argv[1]), sys.argv[2], jobs=1, quiet=True)
print({k: v for k, v in report.counts.items() if v})
"""


@pytest.mark.subprocess
def test_a_grid_naming_a_builtin_study_loads_and_sweeps_without_importing_the_studies(tmp_path, env):
    (tmp_path / "g.toml").write_text(GRID)
    args = [sys.executable, "-c", SWEEP, str(tmp_path / "g.toml"), str(tmp_path / "out")]
    proc = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "{'ok': 2}"


@pytest.mark.subprocess
def test_without_the_entry_points_the_name_is_refused(tmp_path, env):
    """The control: the same lookup with no entry point found refuses ``exactness`` in one line."""
    code = (
        "import kvfast.sweep.grid as g\n"
        "g.entry_points_of = lambda group: {}\n"
        "try:\n"
        "    g.load_grid('exactness')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "study: 'exactness' is not allowed; allowed: a registered name (none is found" in proc.stdout
