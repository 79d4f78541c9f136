"""What many test modules share: the repository's paths and ``kvfast`` run as a fresh process.

The test folders hold no ``__init__.py``; pytest puts ``tests/`` (conftest.py's folder) on ``sys.path``, so
``from shared import ROOT, kvfast`` works from any of them, as ``import toymodels`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
TESTS = ROOT / "tests"  # the helper modules (toymodels, ropedecoder, faultstudy, kvref, ...) are importable from here


def kvfast(*argv: object, cwd: Path = ROOT, env: dict | None = None, timeout: float = 300, text: bool = True,
           **extra_env: str) -> subprocess.CompletedProcess:  # fmt: skip
    """``python -m kvfast.cli ARGV`` in a fresh process from ``cwd``, its output captured: ``env`` as given, else
    this process's environment with this repository's kvfast first on ``PYTHONPATH`` and ``extra_env`` added."""
    if env is None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **extra_env}
    command = [sys.executable, "-m", "kvfast.cli", *map(str, argv)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=text, timeout=timeout)
