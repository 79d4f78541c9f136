"""Issue 46: progress counts the whole grid (runs stored before count as done); where no bar can be drawn (stderr
a pipe, a terminal of zero width) a plain line every few seconds; ``--quiet``: none. Real ``kvfast run``
processes, four at once (their runs sleep), each long enough for a line to be due, two workers each (``--jobs 1``
writes rows 64 runs at a time)."""

from __future__ import annotations

import fcntl
import math
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import joblib
import pytest
from shared import ROOT, TESTS, environment

from kvfast.sweep.progress import EVERY

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

ENV = environment(TESTS)
LINE = re.compile(r"kvfast: ([\d,]+) of ([\d,]+) runs \(([\d,]+) stored before\), [\d.,]+ runs/s, about \S+ \S+ left")
SLOW = math.ceil(2 * 1.6 * EVERY / 0.3)  # faultstudy's `slow` runs sleep 0.3 s: 1.6 intervals of them on 2 workers


OK = 'study = "faultstudy:STUDY"\n[[union]]\n[union.axes]\nx = {range = [0, 4]}\nmode = ["ok"]\n'


def kvfast_run(toml: Path, out: Path, *flags: str, stderr) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvfast.cli", "run", str(toml), "--out", str(out), "--jobs", "2", *flags]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr)


def on_terminal(toml: Path, out: Path, columns: int) -> tuple[subprocess.Popen, threading.Thread, list[bytes]]:
    """``kvfast run`` with stderr a terminal of ``columns`` columns; ``(process, reader, what it read)``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = kvfast_run(toml, out, stderr=slave)
    os.close(slave)
    got: list[bytes] = []

    def drain() -> None:  # read as it comes: a full terminal buffer would block the sweep's writes
        try:
            while chunk := os.read(master, 4096):
                got.append(chunk)
        except OSError:  # the process closed the terminal's last writer
            pass
        os.close(master)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return proc, reader, got


@pytest.mark.skipif(joblib.cpu_count() < 2, reason="two workers (--jobs is capped to the cores)")
def test_progress_counts_the_whole_grid_as_lines_where_no_bar_can_be_drawn(tmp_path):
    (tmp_path / "ok.toml").write_text(OK)
    before = tmp_path / "before"
    stored = kvfast_run(tmp_path / "ok.toml", before, "--quiet", stderr=subprocess.PIPE).communicate(timeout=120)
    assert b"4 run now" in stored[0], stored
    toml = tmp_path / "g.toml"
    toml.write_text(OK + f'[[union]]\n[union.axes]\nx = {{range = [10, {10 + SLOW}]}}\nmode = ["slow"]\n')
    total = 4 + SLOW
    for name in ("pipe", "quiet", "zero-width", "terminal"):
        shutil.copytree(before, tmp_path / name)
    pipe = kvfast_run(toml, tmp_path / "pipe", stderr=subprocess.PIPE)
    quiet = kvfast_run(toml, tmp_path / "quiet", "--quiet", stderr=subprocess.PIPE)
    terminals = {name: on_terminal(toml, tmp_path / name, columns) for name, columns in (("zero-width", 0),
                                                                                        ("terminal", 100))}  # fmt: skip
    results = {"pipe": pipe.communicate(timeout=120), "quiet": quiet.communicate(timeout=120)}
    codes = {"pipe": pipe.returncode, "quiet": quiet.returncode}
    for name, (proc, reader, got) in terminals.items():
        out, _ = proc.communicate(timeout=120)
        reader.join(timeout=10)
        results[name], codes[name] = (out, b"".join(got)), proc.returncode
    for name, (out, err) in results.items():
        out, err = out.decode(), err.decode()
        assert codes[name] == 0, (name, out, err)
        assert f"{total:,} runs in the grid, 4 already stored, {SLOW} run now" in out, (name, out)  # the closing line
        lines = LINE.findall(err)
        if name in ("pipe", "zero-width"):
            assert lines, (name, err)
            assert all(t == f"{total:,}" and b == "4" and 4 < int(n) < total for n, t, b in lines), (name, lines)
            assert "\r" not in err.replace("\r\n", "\n") and "%|" not in err, (name, err)  # lines, no bar
        else:  # controls: no line with --quiet (nothing at all) or on a terminal (a bar, which counts the grid)
            assert not lines, (name, err)
    assert results["quiet"][1] == b""
    assert f"| 4/{total} [" in results["terminal"][1].decode(), results["terminal"][1]
