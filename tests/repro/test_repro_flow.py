"""``kvfast check --repro``: a bug found is always reported first. The check's report and exit code are final
before any reproducer work; shrinking runs in a process of its own, killed at its bound, so a candidate that hangs
or crashes costs only the shrinking (the reproducer is the case as found, one line says why); a ``--repro``
folder that is a file, unwritable, not UTF-8 or already holds files is one line and exit 2 before the check;
a write that fails (a full disk) is one line after the report; ``kvfast scan --repro`` checks its ``DIR.repro``
before any run."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shared import ROOT, kvfast

from kvfast.repro.script import require_repro_dir

HF = all(__import__("importlib").util.find_spec(m) for m in ("torch", "transformers"))
needs_hf = pytest.mark.skipif(not HF, reason="needs kvfast[hf]")

BUGGY = """
from kvfast.bugs.hf import inject_hf_bug
from kvfast.check.hf import HFModel
from kvfast.testing import tiny_model


def buggy(seed=0):
    return inject_hf_bug(HFModel(tiny_model("llama", seed=seed)), "posoff")
"""
#: Loaded by every Python process of the test (on PYTHONPATH): in the shrinking process only, each candidate of a
#: scenario named in KVFAST_TEST_CANDIDATE hangs (``decode=hang``) or crashes its process (``resume=crash``), as
#: transformers may on a config it does not take.
SITECUSTOMIZE = """
import os, sys
HOW = dict(part.split("=") for part in os.environ.get("KVFAST_TEST_CANDIDATE", "").split(",") if part)
if HOW and "from kvfast.repro.shrink import shrink_child" in " ".join(sys.orig_argv):
    import signal, time
    import kvfast.repro.shrink as shrink

    def _verdict(case, _real=shrink._verdict):
        how = HOW.get(case.scenario)
        if how == "hang":
            time.sleep(3600)
        if how == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        return _real(case)

    shrink._verdict = _verdict
"""
CHECK = ["check", "buggy_factory:buggy", "--prompt", "5,17,42,8", "--steps", "4", "--mode", "control"]


def _env(tmp_path: Path, **extra) -> dict:
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "buggy_factory.py").write_text(BUGGY)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(hooks)]), "OMP_NUM_THREADS": "1", **extra}


def _kvfast(tmp_path, *args, env=None, **popen) -> subprocess.CompletedProcess:
    return kvfast(*args, cwd=tmp_path, env=env or _env(tmp_path), timeout=900, text=False, **popen)


@pytest.mark.subprocess
@needs_hf
def test_a_hanging_and_a_crashing_candidate_cost_only_their_shrinking_and_the_report_comes_first(tmp_path):
    """Two scenarios called bug: every shrinking candidate of decode hangs, every one of resume crashes its
    process. The report is printed at once (long before the end), its exit code 1; decode's shrinking is killed
    at its bound, resume's ends with SIGSEGV; each reproducer is written (the case as found), each with one line
    saying why it was not shrunk."""
    env = _env(tmp_path, KVFAST_TEST_CANDIDATE="decode=hang,resume=crash")
    args = [sys.executable, "-m", "kvfast.cli", *CHECK, "--scenarios", "decode,resume", "--repro", "out",
            "--repro-seconds", "1"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
    stderr = proc.stderr.read()
    assert proc.wait(timeout=900) == 1, stderr
    end = time.monotonic() - start
    report_at = next(t for t, line in lines if line.startswith("kvfast check: "))
    text = "\n".join(line for _, line in lines)
    assert "BUG" in lines[0][1] and end - report_at > 30, (report_at, end)  # printed before the 31 s hang ended
    assert "scenario 'decode' (control): bug" in text and "scenario 'resume' (control): bug" in text
    for name in ("decode", "resume"):
        assert (tmp_path / "out" / name / "reproduce.py").is_file() and (tmp_path / "out" / name / "ISSUE.md").is_file()
        assert f"reproducer, {name}: out/{name}/reproduce.py (injected" in text
        assert text.index("per-step table") < text.index(f"reproducer, {name}:")  # after the report
    assert "reproducer, decode: not shrunk (the search stopped: its process was still running 31 s" in text
    assert "while checking the candidate steps 4 -> 1, and was killed): it is the case as found" in text
    assert "reproducer, resume: not shrunk (the search stopped: its process ended without a result (killed by " in text
    assert "signal SIGSEGV) while checking the candidate steps" in text
    assert "not shrunk: the search stopped" in (tmp_path / "out" / "decode" / "SHRINK.txt").read_text()
    assert not stderr.strip(), stderr


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["file", "holds files", "unwritable", "not UTF-8", "a file on the way"])
def test_a_bad_repro_folder_is_one_line_and_exit_2_before_the_check(tmp_path, how):
    """Each bad ``--repro``: one line naming ``--repro`` and why, exit 2, before the check runs (no report) and
    with what was there untouched."""
    out: str | bytes = str(tmp_path / "out")
    if how == "file":
        (tmp_path / "out").write_text("mine")
    elif how == "holds files":
        (tmp_path / "out" / "decode").mkdir(parents=True)
        (tmp_path / "out" / "decode" / "weights.pt").write_text("an earlier run's")
    elif how == "unwritable":
        out = str(_unwritable(tmp_path) / "out")
    elif how == "not UTF-8":
        out = os.fsencode(tmp_path) + b"/out\xff"
    else:
        (tmp_path / "f").write_text("mine")
        out = str(tmp_path / "f" / "out")
    done = _kvfast(tmp_path, *CHECK, "--repro", out)
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and err.startswith("kvfast: error: --repro: "), err
    assert "is not allowed; allowed: a folder that does not exist yet or is empty" in err and not done.stdout
    why = {"file": r"\(a file\)", "holds files": "kvfast never overwrites a reproducer", "not UTF-8": "not UTF-8",
           "unwritable": "(Permission denied|Operation not permitted|Read-only file system): ",
           "a file on the way": "is a file"}[how]  # fmt: skip
    assert re.search(why, err), err
    if how == "file":
        assert (tmp_path / "out").read_text() == "mine"
    if how == "holds files":
        assert [p.name for p in (tmp_path / "out").rglob("*")] == ["decode", "weights.pt"]


def _unwritable(tmp_path: Path) -> Path:
    """A folder this user cannot write: one of mode 0o555, or, for root (whom modes do not stop), sysfs."""
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    folder = Path("/sys")
    try:
        os.rmdir(__import__("tempfile").mkdtemp(dir=folder))
    except OSError:
        return folder
    pytest.skip("no folder here refuses root's writes")


def test_control_a_missing_or_empty_folder_is_taken():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        assert require_repro_dir(Path(tmp) / "new" / "out") == Path(tmp) / "new" / "out"
        assert require_repro_dir(tmp) == Path(tmp) and os.listdir(tmp) == []  # the probe leaves nothing


@pytest.mark.subprocess
@needs_hf
def test_a_full_disk_is_one_line_after_the_report_and_nothing_half_written(tmp_path):
    """Files are limited to 8 KiB (``RLIMIT_FSIZE``: a write past it fails as on a full disk): the report is
    printed, exit 1, then one line saying the reproducer could not be written; no half-written file is left.
    The control is the hanging test's run, where the same reproducer is written."""

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    done = _kvfast(tmp_path, *CHECK, "--scenarios", "decode", "--repro", "out", "--repro-seconds", "1",
                   preexec_fn=small_files)  # fmt: skip
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 1, out + err
    assert "scenario 'decode' (control): bug" in out and not err.strip(), err
    assert "reproducer, decode: no reproducer: [Errno 27] File too large" in out
    assert out.index("per-step table") < out.index("reproducer, decode:")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*"))  # nothing half-written


@pytest.mark.subprocess
def test_a_scan_checks_its_repro_folder_before_any_run(tmp_path):
    """``kvfast scan --repro`` with ``DIR.repro`` a file, or holding an earlier scan's reproducers: one line, exit
    2, and no run stored (``DIR`` not made)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    for how in ("file", "holds files"):
        repro = tmp_path / "scan.repro"
        if how == "file":
            repro.write_text("mine")
        else:
            repro.unlink()
            (repro / "mamba-float32-resume-none").mkdir(parents=True)
        done = _kvfast(tmp_path, "scan", "--families", "llama", "--dtypes", "float32", "--scenarios", "decode",
                       "--seeds", "1", "--prompts", "1", "--steps", "2", "--bugs", "none", "--repro", "--out",
                       str(tmp_path / "scan"), "--jobs", "1", "--quiet")  # fmt: skip
        err = done.stderr.decode()
        assert done.returncode == 2 and err.count("\n") == 1 and f"--repro: '{repro}'" in err, err
        assert not (tmp_path / "scan").exists()
