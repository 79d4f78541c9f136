"""The pytest plugin (``kv_check`` fixture, pytest11 entry point) in pytester sessions, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import numpy  # noqa: F401 - loaded before pytester's in-process runs, which drop modules first loaded inside them
import pytest
from shared import TESTS

from kvfast.cli import main

pytest_plugins = ["pytester"]

TOY = (TESTS / "toymodels.py").read_text()


def test_kv_check_passes_a_correct_model_and_fails_a_bugged_one(pytester):
    """The fixture comes from the pytest11 entry point (nothing in the session registers it)."""
    pytester.makepyfile(toymodels=TOY)
    pytester.makepyfile(
        test_cache="""
        from toymodels import Toy

        def test_clean(kv_check):
            report = kv_check(Toy(), prompt=[1, 2, 3], steps=16)
            assert report.verdict == "exact"

        def test_posfrozen(kv_check):
            kv_check(Toy("posfrozen"), prompt=[1, 2, 3], steps=16)

        def test_bad_input(kv_check):
            kv_check(Toy(), prompt=[], steps=16)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "first bug step 2 (position 4)" in out
    assert "per-step table" in out and "<- first" in out
    assert "kv_check: bad input: prompt: shape (0,) is not allowed" in out
    # without the entry point's plugin (named "kvfast") the fixture does not exist
    without = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:kvfast")
    without.assert_outcomes(errors=3)
    assert "fixture 'kv_check' not found" in without.stdout.str()


@pytest.mark.subprocess
def test_plugin_module_imports_nothing_heavy():
    """Loading the plugin does not load kvfast's checker (it is imported when the fixture is first used)."""
    code = "import sys, kvfast.pytest_plugin as p; print('kvfast.check.checker' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the command line ---------------------------------------------------------------------------


@pytest.fixture
def toymodule(tmp_path, monkeypatch):
    (tmp_path / "toymodels_cli.py").write_text(TOY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "toymodels_cli"
    sys.modules.pop("toymodels_cli", None)


@pytest.mark.subprocess
def test_cli_exit_codes(toymodule, capsys):
    assert main(["check", f"{toymodule}:clean", "--prompt", "1,2,3", "--steps", "8"]) == 0
    assert "EXACT" in capsys.readouterr().out
    assert main(["check", f"{toymodule}:posfrozen", "--prompt", "1,2,3", "--steps", "8"]) == 1
    assert "first bug step 2" in capsys.readouterr().out
    assert main(["check", f"{toymodule}:clean", "--prompt", "1,2,3", "--steps", "8", "--mode", "control"]) == 0
    assert main(["check", f"{toymodule}:posfrozen", "--prompt", "1,2,3", "--steps", "4", "--per-step"]) == 1


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["{m}:clean", "--prompt", "1,x"], "--prompt: 'x' is not an integer"),
        (["{m}:clean", "--prompt", ""], "--prompt: '' is not allowed"),
        (["{m}:clean", "--prompt", "1,99"], "prompt: token 99 is out of range"),
        (["{m}:missing", "--prompt", "1"], "has no attribute 'missing'"),
        (["{m}", "--prompt", "1"], "is not allowed; allowed: PACKAGE.MODULE:FACTORY"),
        (["no_such_module_kv:f", "--prompt", "1"], "module 'no_such_module_kv' cannot be imported"),
        (["{m}:not_a_model", "--prompt", "1"], "has no method 'recompute'"),
        (["{m}:wrong_shape", "--prompt", "1,2"], "logits of shape (3,) are not allowed"),
        (["{m}:clean", "--prompt", "1", "--steps", "0"], "steps: 0 is not allowed"),
        (["{m}:clean", "--prompt", "1", "--scenarios", "decode,warp"], "scenarios: 'warp' is not allowed"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(toymodule, capsys, argv, needle):
    assert main(["check", *[a.replace("{m}", toymodule) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.subprocess
def test_cli_rejects_a_bad_mode_with_exit_2(toymodule):
    with pytest.raises(SystemExit) as exc:
        main(["check", f"{toymodule}:clean", "--prompt", "1", "--mode", "loose"])
    assert exc.value.code == 2
