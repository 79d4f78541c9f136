"""``kvfast serve``: a check whose child the server forks reads exactly as one with a fresh child (report, stderr,
exit code), for kvfast's model clean and with a catalogue bug, bad input, a parse error, a model that ends its
process or hangs past ``--timeout``; a check whose key differs is not served (and reads the same); the server's
bad flags, idle exit, stale socket and death during a check. Real processes throughout (``python -m kvfast.cli``
in a temporary directory, as a user runs them); which child ran is read from the ``KVFAST_TIMELINE`` marks.
How fast it is: ``benchmarks/compile_profile.py --warm-check --serve`` (never a timed test)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_check_faults import FAULTS, TOY, gone, read_pids

ROOT = Path(__file__).resolve().parents[1]
SERVED = "parent: child forked by kvfast serve"
MODEL = [
    "kvfast.studies.check:kvfast_model", "--prompt", "1,2,3,4", "--steps", "3",
    *[f"--factory-arg={kv}" for kv in ("seed=0", "n_layer=1", "n_head=2", "d_model=16", "d_ff=32", "vocab=32",
                                        "preset=f64", "order=sequential", "attention=standard")],
]  # fmt: skip


def start_server(workdir: Path, env: dict, *flags: str) -> tuple[subprocess.Popen, Path]:
    """``kvfast serve FLAGS`` in ``workdir``, once it listens: the process and its socket's path."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfast.cli", "serve", *flags],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith("kvfast serve: listening on "), (line, proc.stderr.read() if proc.poll() else "")
    return proc, Path(line.split("listening on ", 1)[1].split(" (pid ", 1)[0])


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        proc.stdout.close()
        proc.stderr.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve")
    (path / "toymodels.py").write_text(TOY)
    (path / "faults.py").write_text(FAULTS)
    (path / "run").mkdir(mode=0o700)
    return path


@pytest.fixture(scope="module")
def env(workdir) -> dict:
    """The environment of the server and of its checks: the socket's directory under ``workdir``."""
    return dict(
        os.environ, PYTHONPATH=str(ROOT), XDG_RUNTIME_DIR=str(workdir / "run"), KV_FAULT_PIDS=str(workdir / "pids")
    )


@pytest.fixture(scope="module")
def server(workdir, env):
    """A ``kvfast serve`` for the module's checks (as a user's pytest session would start one)."""
    proc, path = start_server(workdir, env, "--idle", "300")
    yield path
    assert stop(proc) == 0
    assert not path.exists()


def kvfast_check(workdir: Path, env: dict, *argv: str, timeout: float = 120) -> tuple[int, str, str, list[str]]:
    """``kvfast check ARGV`` in ``workdir``: exit code, stdout, stderr and the parent's timeline marks."""
    marks = workdir / f"marks-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "kvfast.cli", "check", *argv]
    out = subprocess.run(
        cmd, cwd=workdir, env={**env, "KVFAST_TIMELINE": str(marks)}, capture_output=True, text=True, timeout=timeout
    )
    lines = marks.read_text().splitlines() if marks.exists() else []
    marks.unlink(missing_ok=True)
    return out.returncode, out.stdout, out.stderr, [line.split(" ", 2)[2] for line in lines]


def served_and_fresh(workdir: Path, env: dict, *argv: str) -> tuple[int, str, str]:
    """The check served, then with a fresh child (``KVFAST_SERVE=0``): the same code, stdout and stderr."""
    code, out, err, marks = kvfast_check(workdir, env, *argv)
    assert SERVED in marks, marks
    fresh = kvfast_check(workdir, {**env, "KVFAST_SERVE": "0"}, *argv)
    assert "parent: child spawned" in fresh[3] and SERVED not in fresh[3]
    assert (code, out, err) == fresh[:3]
    return code, out, err


@pytest.mark.parametrize("bug, code", [("none", 0), ("stale", 1)])
def test_a_served_check_of_kvfasts_model_reads_as_a_fresh_one(server, workdir, env, bug, code):
    (
        got,
        out,
        err,
    ) = served_and_fresh(workdir, env, *MODEL, f"--factory-arg=bug={bug}")
    assert got == code and err == ""
    assert out.startswith("kvfast check (exact mode") and ("EXACT" in out) == (bug == "none")


def test_the_served_child_is_the_servers_and_runs_once(server, workdir, env):
    """The timeline: the served child's marks, from a process that is neither the parent nor a fresh child."""
    code, _, _, marks = kvfast_check(workdir, env, *MODEL, "--factory-arg=bug=none", "--scenarios", "decode")
    assert code == 0
    assert marks[:2] == ["parent: kvfast check started", SERVED]
    assert "parent: child spawned" not in marks and "parent: arguments sent" in marks
    assert [m for m in marks if m.startswith("child: ")] == [
        "child: kvfast imported", "child: request read", "child: model built", "child: first model call (recompute)",
        "child: first model call returned", "child: verdict", "child: result written",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["faults:osexit_model", "--prompt", "1,2,3", "--steps", "4"],  # os._exit(0): no report
        ["faults:killself_model", "--prompt", "1,2,3", "--steps", "4"],  # SIGKILL
        ["faults:boom_model", "--prompt", "1,2,3", "--steps", "4"],  # raises
        ["faults:hang_decode", "--prompt", "1,2,3", "--timeout", "1"],  # the child's own timer: exit 5
        ["faults:osexit_model", "--prompt", "1,x"],  # bad input: before any of the user's code
        ["nomodule_kv:f", "--prompt", "1,2"],  # a module that cannot be imported
        ["faults:osexit_model", "--steps", "3"],  # a parse error (--prompt missing): usage and one line
        ["faults:osexit_model", "--prompt", "1,2", "--steps", "zero"],
    ],
)
def test_a_model_that_ends_its_process_and_bad_input_read_as_without_the_server(server, workdir, env, argv):
    code, out, err = served_and_fresh(workdir, env, *argv)
    assert code in (2, 4, 5) and out == "" and "Traceback" not in err


def test_the_served_parent_imports_neither_numpy_nor_the_checker(server, workdir, env):
    """``python -c`` in the server's directory has its ``sys.path`` (``''`` is the working directory)."""
    code = (
        "import sys; from kvfast.cli import main\n"
        f"code = main({['check', *MODEL, '--factory-arg=bug=none']!r})\n"
        "print(code, *(m in sys.modules for m in ('numpy', 'numba', 'kvfast.check', 'kvfast.validation')))"
    )
    marks = workdir / "marks-imports"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, env={**env, "KVFAST_TIMELINE": str(marks)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.splitlines()[-1].split() == ["0", "False", "False", "False", "False"], out.stderr
    assert SERVED in marks.read_text()


def start_hanging_check(workdir, env):
    """``kvfast check`` of a model whose decode hangs, started; ``(the command's process, its child's pid)``
    once the child runs the model."""
    pids = workdir / "pids"
    pids.unlink(missing_ok=True)
    check = subprocess.Popen(
        [sys.executable, "-m", "kvfast.cli", "check", "faults:hang_decode", "--prompt", "1,2,3"],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    (child,) = read_pids(pids)
    return check, child


def test_ctrl_c_kills_the_served_child_exit_130(server, workdir, env):
    check, child = start_hanging_check(workdir, env)
    check.send_signal(signal.SIGINT)
    out, err = check.communicate(timeout=60)
    assert check.returncode == 130 and out == ""
    assert err == "kvfast: interrupted; the check's processes were killed\n"
    assert gone(child)


def test_a_timeout_kill_reads_as_without_the_server_and_leaves_nothing_running(server, workdir, env):
    """The stubborn model swallows every interruption and starts a grandchild: killed with its group."""
    pids = workdir / "pids"
    pids.unlink(missing_ok=True)
    argv = ["faults:stubborn", "--prompt", "1,2,3", "--timeout", "1"]
    code, out, err, marks = kvfast_check(workdir, env, *argv)
    assert SERVED in marks and code == 5 and "within 1 s and could not be interrupted" in err
    assert all(gone(pid) for pid in read_pids(pids))
    pids.unlink()
    fresh = kvfast_check(workdir, {**env, "KVFAST_SERVE": "0"}, *argv)
    assert (code, out, err) == fresh[:3]
    assert all(gone(pid) for pid in read_pids(pids))


def test_a_check_whose_environment_differs_is_not_served(server, workdir, env):
    """An extra variable: another key, so another socket name (not found); or, at the server's own socket
    (``KVFAST_SERVE_SOCKET``), refused. Either way a fresh child, and the same report."""
    served = kvfast_check(workdir, env, *MODEL, "--factory-arg=bug=none")
    other = kvfast_check(workdir, {**env, "KV_EXTRA": "1"}, *MODEL, "--factory-arg=bug=none")
    assert served[0] == 0 and SERVED in served[3]
    assert other[:3] == served[:3]
    assert other[3][1].startswith("parent: no kvfast serve (FileNotFoundError") and "parent: child spawned" in other[3]
    refused = kvfast_check(
        workdir, {**env, "KV_EXTRA": "1", "KVFAST_SERVE_SOCKET": str(server)}, *MODEL, "--factory-arg=bug=none"
    )
    assert refused[:3] == served[:3]
    assert refused[3][1] == "parent: kvfast serve not used (refused: another key: the environment (KV_EXTRA))"


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--idle", "0"], "argument --idle: '0' is not allowed; allowed: a number of seconds > 0"),
        (["--idle", "soon"], "argument --idle: 'soon' is not allowed"),
        (["--idle=nan"], "argument --idle: 'nan' is not allowed"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(workdir, env, flags, needle):
    out = subprocess.run(
        [sys.executable, "-m", "kvfast.cli", "serve", *flags], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == ""
    assert needle in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_a_live_server_on_the_path_is_exit_2(server, workdir, env):
    out = subprocess.run(
        [sys.executable, "-m", "kvfast.cli", "serve", "--socket", str(server)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "a path no kvfast serve listens on" in out.stderr, out.stderr
    assert server.exists()


def test_the_kvfast_script_is_served_from_any_directory(workdir, env, tmp_path):
    """The ``kvfast`` script puts its own directory on ``sys.path``, not the working directory: a server started
    anywhere serves its checks in any directory (the model found in the check's own directory)."""
    script = Path(sys.executable).with_name("kvfast")
    if not script.exists():
        pytest.skip("no kvfast script next to this interpreter")
    path = tmp_path / "kv.sock"
    env = {**env, "KVFAST_SERVE_SOCKET": str(path)}
    proc = subprocess.Popen(
        [str(script), "serve", "--idle", "60", "--socket", str(path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().startswith("kvfast serve: listening on ")
        marks = tmp_path / "marks"
        argv = ["check", "faults:boom_model", "--prompt", "1,2,3"]
        out = subprocess.run(
            [str(script), *argv], cwd=workdir, env={**env, "KVFAST_TIMELINE": str(marks)}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert SERVED in marks.read_text()
        assert out.returncode == 4 and "model.prefill(<3 tokens>) raised RuntimeError: boom" in out.stderr
    finally:
        stop(proc)


def test_a_server_killed_mid_check_never_reads_as_success_and_its_stale_socket_is_replaced(workdir, env, tmp_path):
    """SIGKILL to the server while its child hangs: the check's process is killed, exit 4, one line; the socket
    file it left costs a check nothing (a fresh child) and a new server replaces it, then exits when idle,
    removing it."""
    path = tmp_path / "kv.sock"
    env = {**env, "KVFAST_SERVE_SOCKET": str(path)}
    proc, listening = start_server(workdir, env, "--idle", "60", "--socket", str(path))
    assert listening == path
    check, child = start_hanging_check(workdir, env)
    proc.kill()
    out, err = check.communicate(timeout=60)
    stop(proc)
    assert check.returncode == 4 and out == ""
    assert err == (
        "kvfast: error: the check's process was killed: the kvfast serve process that forked it ended during the "
        "check; nothing was checked to the end\n"
    )
    assert gone(child)
    assert path.exists()  # stale: nobody listens
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        probe.connect(str(path))
    probe.close()
    code, out, _, marks = kvfast_check(workdir, env, *MODEL, "--factory-arg=bug=none")
    assert code == 0 and marks[1].startswith("parent: no kvfast serve (ConnectionRefusedError")
    proc, _ = start_server(workdir, env, "--idle", "3", "--socket", str(path))
    code, again, _, marks = kvfast_check(workdir, env, *MODEL, "--factory-arg=bug=none")
    assert code == 0 and SERVED in marks and again == out
    assert proc.wait(timeout=60) == 0  # idle
    assert proc.stdout.read() == f"kvfast serve: stopped (idle for 3 s); {path} removed\n"
    stop(proc)
    assert not path.exists()
