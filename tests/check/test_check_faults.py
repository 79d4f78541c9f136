"""Fault injection on ``kvfast check``, ``check_cache`` and ``kv_check``: models and factories that exit,
raise, crash or hang, done for real.

The command line runs as a subprocess (``python -m kvfast.cli check``) on models written to a temporary
directory; each case asserts the exit code, the one line on stderr and that no traceback is printed.
Exit codes: 0 pass, 1 divergence, 2 bad input, 3 inconclusive, 4 the model raised or exited, 5 timeout,
70 a bug in kvfast, 130 interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from shared import ROOT, TESTS, environment, kvfast

import kvfast.commands.check as check_command
from kvfast.check import CheckTimeout, ModelUnderTestError, check_cache
from kvfast.cli import main
from kvfast.commands import EXIT_KVFAST_BUG

pytest_plugins = ["pytester"]

TOY = (TESTS / "toymodels.py").read_text()

FAULTS = '''
import os, subprocess, sys, time
from toymodels import Toy

PIDS = os.environ.get("KV_FAULT_PIDS")


def note_pids(extra=()):
    if PIDS:
        with open(PIDS + ".part", "w") as f:
            f.write(" ".join(map(str, (os.getpid(), *extra))))
        os.replace(PIDS + ".part", PIDS)


def sleep_forever():
    while True:
        time.sleep(0.05)


def exit0_factory():
    raise SystemExit(0)


def hang_factory():
    sleep_forever()


def raising_factory(seed=0):
    raise RuntimeError(f"no weights for seed {seed}")


def not_a_model():
    return 42


class Exit0(Toy):
    def decode(self, token):
        sys.exit(0)


class Interrupt(Toy):
    def decode(self, token):
        raise KeyboardInterrupt


class Boom(Toy):
    def prefill(self, tokens):
        raise RuntimeError("boom\\n  on a second line")


class OsExit(Toy):
    def decode(self, token):
        os._exit(0)


class KillSelf(Toy):
    def decode(self, token):
        os.kill(os.getpid(), 9)


class HangDecode(Toy):
    def decode(self, token):
        note_pids()
        sleep_forever()


class HangRecompute(Toy):
    def recompute(self, tokens):
        sleep_forever()


class HangWithChild(Toy):
    """Starts a grandchild process, then hangs where Python can interrupt it."""

    def decode(self, token):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        note_pids([child.pid])
        sleep_forever()


class Stubborn(Toy):
    """Starts a grandchild, then swallows every interruption: only killing its process ends it."""

    def decode(self, token):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        note_pids([child.pid])
        while True:
            try:
                sleep_forever()
            except BaseException:
                pass


def exit0_model():
    return Exit0()


def interrupt_model():
    return Interrupt()


def boom_model():
    return Boom()


def osexit_model():
    return OsExit()


def killself_model():
    return KillSelf()


def hang_decode():
    return HangDecode()


def hang_recompute():
    return HangRecompute()


def hang_with_child():
    return HangWithChild()


def stubborn():
    return Stubborn()
'''


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "toymodels.py").write_text(TOY)
    (tmp_path / "faults.py").write_text(FAULTS)
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(0)\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('bad module')\n")
    (tmp_path / "hangs_on_import.py").write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    return tmp_path


def kvfast_check(workdir: Path, *argv: str, pids: Path | None = None, wait: float = 120):
    """``kvfast check ARGV`` as a subprocess in ``workdir``: ``(returncode, stdout, stderr)``."""
    env = environment(**({} if pids is None else {"KV_FAULT_PIDS": str(pids)}))
    out = kvfast("check", *argv, cwd=workdir, env=env, timeout=wait)
    return out.returncode, out.stdout, out.stderr


def assert_one_line(err: str, needle: str) -> None:
    assert needle in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def read_pids(path: Path, within: float = 60.0) -> list[int]:
    end = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < end, "the model never started"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


# --- the model or its factory raised or exited: exit 4, one line ----------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "factory, needle",
    [
        (
            "faults:exit0_factory",
            "the model under test failed: the factory faults:exit0_factory() raised SystemExit: 0",
        ),
        ("faults:exit0_model", "the model under test failed: model.decode(1) raised SystemExit: 0"),
        ("faults:interrupt_model", "the model under test failed: model.decode(1) raised KeyboardInterrupt"),
        (
            "faults:boom_model",
            "the model under test failed: model.prefill(<3 tokens>) raised RuntimeError: boom on a second line",
        ),
        ("exits_on_import:f", "the model under test failed: importing exits_on_import raised SystemExit: 0"),
        ("raises_on_import:f", "importing raises_on_import raised RuntimeError: bad module"),
        ("faults:osexit_model", "ended the check's process without a report (exit status 0"),
        ("faults:killself_model", "ended the check's process without a report (killed by signal SIGKILL"),
    ],
)
def test_a_model_that_raises_or_exits_is_exit_4_never_a_pass(workdir, factory, needle):
    code, out, err = kvfast_check(workdir, factory, "--prompt", "1,2,3", "--steps", "4")
    assert code == 4
    assert out == ""
    assert_one_line(err, needle)


@pytest.mark.subprocess
def test_a_raising_factory_with_arguments_is_named(workdir):
    code, out, err = kvfast_check(workdir, "faults:raising_factory", "--factory-arg", "seed=3", "--prompt", "1,2")
    assert code == 4
    assert_one_line(err, "the factory faults:raising_factory(seed=3) raised RuntimeError: no weights for seed 3")


# --- timeouts: exit 5, one line, nothing left running ----------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "factory, needle",
    [
        ("hangs_on_import:f", "within 2 s: importing hangs_on_import had not returned"),
        ("faults:hang_factory", "within 2 s: the factory faults:hang_factory() had not returned"),
        ("faults:hang_decode", "within 2 s: model.decode(1) had not returned"),
        ("faults:hang_recompute", "within 2 s: model.recompute(<3 tokens>) had not returned"),
    ],
)
def test_a_hang_ends_at_the_timeout_with_exit_5(workdir, factory, needle):
    """The deadline counts from kvfast's start in the child, not the parent's: on a loaded machine a slow
    start of the interpreter is not the model's time (issue 22), so the hang itself is what it catches."""
    code, out, err = kvfast_check(workdir, factory, "--prompt", "1,2,3", "--steps", "4", "--timeout", "2", wait=120)
    assert code == 5
    assert_one_line(err, "kvfast: error: the check did not finish " + needle)


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "factory, needle",
    [
        ("faults:hang_with_child", "within 2 s: model.decode(1) had not returned"),
        ("faults:stubborn", "within 2 s and could not be interrupted"),
    ],
)
def test_a_timeout_leaves_no_process_behind(workdir, tmp_path, factory, needle):
    """Interruptible or not (the stubborn model swallows every interruption), the check's process and the
    process the model started are gone when ``kvfast check`` returns."""
    pids = tmp_path / "pids"
    code, _, err = kvfast_check(
        workdir, factory, "--prompt", "1,2,3", "--steps", "4", "--timeout", "2", pids=pids, wait=120
    )
    assert code == 5
    assert_one_line(err, needle)
    child, grandchild = read_pids(pids)
    assert gone(child) and gone(grandchild)


@pytest.mark.subprocess
def test_killing_kvfast_check_takes_the_model_along(workdir, tmp_path):
    """kill -9 of ``kvfast check`` (no timeout, a hanging model): its child and the model's own process exit."""
    pids = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(ROOT), KV_FAULT_PIDS=str(pids))
    cmd = [sys.executable, "-m", "kvfast.cli", "check", "faults:hang_with_child", "--prompt", "1,2,3"]
    parent = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        child, grandchild = read_pids(pids)
    finally:
        parent.kill()
        parent.wait()
    assert gone(child) and gone(grandchild)


@pytest.mark.subprocess
def test_ctrl_c_is_exit_130_and_stops_the_model(workdir, tmp_path):
    pids = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(ROOT), KV_FAULT_PIDS=str(pids))
    cmd = [sys.executable, "-m", "kvfast.cli", "check", "faults:hang_decode", "--prompt", "1,2,3"]
    parent = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (child,) = read_pids(pids)
        parent.send_signal(signal.SIGINT)
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert parent.returncode == 130
    assert_one_line(err, "kvfast: interrupted; the check's processes were killed")
    assert gone(child)


# --- bad input: exit 2, one line, before any work ---------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["faults", "--prompt", "1"], "factory: 'faults' is not allowed; allowed: PACKAGE.MODULE:FACTORY"),
        (["no_such_module_kv:f", "--prompt", "1"], "module 'no_such_module_kv' cannot be imported"),
        (["faults:missing", "--prompt", "1"], "'faults' has no attribute 'missing'"),
        (["faults:not_a_model", "--prompt", "1"], "model: int has no method 'recompute'"),
        (["faults:exit0_model", "--prompt", "1", "--factory-arg", "x"], "--factory-arg: 'x' is not allowed"),
        (["faults:exit0_model", "--prompt", "1", "--factory-arg", "x=1"], "--factory-arg: {'x': 1} is not allowed"),
        (["faults:exit0_model", "--prompt", "1", "--continuation", "4,a"], "--continuation: 'a' is not an integer"),
        (["faults:exit0_model", "--prompt", "1", "--timeout", "0"], "--timeout: 0.0 is not allowed"),
        (["faults:exit0_model", "--prompt", "1", "--timeout", "nan"], "--timeout: nan is not allowed"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(workdir, argv, needle):
    code, out, err = kvfast_check(workdir, *argv)
    assert code == 2
    assert out == ""
    assert_one_line(err, needle)


# --- a bug in kvfast: a traceback, the version, a line saying so, exit 70 ----------------------------


@pytest.mark.subprocess
def test_an_unexpected_error_in_the_check_is_a_traceback_and_exit_70(workdir, monkeypatch, capsys):
    """A real failure inside the check's child process (its ``run_check`` replaced by one that fails)."""
    monkeypatch.chdir(workdir)
    inject = (
        "import kvfast.commands.check as c\n"
        "def broken(args, started=None):\n"
        "    raise RuntimeError('injected failure')\n"
        "c.run_check = broken\n"
    )
    monkeypatch.setattr(check_command, "BOOT", check_command.BOOT.replace("from kvfast", inject + "from kvfast", 1))
    assert main(["check", "faults:exit0_model", "--prompt", "1,2,3"]) == EXIT_KVFAST_BUG
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "RuntimeError: injected failure" in lines
    assert lines[-1].startswith("kvfast ") and "this is a bug in kvfast" in lines[-1]


@pytest.mark.subprocess
def test_an_unexpected_error_in_any_command_is_a_traceback_and_exit_70(monkeypatch, capsys):
    def broken(args):
        raise KeyError("injected")

    monkeypatch.setattr(check_command, "check_args", broken)
    assert main(["check", "faults:exit0_model", "--prompt", "1"]) == EXIT_KVFAST_BUG
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "KeyError: 'injected'" in err
    assert err.splitlines()[-1].endswith("please report it with the traceback above")


@pytest.mark.subprocess
def test_only_a_passing_report_is_exit_0(workdir):
    code, out, err = kvfast_check(workdir, "toymodels:clean", "--prompt", "1,2,3", "--steps", "4", "--timeout", "60")
    assert (code, err) == (0, "")
    assert out.startswith("kvfast check: PASS: EXACT\n")
    code, out, _ = kvfast_check(workdir, "toymodels:posfrozen", "--prompt", "1,2,3", "--steps", "4")
    assert code == 1 and out.startswith("kvfast check: FAIL: BUG in scenario 'resume' at step 0 (the resumed chunk")


# --- the Python API: ModelUnderTestError and CheckTimeout, handlers restored ------------------------


class ToyBase:
    vocab_size = 3

    def recompute(self, tokens):
        return np.tile(np.arange(3.0), (len(tokens), 1))

    def prefill(self, tokens):
        return self.recompute(tokens)

    def decode(self, token):
        return np.arange(3.0)


class ExitsInDecode(ToyBase):
    def decode(self, token):
        raise SystemExit(0)


class InterruptsInDecode(ToyBase):
    def decode(self, token):
        raise KeyboardInterrupt


class SwallowsExceptions(ToyBase):
    def decode(self, token):
        while True:
            try:
                time.sleep(0.05)
            except Exception:  # noqa: BLE001 - the point: a model that swallows ordinary exceptions
                pass


class PromoteRaises(ToyBase):
    def promote(self, dtype):
        raise OSError(f"cannot cast to {dtype}")


@pytest.mark.parametrize(
    "model, error, message",
    [
        (ExitsInDecode(), SystemExit, "model.decode(2) raised SystemExit: 0"),
        (InterruptsInDecode(), KeyboardInterrupt, "model.decode(2) raised KeyboardInterrupt"),
        (PromoteRaises(), OSError, "model.promote('float64') raised OSError: cannot cast to float64"),
    ],
)
def test_check_cache_raises_model_under_test_error_chained(model, error, message):
    kwargs = {"mode": "control", "promote": "float64"} if isinstance(model, PromoteRaises) else {}
    with pytest.raises(ModelUnderTestError) as info:
        check_cache(model, [0, 1], 3, **kwargs)
    assert str(info.value) == message
    assert type(info.value.__cause__) is error and info.value.error is info.value.__cause__


def test_check_cache_timeout_restores_handlers_and_leaves_no_thread():
    before = (signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGINT), threading.active_count())
    with pytest.raises(CheckTimeout, match=r"within 0.5 s: model.decode\(2\) had not returned"):
        check_cache(SwallowsExceptions(), [0, 1], 3, timeout=0.5)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert (signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGINT), threading.active_count()) == before


def test_check_cache_timeout_gives_back_a_pending_timer():
    """Someone else's SIGALRM timer (pytest-timeout's, say) keeps running with its own handler."""
    fired = []
    old = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        check_cache(ToyBase(), [0, 1], 3, timeout=5)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 30.0
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        while not fired:
            time.sleep(0.01)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_users_ctrl_c_stays_a_keyboard_interrupt():
    class CtrlC(ToyBase):
        def decode(self, token):
            os.kill(os.getpid(), signal.SIGINT)  # as the terminal does
            time.sleep(5)

    with pytest.raises(KeyboardInterrupt):
        check_cache(CtrlC(), [0, 1], 3, timeout=30)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e10, "1", True])
def test_check_cache_rejects_a_bad_timeout(timeout):
    allowed = r"allowed: None or a number of seconds > 0 and <= 1e\+09$"  # 1e10: more than the interval timer takes
    with pytest.raises(ValueError, match=rf"^timeout: .* is not allowed; {allowed}"):
        check_cache(ToyBase(), [0, 1], 3, timeout=timeout)


def test_check_cache_timeout_needs_the_main_thread():
    errors = []

    def work():
        try:
            check_cache(ToyBase(), [0, 1], 3, timeout=1)
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors == [
        "timeout: 1.0 is not allowed; allowed: None outside the main thread (the deadline is a SIGALRM timer)"
    ]
    assert check_cache(ToyBase(), [0, 1], 3).verdict == "exact"  # without a timeout any thread is fine


# --- the kv_check fixture: one line, no traceback ----------------------------------------------------


def test_kv_check_fails_one_line_when_the_model_exits_raises_or_hangs(pytester):
    pytester.makepyfile(toymodels=TOY)
    pytester.makepyfile(
        test_faults="""
        import sys, time
        from toymodels import Toy

        class Exit0(Toy):
            def decode(self, token):
                sys.exit(0)

        class Boom(Toy):
            def recompute(self, tokens):
                raise ZeroDivisionError("weights of zero norm")

        class Hang(Toy):
            def decode(self, token):
                while True:
                    time.sleep(0.05)

        def test_exit0(kv_check):
            kv_check(Exit0(), prompt=[1, 2, 3], steps=4)

        def test_boom(kv_check):
            kv_check(Boom(), prompt=[1, 2, 3], steps=4)

        def test_hang(kv_check):
            kv_check(Hang(), prompt=[1, 2, 3], steps=4, timeout=1)

        def test_clean(kv_check):
            assert kv_check(Toy(), prompt=[1, 2, 3], steps=4, timeout=30).verdict == "exact"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    out = result.stdout.str()
    assert "kv_check: the model under test failed: model.decode(1) raised SystemExit: 0" in out
    assert "kv_check: the model under test failed: model.recompute(<3 tokens>) raised ZeroDivisionError: weights" in out
    assert "kv_check: the check did not finish within 1 s: model.decode(1) had not returned" in out
    assert "Traceback" not in out and "sys.exit(0)" not in out and "raise ZeroDivisionError" not in out


@pytest.mark.subprocess
def test_a_factory_that_rejects_its_arguments_is_bad_input(workdir):
    """By convention a ``ValueError`` from the factory is its verdict on the arguments: exit 2, not 4."""
    (workdir / "picky.py").write_text(
        "def make(size=1):\n"
        "    if size > 2:\n"
        "        raise ValueError(f'size: {size} is not allowed; allowed: 1 or 2')\n"
    )
    code, out, err = kvfast_check(workdir, "picky:make", "--factory-arg", "size=3", "--prompt", "1")
    assert code == 2
    assert_one_line(err, "size: 3 is not allowed; allowed: 1 or 2 (raised by the factory picky:make(size=3))")


def test_the_exit_code_tables_are_complete():
    """Every code ``kvfast check`` uses; docs/check.md's copy of the table is tests/docs/test_doc_tables.py's."""
    assert sorted(check_command.EXIT_CODES) == [0, 1, 2, 3, 4, 5, 6, 7, EXIT_KVFAST_BUG, 130]
