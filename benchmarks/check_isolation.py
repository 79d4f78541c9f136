"""Benchmark: what ``kvfast check``'s child process costs, against the same check in one process.

    .venv/bin/python benchmarks/check_isolation.py [--repeats 15] [--steps 4]

Both sides are fresh processes started the same way, alternated, on ``tests/toymodels.py:clean``
(a 3-token prompt, ``--steps`` decode steps), so the difference is the isolation alone:

- in process: ``python -c`` that parses the same arguments with kvfast's parser and calls
  :func:`kvfast.commands.check.run_check` (what the child runs) in its own process;
- isolated: ``python -m kvfast.cli check ...`` (the command: the check in a child process).

Prints the median wall time of each, their ratio and their difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IN_PROCESS = (
    "import sys\n"
    "from kvfast.cli import build_parser\n"
    "from kvfast.commands.check import run_check\n"
    "result = run_check(build_parser().parse_args(sys.argv[1:]))\n"
    "print(result['text'])\n"
    "sys.exit(result['code'])\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    opts = parser.parse_args()
    argv = ["check", "toymodels:clean", "--prompt", "1,2,3", "--steps", str(opts.steps)]
    sides = {
        "in process": [sys.executable, "-c", IN_PROCESS, *argv],
        "isolated (kvfast check)": [sys.executable, "-m", "kvfast.cli", *argv],
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    times: dict[str, list[float]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / "tests" / "toymodels.py", tmp)
        for _ in range(opts.repeats):
            for name, cmd in sides.items():
                start = time.perf_counter()
                subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["in process"])
    print("| side | median wall time (s) | ratio | difference (s) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / base:.2f}x | {median - base:+.3f} |")
    print(f"\n{opts.repeats} runs each, alternated; {opts.steps} decode steps")


if __name__ == "__main__":
    main()
