"""What test modules in several folders share: the repository's paths, ``kvfast`` run as a fresh process, and
the reduced grids of the Hugging Face studies.

The test folders hold no ``__init__.py``; pytest puts ``tests/`` (conftest.py's folder) on ``sys.path``, so
``from shared import ROOT, kvfast`` works from any of them, as ``import toymodels`` does.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
TESTS = ROOT / "tests"  # the helper modules: toymodels, ropedecoder, faultstudy, kvref, doctables, ...
#: the installed console script (what a user types), beside ``python -m kvfast.cli``
KVFAST_SCRIPT = str(Path(sys.executable).with_name("kvfast"))
# CI (.ci/run, KVFAST_REQUIRE_HF=1) runs the Hugging Face tests, never skips them
HF = os.environ.get("KVFAST_REQUIRE_HF") == "1" or all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def environment(*paths: Path, **extra: str) -> dict[str, str]:
    """This process's environment with this repository (then ``paths``) first on ``PYTHONPATH`` and ``extra``
    set; without ``PYTHONFAULTHANDLER`` (a fault handler's dump is not the one line a failure prints)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, *paths))), **extra}
    env.pop("PYTHONFAULTHANDLER", None)
    return env


def kvfast(*argv: object, cwd: Path = ROOT, env: dict | None = None, timeout: float = 300, text: bool = True,
           script: bool = False, shell_prefix: str = "", **popen: object) -> subprocess.CompletedProcess:  # fmt: skip
    """``python -m kvfast.cli ARGV`` (``script``: the console script) in a fresh process from ``cwd``, its output
    captured; ``env`` defaults to :func:`environment`. ``shell_prefix``: run through ``sh`` after that shell
    command (which may, say, leave the shell in a deleted directory); ``popen``: more of ``subprocess.run``'s
    arguments."""
    command = [KVFAST_SCRIPT] if script else [sys.executable, "-m", "kvfast.cli"]
    command += (a if isinstance(a, bytes) else str(a) for a in argv)  # bytes: a path that is not UTF-8
    if shell_prefix:
        command = ["sh", "-c", f'{shell_prefix} && exec "$0" "$@"', *command]
    env = environment() if env is None else env
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=text, timeout=timeout, **popen)


#: a reduced grid of each Hugging Face study (tests/studies/test_studies_hf.py runs them, tests/report/ draws them)
HF_SMALL_GRIDS = {
    "hf_matrix": """
[fixed]
family = "llama"
dtype = "float32"
attention = "sdpa"
seed = 0
prompt = 0
steps = 6
mode = "control"
scenarios = "both"
variants = "builtin"
[[union]]
[union.fixed]
bug = "none"
feed = "given"
promote = "none"
[[union]]
[union.fixed]
feed = "given"
promote = "float64"
[union.axes]
bug = ["posoff", "replay"]
""",
    "hf_score": """
[fixed]
family = "gpt2"
dtype = "float32"
attention = "sdpa"
seed = 0
prompt = 0
steps = 6
[axes]
bug = ["none", "posoff", "freeze"]
""",
}


#: the check options under which a model's shortcut hook (decode_greedy, recompute_prefixes) must report what one
#: call per step or recompute reports (tests/check/test_check_decode_greedy.py, test_check_recompute_prefixes.py)
SHORTCUT_CHECKS = [
    {"scenarios": "decode", "follow": "cache"},
    {"scenarios": ("decode", "resume"), "follow": "cache"},
    {"scenarios": ("decode", "resume", "rollback", "fork")},
    {"scenarios": ("decode", "resume", "rollback", "fork"), "mode": "control"},
    {"scenarios": "decode", "fast": False},
]


def same_report(a, b) -> bool:
    """Whether two check reports say the same, bit for bit: the same text, and per scenario the same deviations,
    tokens, logits kept, bounds and step verdicts."""
    import numpy as np

    if a.format() != b.format() or a.scenarios.keys() != b.scenarios.keys():
        return False
    for name, s in a.scenarios.items():
        t = b.scenarios[name]
        if (s.bounds is None) != (t.bounds is None):
            return False
        pairs = [(getattr(s, f), getattr(t, f)) for f in ("deviation", "tokens", "cache_logits", "reference")]
        if s.bounds is not None:
            pairs += [(s.bounds.ratio, t.bounds.ratio), (s.bounds.bound, t.bounds.bound)]
        for x, y in pairs:
            if (x is None) != (y is None) or (x is not None and np.asarray(x).tobytes() != np.asarray(y).tobytes()):
                return False
        if s.step_verdicts != t.step_verdicts:
            return False
    return True
