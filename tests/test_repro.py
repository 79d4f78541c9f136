"""kvfast.repro: a finding as a standalone reproducer that runs without kvfast, exits 1 while the bug is there
and 0 on a clean model; the injected catalogue bugs a script can carry; shrinking; known or new."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfast.bugs import CATALOGUES  # noqa: E402
from kvfast.check.hf import HFModel, tiny_model  # noqa: E402
from kvfast.repro import find_case, write_reproducer  # noqa: E402
from kvfast.repro.patches import PATCHES, patch_for  # noqa: E402

#: Runs a script with kvfast made unimportable (``sys.modules['kvfast'] = None``) and in isolated mode (no
#: PYTHONPATH, no current directory on sys.path): what it imports must be torch and transformers only.
NO_KVFAST = (
    "import runpy, sys; sys.modules['kvfast'] = None; sys.argv = [sys.argv[1]]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
PROMPT = np.array([5, 17, 42, 8])
CONTINUATION = np.array([3, 61, 9, 27, 33, 70, 12, 4, 88, 1, 50, 23])


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def run_script(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-c", NO_KVFAST, str(path)], capture_output=True, text=True, timeout=300
    )


def first_differing_step(out: str) -> int | None:
    found = re.search(r"^first differing step: (\d+) ", out, re.M)
    return None if found is None else int(found.group(1))


def test_the_guard_makes_kvfast_unimportable(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import kvfast\n")
    done = run_script(script)
    assert done.returncode == 1 and "import of kvfast halted" in done.stderr


def _case(family, bug, scenario, tmp_path, seed=0):
    adapter = HFModel(tiny_model(family, seed=seed))
    if bug is not None:
        adapter = CATALOGUES[bug[0]][bug[1]].inject(adapter)
    case = find_case(adapter, PROMPT, scenario, continuation=CONTINUATION, seed=seed, command="tests/test_repro.py")
    return case, write_reproducer(case, tmp_path / "repro")


def test_an_injected_bug_reproduces_without_kvfast_and_a_clean_model_exits_0(tmp_path):
    case, script = _case("llama", ("hf", "posoff"), "decode", tmp_path)
    assert case.verdict == "bug" and case.first_bug_step == 1 and case.bug == ("hf", "posoff")
    done = run_script(script)
    assert done.returncode == 1, done.stderr
    assert first_differing_step(done.stdout) == 1
    assert "versions: python" in done.stdout and "transformers" in done.stdout
    assert "INJECTED BUG" in script.read_text()
    clean, script = _case("llama", None, "decode", tmp_path / "clean")
    assert clean.verdict == "rounding" and clean.bug is None
    done = run_script(script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert first_differing_step(done.stdout) is None and "no bug shown" in done.stdout


def test_the_script_measures_what_kvfast_measured(tmp_path):
    """A finding of the library itself (no patch): the script's per-step deviations are kvfast's, digit for digit
    as printed (the same calls, the same recompute rows)."""
    from kvfast.studies.architectures import tiny_architecture

    model = tiny_architecture("mamba", "float32", "auto", 0)
    case = find_case(model, PROMPT, "resume", continuation=CONTINUATION[:6], command="tests/test_repro.py")
    assert case.verdict == "bug" and case.bug is None
    script = write_reproducer(case, tmp_path)
    done = run_script(script)
    assert done.returncode == 1, done.stderr
    assert first_differing_step(done.stdout) == case.first_bug_step
    rows = re.findall(r"^\s+(\d+)\s+[\d-]+\s+(\S+)\s+\S+", done.stdout, re.M)
    assert [float(d) for _, d in rows] == [float(f"{d:.6g}") for d in case.deviation]
    text = (tmp_path / "ISSUE.md").read_text()
    assert "Label: **known**" in text and "resume" in text and "transformers" in text


def test_a_bug_no_script_carries_is_refused_by_name():
    with pytest.raises(ValueError, match="bug: 'operations:reorder_keys_only' is not allowed; allowed: .*hf:posoff"):
        patch_for(("operations", "reorder_keys_only"))


CARRIED = {
    ("hf", "posoff"): ("llama", "decode"),
    ("hf", "restart"): ("llama", "resume"),
    ("hf", "replay"): ("llama", "resume"),
    ("hf", "window"): ("llama", "decode"),
    ("hf", "freeze"): ("llama", "decode"),
    ("hf", "f16"): ("llama", "decode"),
    ("operations", "crop_short"): ("llama", "rollback"),
    ("operations", "window_evicts_one_too_many"): ("mistral", "decode"),
}


def test_every_patch_has_a_case():
    assert set(CARRIED) == set(PATCHES)


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(CARRIED), ids=lambda b: f"{b[0]}:{b[1]}")
def test_every_carried_catalogue_bug_reproduces_without_kvfast(bug, tmp_path):
    family, scenario = CARRIED[bug]
    case, script = _case(family, bug, scenario, tmp_path)
    assert case.verdict == "bug", case
    done = run_script(script)
    assert done.returncode == 1, done.stdout + done.stderr
    assert first_differing_step(done.stdout) == case.first_bug_step
