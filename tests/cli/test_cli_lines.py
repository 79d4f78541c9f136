"""Issue 42: one line and a documented exit code where the command line promises them (each was a traceback and
exit 70, or exit 4 blaming the model). Real ``python -m kvfast.cli`` processes; each guard has its control, the
same command that works.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shared import ROOT, TESTS, environment
from shared import kvfast as run_kvfast

import kvfast.studies  # noqa: F401 - registers the built-in studies
from kvfast.commands.check import EXIT_BAD_INPUT, EXIT_PASS
from kvfast.sweep import grid_from_spec, run_sweep
from kvfast.sweep.store import MANIFEST

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

CHECK = ["check", "examples.tiny_model:clean", "--prompt", "1,2,3", "--steps", "4"]
KVFAST_MODEL = ["check", "kvfast.studies.check:kvfast_model", "--prompt", "1,2,3"] + [
    f"--factory-arg={kv}"
    for kv in (
        "seed=0", "n_layer=1", "n_head=2", "d_model=8", "d_ff=16", "vocab=11", "preset=f64",
        "order=sequential", "attention=standard", "bug=none", "max_pos=8",
    )
]  # fmt: skip


ENV = environment(TESTS)


def kvfast(
    *argv: str, cwd: Path = ROOT, env: dict | None = None, shell_prefix: str = ""
) -> subprocess.CompletedProcess:
    return run_kvfast(*argv, cwd=cwd, env=env or ENV, shell_prefix=shell_prefix)


def one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The command's exit code is ``code`` and its stderr one line (no traceback) saying every one of ``needles``."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    return proc.stderr


def test_check_from_a_deleted_working_directory_is_one_line(tmp_path):
    (tmp_path / "here").mkdir()
    assert kvfast(*CHECK, cwd=tmp_path / "here").returncode == EXIT_PASS  # control: the directory exists
    (tmp_path / "gone").mkdir()
    proc = kvfast(*CHECK, cwd=tmp_path / "gone", shell_prefix='rmdir "$PWD"')
    one_line(proc, EXIT_BAD_INPUT, "working directory:", "gone", "no longer exists", "allowed: an existing directory")


def test_check_timeout_beyond_what_the_timer_takes_is_one_line():
    assert kvfast(*CHECK, "--timeout", "1e9").returncode == EXIT_PASS  # control: the longest allowed
    for value in ("1e10", "inf"):
        proc = kvfast(*CHECK, "--timeout", value)
        one_line(proc, EXIT_BAD_INPUT, "--timeout:", "allowed: None or a number of seconds > 0 and <= 1e+09")


def test_more_steps_than_kvfasts_own_model_has_positions_is_bad_input():
    """max_pos=8, a prompt of 3: 5 steps fit (control), 6 do not (was exit 4: "the model under test failed")."""
    assert kvfast(*KVFAST_MODEL, "--steps", "5").returncode == EXIT_PASS
    proc = kvfast(*KVFAST_MODEL, "--steps", "6")
    one_line(proc, EXIT_BAD_INPUT, "steps: 6 is not allowed; allowed: at most 5 (the model has 8 positions")


def test_the_vllm_engine_without_torch_names_the_extra_to_install(tmp_path):
    """Was exit 4, "the factory ... raised ModuleNotFoundError: No module named 'torch'": the adapter imported
    torch before vLLM. A folder first on PYTHONPATH whose torch.py raises ModuleNotFoundError stands for an
    environment without torch (control: importing torch there fails)."""
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    env = {**ENV, "PYTHONPATH": f"{tmp_path / 'shadow'}:{ENV['PYTHONPATH']}"}
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    proc = kvfast("check", "--engine", "vllm", tmp_path / "model", "--prompt", "1,2,3", "--steps", "4", env=env)
    one_line(proc, EXIT_BAD_INPUT, "a vLLM model needs vllm; allowed: pip install 'kvfast[vllm]'")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A results directory of the exactness study (one run)."""
    out = tmp_path_factory.mktemp("results") / "ex"
    spec = {
        "study": "exactness",
        "fixed": {"vocab": 11, "d_model": 8, "d_ff": 12, "n_layer": 1, "n_head": 2, "prompt_len": 3, "steps": 4},
        "axes": {"seed": [0], "preset": ["f64"], "order": ["sequential"]},
    }
    run_sweep(grid_from_spec(spec), out, jobs=1, quiet=True)
    return out


@pytest.mark.parametrize(
    "breaker", [lambda text: "[1, 2]", lambda text: text[: len(text) // 2]], ids=["a JSON list", "truncated"]
)
def test_report_of_a_broken_manifest_is_one_line_naming_it(results, tmp_path, breaker):
    assert kvfast("report", results, "--markdown").returncode == 0  # control: the manifest as written
    broken = tmp_path / "ex"
    shutil.copytree(results, broken)
    manifest = broken / MANIFEST
    json.loads(manifest.read_text())
    manifest.write_text(breaker(manifest.read_text()))
    for flags in ([], ["--markdown"]):
        proc = kvfast("report", broken, *flags)
        one_line(proc, EXIT_BAD_INPUT, str(manifest), f"kvfast repair {broken}")
