"""benchmarks/compile_profile.py's ``--same-entries-as``: it reads the entries of a real Numba cache (name and
signature of each cached function) and says "the same set" only when they are.

Each cache is written by a fresh process (Numba reads ``NUMBA_CACHE_DIR`` when it is imported).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared import ROOT

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

SPEC = importlib.util.spec_from_file_location("bench_compile_profile", ROOT / "benchmarks" / "compile_profile.py")
compile_profile = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(compile_profile)

MODULE = """
import numba

@numba.njit(cache=True)
def twice(x):
    return x + x
"""


def _cache(tmp_path: Path, name: str, calls: str) -> str:
    """A Numba cache directory filled by a fresh process that runs ``calls`` on ``twice``."""
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "cached_mod.py").write_text(MODULE)
    cache = tmp_path / name
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(source)}
    subprocess.run([sys.executable, "-c", f"from cached_mod import twice; {calls}"], env=env, check=True)
    return str(cache)


def test_the_same_functions_and_signatures_are_the_same_set(tmp_path, capsys):
    one = _cache(tmp_path, "one", "twice(1.0)")
    other = _cache(tmp_path, "other", "twice(2.0)")
    entries = compile_profile.cache_entries(one)
    assert len(entries) == 1
    (entry,) = entries
    assert entry.startswith("cached_mod.twice-") and "(float64,)" in entry
    assert compile_profile.same_entries(one, other) == 0
    assert "the same set: yes" in capsys.readouterr().out


def test_another_signature_is_named_and_fails(tmp_path, capsys):
    one = _cache(tmp_path, "one", "twice(1.0)")
    more = _cache(tmp_path, "more", "twice(1.0); twice(1)")
    assert compile_profile.same_entries(one, more) == 1
    out = capsys.readouterr().out
    assert "the same set: NO" in out
    assert "only in kvfast reproduce: cached_mod.twice-" in out and "(int64,)" in out


def test_an_empty_cache_is_not_a_match(tmp_path, capsys):
    one = _cache(tmp_path, "one", "twice(1.0)")
    (tmp_path / "empty").mkdir()
    assert compile_profile.same_entries(one, str(tmp_path / "empty")) == 1
    assert "no Numba cache entries" in capsys.readouterr().out
