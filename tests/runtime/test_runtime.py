"""The runtime leaf (:mod:`kvfast.runtime`) and the faults of issue 23 it answers, done for real.

Findings 3, 5, 6 and 7: a factory that returns a class is exit 2 with the README's line; a run that
changes the working directory cannot move ``--out``; a user's study module that exits
(``sys.exit(0)``, ``os._exit(0)``), raises ``KeyboardInterrupt`` or any exception at import, and a
``validate_config`` that raises anything but ``ValueError`` (or exits), are one line and exit 2, with
nothing stored changed; only a real Ctrl-C is 130. The command line runs as a subprocess in a temporary
directory holding the user's modules; each case asserts the exit code, the one line on stderr, that
no traceback is printed, and that nothing stored is lost.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from shared import ROOT, TESTS, environment
from shared import kvfast as run_kvfast

from kvfast.commands.sweep import EXIT_CODES as SWEEP_EXIT_CODES
from kvfast.runtime import (
    INTERRUPTED,
    ProcessEnded,
    UserCodeError,
    call_user,
    load_object,
    probing_imports,
)
from kvfast.sweep import load

# A user's study whose module, validate_config and run misbehave as the environment asks.
STUDY = """
import os, sys, tempfile, time

import pandas as pd
import pyarrow as pa

from kvfast.sweep.study import Study

FAULT = os.environ.get("KV_FAULT", "")
if FAULT == "import-exit0":
    sys.exit(0)
if FAULT == "import-os-exit0":
    os._exit(0)
if FAULT == "import-kbint":
    raise KeyboardInterrupt
if FAULT == "import-raise":
    raise RuntimeError("no weights here\\n  (a second line)")
if FAULT == "import-sleep":
    open(os.environ["KV_MARK"], "w").close()
    time.sleep(60)


def validate_config(config):
    if FAULT == "validate-type":
        raise TypeError("x must be an int, not " + type(config["x"]).__name__)
    if FAULT == "validate-exit0":
        sys.exit(0)
    if FAULT == "validate-kbint":
        raise KeyboardInterrupt


def run(config):
    if FAULT == "run-chdir":
        os.chdir(tempfile.mkdtemp(prefix="kv-chdir-", dir=os.environ["KV_ELSEWHERE"]))
    return {"y": 2 * config["x"]}


STUDY = Study(  # name, version, description, run, config and result columns, validate_config, summarize
    "userfaults", "1", "a user's study that misbehaves on request", run, {"x": pa.int64()}, {"y": pa.int64()},
    validate_config, lambda df: pd.DataFrame({"runs": [len(df)]}),
)
"""

FACTORY = """
from toymodels import Toy


def returns_class():
    return Toy


def returns_none():
    return None
"""


def user_files(tmp_path: Path) -> Path:
    """``tmp_path`` with the user's modules and a grid of 24 runs of ``userfaults``."""
    (tmp_path / "userfaults.py").write_text(STUDY)
    (tmp_path / "userfactory.py").write_text(FACTORY)
    shutil.copy(TESTS / "toymodels.py", tmp_path / "toymodels.py")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "g.toml").write_text(
        'study = "userfaults:STUDY"\n[axes]\nx = [' + ", ".join(map(str, range(24))) + "]\n"
    )
    return tmp_path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A temporary directory with the user's modules and a grid of 24 runs of ``userfaults``."""
    return user_files(tmp_path)


@pytest.fixture(scope="module")
def clean_store(tmp_path_factory) -> Path:
    """The grid's 24 rows stored by a clean ``kvfast run``, once for the module (tests copy it)."""
    home = user_files(tmp_path_factory.mktemp("clean"))
    first = kvfast(home, "run", "g.toml", "--out", "o", "--jobs", "1", "--quiet")
    assert first.returncode == 0, first.stderr
    return home / "o"


def kvfast(workdir: Path, *argv: str, fault: str = "") -> subprocess.CompletedProcess:
    """``python -m kvfast.cli ARGV`` in ``workdir`` (the user's modules found there), ``KV_FAULT=fault``."""
    env = environment(KV_FAULT=fault, KV_ELSEWHERE=str(workdir / "elsewhere"))
    return run_kvfast(*argv, cwd=workdir, env=env)


def one_line(err: str, *needles: str) -> str:
    """``err`` is one line holding every needle, and no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def stored(out: Path) -> pd.DataFrame:
    """The stored rows (every column but the wall-clock time), sorted by run id."""
    df = load(out)[["run_id", "x", "y", "status", "error"]]
    return df.sort_values("run_id").reset_index(drop=True)


# --- finding 6: a study module that exits or raises at import ---------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "fault, needle",
    [
        ("import-exit0", "importing userfaults raised SystemExit: 0"),
        ("import-os-exit0", "importing userfaults ended its process (exit status 0: os._exit"),
        ("import-kbint", "importing userfaults raised KeyboardInterrupt"),
        ("import-raise", "importing userfaults raised RuntimeError: no weights here (a second line)"),
    ],
)
def test_a_study_module_that_exits_or_raises_at_import_is_one_line_and_exit_2(workdir, clean_store, fault, needle):
    shutil.copytree(clean_store, workdir / "o")  # what a clean run stored (one run for the four faults)
    before = stored(workdir / "o")
    proc = kvfast(workdir, "run", "g.toml", "--out", "o", "--jobs", "1", "--quiet", fault=fault)
    assert proc.returncode == 2 and proc.returncode in SWEEP_EXIT_CODES
    assert proc.stdout == ""
    one_line(proc.stderr, "kvfast: error: g: study: 'userfaults:STUDY': ", needle)
    assert len(before) == 24 and stored(workdir / "o").equals(before)  # nothing stored changed
    fresh = kvfast(workdir, "run", "g.toml", "--out", "fresh", "--quiet", fault=fault)
    assert fresh.returncode == 2 and not (workdir / "fresh").exists()  # nothing written before any run


@pytest.mark.subprocess
def test_only_a_real_ctrl_c_at_import_is_exit_130(workdir):
    mark = workdir / "importing"
    env = dict(os.environ, PYTHONPATH=str(ROOT), KV_FAULT="import-sleep", KV_MARK=str(mark))
    argv = [sys.executable, "-m", "kvfast.cli", "run", "g.toml", "--out", "o", "--quiet"]
    with subprocess.Popen(argv, cwd=workdir, env=env, stderr=subprocess.PIPE, text=True) as proc:
        until = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < until:  # kvfast is importing the study (in its probe)
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)  # the user's Ctrl-C, to kvfast's process alone
        try:
            err = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 130
    one_line(err, "kvfast: interrupted")
    assert not (workdir / "o").exists()


# --- finding 7: a validate_config that raises anything but ValueError, or exits ------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "fault, needle",
    [
        ("validate-type", "validate_config raised TypeError: x must be an int, not int"),
        ("validate-exit0", "validate_config raised SystemExit: 0"),
        ("validate-kbint", "validate_config raised KeyboardInterrupt"),
    ],
)
def test_a_validate_config_that_raises_or_exits_is_one_line_and_exit_2(workdir, fault, needle):
    proc = kvfast(workdir, "run", "g.toml", "--out", "o", "--quiet", fault=fault)
    assert proc.returncode == 2
    line = one_line(proc.stderr, "kvfast: error: g: study 'userfaults': ", needle)
    assert "(config {'x': 0})" in line
    assert not (workdir / "o").exists()


# --- finding 5: a run that changes the working directory cannot move --out ----------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_run_that_changes_directory_stores_every_row_under_the_relative_out(workdir, jobs):
    proc = kvfast(workdir, "run", "g.toml", "--out", "o", "--jobs", jobs, "--quiet", fault="run-chdir")
    assert proc.returncode == 0, proc.stderr
    assert "24 runs in the grid, 0 already stored, 24 run now" in proc.stdout
    first = stored(workdir / "o")
    assert len(first) == 24 and (first["status"] == "ok").all() and sorted(first["y"]) == list(range(0, 48, 2))
    assert not list((workdir / "o").glob(".warmup*")) and not list((workdir / "elsewhere").rglob("*.parquet"))
    again = kvfast(workdir, "run", "g.toml", "--out", "o", "--jobs", jobs, "--quiet", fault="run-chdir")
    assert again.returncode == 0 and "24 already stored, 0 run now" in again.stdout
    rerun = kvfast(workdir, "run", "g.toml", "--out", "o", "--jobs", jobs, "--fresh", "--quiet", fault="run-chdir")
    assert rerun.returncode == 0 and stored(workdir / "o").equals(first)  # identical, run again from scratch


def test_run_sweep_resolves_a_relative_out_before_any_run(workdir, monkeypatch):
    from kvfast.sweep import load_grid, run_sweep

    monkeypatch.chdir(workdir)
    monkeypatch.setenv("KV_FAULT", "run-chdir")
    monkeypatch.setenv("KV_ELSEWHERE", str(workdir / "elsewhere"))
    monkeypatch.syspath_prepend(str(workdir))
    sys.modules.pop("userfaults", None)
    try:
        report = run_sweep(load_grid("g.toml"), "o", jobs=1, quiet=True)
    finally:
        sys.modules.pop("userfaults", None)
    assert report.out == workdir / "o" and report.counts["ok"] == 24
    assert len(stored(workdir / "o")) == 24


# --- finding 3: a factory that returns no model under test ------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "factory, needle",
    [
        ("returns_class", "model: the class Toy is not allowed; allowed: an instance of it"),
        ("returns_none", "model: NoneType has no method 'recompute'"),
    ],
)
def test_a_factory_that_returns_a_class_or_none_is_exit_2_returning_no_model(workdir, factory, needle):
    proc = kvfast(workdir, "check", f"userfactory:{factory}", "--prompt", "1,2,3", "--steps", "2")
    assert proc.returncode == 2 and proc.stdout == ""
    one_line(proc.stderr, f"the factory userfactory:{factory}() returns no model under test: ", needle)


def test_check_cache_refuses_a_class_as_bad_input():
    from toymodels import Toy

    from kvfast.check import check_cache

    with pytest.raises(ValueError, match="model: the class Toy is not allowed; allowed: an instance of it"):
        check_cache(Toy, [1, 2, 3], steps=2)


# --- the leaf itself: one set of rules and messages -------------------------------------------------------


def test_load_object_rules_and_messages(workdir, monkeypatch):
    monkeypatch.chdir(workdir)  # the working directory goes on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(workdir))])
    found = load_object("userfactory:returns_class", "factory", accept=callable, allowed="a callable")
    assert found.__name__ == "returns_class" and sys.path[0] == str(workdir)

    def refused(ref, match, **kw):
        with pytest.raises(ValueError, match=match):
            load_object(ref, "factory", accept=callable, allowed="a callable", **kw)

    refused("userfactory", r"^factory: 'userfactory' is not allowed; allowed: package.module:NAME$")
    refused("a:b:c", "is not allowed; allowed: package.module:NAME")
    refused(
        "no_such_mod_kv:f",
        r"^factory: 'no_such_mod_kv:f' cannot be imported: its module 'no_such_mod_kv' cannot be imported "
        r"\(ModuleNotFoundError: No module named 'no_such_mod_kv'\)$",
    )
    refused("userfactory:nope", r"^factory: 'userfactory:nope' cannot be found: 'userfactory' has no attribute 'nope'")
    refused(
        "toymodels:Toy.vocab_size", r"^factory: 'toymodels:Toy.vocab_size' is int, not allowed; allowed: a callable$"
    )
    refused("absent", "is not allowed", entry_points=lambda: {})


def test_call_user_turns_every_exit_into_one_error_but_a_real_ctrl_c():
    def raiser(exc):
        raise exc

    for exc in (SystemExit(0), KeyboardInterrupt(), TypeError("bad"), RecursionError("deep")):
        with pytest.raises(UserCodeError) as info:
            call_user("the call", raiser, exc)
        assert info.value.error is exc and str(info.value).startswith("the call raised ")
    with pytest.raises(ValueError):
        call_user("the call", raiser, ValueError("mine"), passthrough=(ValueError,))
    INTERRUPTED.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            call_user("the call", raiser, KeyboardInterrupt())
    finally:
        INTERRUPTED.clear()


@pytest.mark.subprocess
def test_the_probe_survives_os_exit_at_import(tmp_path, monkeypatch):
    (tmp_path / "exits_at_import_kv.py").write_text("import os\nos._exit(0)\n")
    monkeypatch.chdir(tmp_path)
    with probing_imports(), pytest.raises(UserCodeError) as info:
        load_object("exits_at_import_kv:X", "study", accept=callable, allowed="anything")
    assert isinstance(info.value.error, ProcessEnded)
    assert str(info.value) == (
        "importing exits_at_import_kv ended its process (exit status 0: os._exit, a crash or a signal at import)"
    )
    assert "exits_at_import_kv" not in sys.modules


@pytest.mark.subprocess
def test_the_probe_forks_for_a_user_module_and_never_for_kvfast_own(tmp_path, monkeypatch):
    """kvfast's own modules are not user code: importing them in a probe would only import them twice."""
    import kvfast.runtime.load as load_module

    probed = []
    real = load_module.probe_import
    monkeypatch.setattr(load_module, "probe_import", lambda module: probed.append(module) or real(module))
    (tmp_path / "plain_user_module_kv.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "kvfast.studies.toytask", raising=False)
    with probing_imports():
        assert load_object("plain_user_module_kv:X", "study", accept=lambda x: True, allowed="anything") == 1
        load_object("kvfast.studies.toytask:__name__", "study", accept=lambda x: True, allowed="anything")
    assert probed == ["plain_user_module_kv"]
