"""``kvfast check``'s start-up (issue 30): the child starts before the arguments are parsed, the parent
imports neither Numba nor pandas, the child neither the studies nor pandas, and ``KVFAST_TIMELINE`` marks
the timeline ``benchmarks/compile_profile.py --warm-check`` prints. How long it takes is the benchmark's
(never a timed test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from shared import ROOT

import kvfast.commands.check as check_command
from kvfast.cli import main
from kvfast.runtime import child as child_runtime

KVFAST_MODEL = [
    "check", "kvfast.studies.check:kvfast_model", "--prompt", "1,2,3,4", "--steps", "3", "--scenarios", "decode",
    *[f"--factory-arg={kv}" for kv in ("seed=0", "n_layer=1", "n_head=2", "d_model=16", "d_ff=32", "vocab=32",
                                        "preset=f64", "order=sequential", "attention=standard", "bug=none")],
]  # fmt: skip


RUN_CHECK = f"import sys; from kvfast.cli import main; sys.exit(main({KVFAST_MODEL!r}))"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=ROOT)


def test_the_studies_factory_is_loaded_from_its_home():
    """``OWN_FACTORIES``: the child loads kvfast's own factory from the module that defines it, the very object
    the studies' module names."""
    from kvfast.runtime import load_object

    for spec, home in check_command.OWN_FACTORIES.items():
        named = load_object(spec, "factory", accept=callable, allowed="a callable")
        assert load_object(home, "factory", accept=callable, allowed="a callable") is named


@pytest.mark.subprocess
def test_the_parent_imports_neither_numba_nor_pandas_nor_the_studies():
    code = (
        "import sys; from kvfast.cli import main\n"
        f"code = main({KVFAST_MODEL!r})\n"
        "print(code, *(m in sys.modules for m in ('numba', 'pandas', 'kvfast.studies', 'kvfast.check.checker')))"
    )
    out = _python(code)
    assert out.stdout.splitlines()[-1].split() == ["0", "False", "False", "False", "False"], out.stderr


@pytest.mark.subprocess
def test_the_child_imports_neither_the_studies_nor_pandas():
    """``-X importtime`` of both processes (``PYTHONPROFILEIMPORTTIME``): Numba (the child's), no pandas, no study."""
    out = _python(
        f"import sys; from kvfast.cli import main; sys.exit(main({KVFAST_MODEL!r}))", PYTHONPROFILEIMPORTTIME="1"
    )
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "numba" in imported and "kvfast.check.checker" in imported
    assert not {m for m in imported if m == "pandas" or m.startswith(("kvfast.studies", "kvfast.sweep"))}


@pytest.mark.subprocess
def test_the_timeline_marks_each_step_in_order(tmp_path):
    marks = tmp_path / "marks"
    out = _python(
        f"import sys; from kvfast.cli import main; sys.exit(main({KVFAST_MODEL!r}))", KVFAST_TIMELINE=str(marks)
    )
    assert out.returncode == 0, out.stderr
    lines = [line.split(" ", 2) for line in marks.read_text().splitlines()]
    labels = [label for _, _, label in lines]
    assert labels[:2] == ["parent: kvfast check started", "parent: child spawned"]
    child = [label for _, _, label in lines if label.startswith("child: ")]
    assert child == [
        "child: kvfast imported", "child: request read", "child: model built", "child: first model call (recompute)",
        "child: first model call returned", "child: verdict", "child: result written",
    ]  # fmt: skip
    assert labels[-1] == "parent: report printed" and "parent: arguments checked" in labels
    assert len({pid for _, pid, label in lines if label.startswith("child: ")}) == 1
    assert len({pid for _, pid, _ in lines}) == 2
    stamps = {label: float(t) for t, _, label in lines}
    order = ["parent: kvfast check started", "parent: child spawned", *child, "parent: report printed"]
    assert [stamps[k] for k in order] == sorted(stamps[k] for k in order)


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(child_runtime.TIMELINE, raising=False)
    monkeypatch.chdir(tmp_path)
    child_runtime.mark("nothing")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def started(monkeypatch):
    """The children ``start_early`` starts, recorded."""
    children = []

    def start(boot):
        children.append(child_runtime.Child(boot))
        return children[-1]

    monkeypatch.setattr(child_runtime, "start_child", start)
    return children


@pytest.mark.subprocess
def test_bad_input_ends_the_early_child_before_any_work(started, capsys):
    assert main(["check", "no_module_kv:f", "--prompt", "1,x"]) == 2
    assert "--prompt" in capsys.readouterr().err
    (child,) = started
    assert child.proc.poll() is not None and check_command._EARLY == []
    assert not os.path.exists(child.result_path)


@pytest.mark.subprocess
def test_a_parse_error_ends_the_early_child(started, capsys):
    with pytest.raises(SystemExit):
        main(["check", "m:f"])  # --prompt missing
    (child,) = started
    assert child.proc.poll() is not None and check_command._EARLY == []


def test_help_starts_no_child(started, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--help"])
    assert exc.value.code == 0 and started == []


@pytest.mark.subprocess
def test_a_child_never_sent_a_request_exits_by_itself():
    """Its request pipe closed without a request (the parent gone or done with it): exit 0, no result."""
    child = child_runtime.start_child(check_command.BOOT)
    try:
        os.close(child._request_write)
        child._sent = True  # (closed)
        assert child.proc.wait(timeout=120) == 0
        assert not os.path.exists(child.result_path)
    finally:
        child.discard()


@pytest.mark.subprocess
def test_a_failed_early_start_falls_back_to_the_usual_start(monkeypatch, capsys):
    """The early start is only a head start: if it fails, the command starts its child when it runs."""
    calls = []

    def start(boot):
        calls.append(boot)
        if len(calls) == 1:
            raise OSError("no early start")
        return child_runtime.Child(boot)

    monkeypatch.setattr(child_runtime, "start_child", start)
    assert main(KVFAST_MODEL) == 0
    assert len(calls) == 2 and "EXACT" in capsys.readouterr().out
