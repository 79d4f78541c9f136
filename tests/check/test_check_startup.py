"""``kvfast check``'s start-up (issue 30): the parent imports neither Numba nor pandas, the child neither the
studies nor pandas. How long it takes is ``benchmarks/compile_profile.py --warm-check``'s (never a timed test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from shared import ROOT

import kvfast.commands.check as check_command

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
    out = _python(RUN_CHECK, PYTHONPROFILEIMPORTTIME="1")
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "numba" in imported and "kvfast.check.checker" in imported
    assert not {m for m in imported if m == "pandas" or m.startswith(("kvfast.studies", "kvfast.sweep"))}
