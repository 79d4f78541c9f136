"""A cold start loads only what it uses: ``import kvfast`` loads no Numba, and importing the model and
the studies compiles no kernel (kernels compile, or load from the cache, on their first call).

Each check runs in a fresh interpreter with an empty ``NUMBA_CACHE_DIR`` and counts Numba's
``numba:compile`` events (a cache hit is one too, so a kernel loaded at import would count). The
control shows the counter sees an eager compile: a module-level ``njit`` with an explicit signature.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shared import ROOT

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

COUNT = r"""
import json, sys
before = "numba" in sys.modules
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
exec(sys.argv[1])
print(json.dumps({"compiled": compiled}))
"""


def _run(args: list[str], cache: Path | None) -> str:
    """stdout of ``python ARGS`` from the repository root, with an empty Numba cache in ``cache`` (or kvfast's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, env=env, cwd=ROOT).stdout


def _compiled_by(statement: str, cache: Path | None) -> list[str]:
    """The functions Numba compiled (or loaded from its cache) while ``statement`` ran."""
    return json.loads(_run(["-c", COUNT, statement], cache).strip().splitlines()[-1])["compiled"]


def test_import_kvfast_loads_no_numba(tmp_path):
    out = _run(["-c", "import sys, kvfast; print('numba' in sys.modules, 'llvmlite' in sys.modules)"], tmp_path)
    assert out.split() == ["False", "False"]


def test_the_numpy_reference_model_loads_no_numba(tmp_path):
    """kvfast.NumpyModel is written apart from kvfast's model: importing it loads none of kvfast's kernels.
    Control: kvfast's own model does."""
    loaded = "import sys, kvfast\nkvfast.{}\nprint('numba' in sys.modules)"
    assert _run(["-c", loaded.format("NumpyModel")], tmp_path).split() == ["False"]
    assert _run(["-c", loaded.format("KvfastModel")], tmp_path).split() == ["True"]


SCIPY_AFTER = "import sys\n{}\nprint('scipy.linalg' in sys.modules)"


@pytest.mark.skipif(importlib.util.find_spec("scipy") is None, reason="scipy is not installed: Numba probes nothing")
def test_numbas_blas_probe_imports_no_scipy_once_kvfast_starts_the_target():
    """kvfast.model.compiled answers Numba's BLAS probe without importing scipy.linalg (about 0.3 s of a warm
    start); that patch of Numba's ``numba.np.linalg.ensure_blas`` steps aside silently where Numba moves it, and
    this test is what then fails. Control: Numba's own start of its target imports scipy.linalg."""
    generate = (
        "import kvfast\ncfg = kvfast.ModelConfig(vocab=8, d_model=8, n_head=2, n_layer=1, d_ff=8, max_pos=8)\n"
        "kvfast.generate(cfg, kvfast.init_params(cfg, 0), [1], 2, kvfast.Numerics.preset('f64'))"
    )
    assert _run(["-c", SCIPY_AFTER.format(generate)], None).split() == ["False"]
    assert _run(["-c", SCIPY_AFTER.format("import numba.np.arraymath")], None).split() == ["True"]


def test_importing_the_model_and_the_studies_compiles_no_kernel(tmp_path):
    statement = (
        "import kvfast.model.transformer, kvfast.model.generation, kvfast.model.layers, kvfast.numerics\n"
        "import kvfast.studies.exactness, kvfast.studies.precision, kvfast.studies.training\n"
        "import kvfast.kernels.matmul, kvfast.kernels.attention, kvfast.kernels.rowops"
    )
    assert _compiled_by(statement, tmp_path) == []


def test_the_compile_counter_sees_an_eager_compile(tmp_path):
    """Control: a kernel compiled at import (an explicit signature) is counted."""
    statement = "import numba\n@numba.njit('float64(float64)')\ndef twice(x):\n    return 2.0 * x"
    assert _compiled_by(statement, tmp_path) == ["twice"]


LOADED = r"""
import json, sys
import numba
exec(sys.argv[1])
loaded = sorted(
    f"{mod.__name__}.{name}" for mod in list(sys.modules.values()) if (mod.__name__ or "").startswith("kvfast")
    for name, obj in vars(mod).items() if isinstance(obj, numba.core.dispatcher.Dispatcher) and obj.signatures
)
print(json.dumps(loaded))
"""


def test_the_first_call_compiles_or_loads_only_what_it_uses():
    """Laziness, with kvfast's own cache (a cache load is counted too: a dispatcher with a signature):
    after importing nothing is loaded; one f64 forward loads its entry, not the decode's."""
    imports = (
        "import kvfast.model.config as c, kvfast.model.transformer as t, kvfast.model.generation, kvfast.numerics as n"
    )
    assert json.loads(_run(["-c", LOADED, imports], None).strip().splitlines()[-1]) == []
    call = (
        "\ncfg = c.ModelConfig(vocab=8, d_model=4, n_head=1, n_layer=1, d_ff=4, max_pos=4)\n"
        "t.forward(cfg, c.init_params(cfg, 0), [1, 2], n.Numerics())\n"
        "from kvfast.model.compiled import forward_kernel\n"
        "assert forward_kernel.signatures"
    )
    loaded = json.loads(_run(["-c", LOADED, imports + call], None).strip().splitlines()[-1])
    # by the kernel's name: the block's functions, compiled for the forward, are names in kvfast.model.generation too
    assert not any(name.rsplit(".", 1)[1].startswith("decode") for name in loaded), loaded


TWO_AT_ONCE = r"""
import json, sys, time
from kvfast.kernels import indirect, matmul
signature = matmul.BODY
while time.time() < float(sys.argv[2]):  # both processes start compiling at the same moment
    time.sleep(0.005)
if sys.argv[1] == "address":
    indirect.address(matmul.PRODUCT_KERNELS[0], signature)
    stats = indirect.by_address(matmul.PRODUCT_KERNELS[0]).stats  # what address() compiles: the twin
else:  # control: Numba's own compile, no lock
    matmul.PRODUCT_KERNELS[0].compile(signature)
    stats = matmul.PRODUCT_KERNELS[0].stats
print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


def _compiled_and_loaded(how: str, cache: Path) -> list[list[int]]:
    """Two processes that need the same product body at the same moment, sharing an empty cache: each one's
    [cache hits, cache misses] of ``_product_f64`` (a miss is a compile)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(cache)}
    start = f"{__import__('time').time() + 3.0}"  # after both have imported kvfast and numba
    procs = [
        subprocess.Popen([sys.executable, "-c", TWO_AT_ONCE, how, start], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    return sorted(json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs)


def test_two_processes_needing_one_kernel_compile_it_once(tmp_path):
    """Sweep workers forked after a warm-up in another format need the same kernels at once: the first
    compiles, the second waits for it and loads the kernel from the cache (``kvfast.kernels.indirect``)."""
    assert _compiled_and_loaded("address", tmp_path / "locked") == [[0, 1], [1, 0]]


def test_the_two_process_control_sees_two_compiles(tmp_path):
    """Control: without the lock both processes compile the kernel (two misses), so the check above can fail."""
    assert _compiled_and_loaded("compile", tmp_path / "unlocked") == [[0, 1], [0, 1]]


TWIN_THEN_PYTHON = r"""
import sys
import numpy as np
from numba import types
from kvfast.kernels import indirect, reduce
if sys.argv[1] == "control":  # a twin under the kernel's own name: its cache entry is the kernel's
    indirect.BY_ADDRESS_SUFFIX = ""
signature = (types.Array(types.float64, 1, "C"), types.int64, types.int64, types.int64, types.int64,
             types.Array(types.float64, 1, "C"))
if sys.argv[2] == "address":
    assert indirect.address(reduce.ordered_sum, signature)
else:  # a later process calls the kernel itself from Python, with the same cache
    print(reduce.ordered_sum(np.arange(4.0), 0, 4, 0, 0, np.empty(reduce.STACK_DEPTH)))
"""


def _twin_then_python(how: str, cache: Path) -> subprocess.CompletedProcess:
    """A process compiles ``ordered_sum``'s twin for calls by address (into an empty cache), then another calls
    ``ordered_sum`` from Python with the same cache; the second's result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(cache)}
    for step in ("address", "python"):
        run = subprocess.run(
            [sys.executable, "-c", TWIN_THEN_PYTHON, how, step], env=env, capture_output=True, text=True
        )
    return run


def test_a_twin_for_calls_by_address_keeps_its_own_cache_entry(tmp_path):
    """``indirect.address`` compiles a kernel's twin without the CPython wrapper (``by_address``); the twin is
    cached under its own name, so a later process that calls the kernel from Python never loads the twin's entry
    (which has no CPython entry point) but compiles or loads the kernel's own."""
    run = _twin_then_python("twin", tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "6.0"
    from kvfast.kernels import indirect, reduce

    twin = indirect.by_address(reduce.ordered_sum)
    assert twin.py_func.__qualname__ == "ordered_sum" + indirect.BY_ADDRESS_SUFFIX
    assert twin.targetoptions["no_cpython_wrapper"] and twin.targetoptions["no_cfunc_wrapper"]
    same = {k: v for k, v in twin.targetoptions.items() if k not in ("no_cpython_wrapper", "no_cfunc_wrapper")}
    assert same == reduce.ordered_sum.targetoptions


def test_the_twin_cache_control_fails_under_the_kernels_own_name(tmp_path):
    """Control: a twin cached under the kernel's own name is loaded by the kernel's Python call, which then
    fails (no CPython entry point), so the check above can fail."""
    run = _twin_then_python("control", tmp_path / "cache")
    assert run.returncode != 0 and run.stdout.strip() != "6.0"


HITS = r"""
import numpy as np
from kvfast.kernels import reduce
total = reduce.ordered_sum(np.arange(4.0), 0, 4, 0, 0, np.empty(reduce.STACK_DEPTH))
print(total, sum(reduce.ordered_sum.stats.cache_hits.values()))
"""


def _hits_after_an_edit(tmp_path: Path, edited: str, **extra: str) -> tuple[list[str], list[str]]:
    """A copy of kvfast with a user-chosen ``NUMBA_CACHE_DIR`` (and the environment variables ``extra``):
    ``ordered_sum`` (kvfast/kernels/reduce.py) called in one process, the file ``edited`` (not reduce.py) changed by
    a comment, then called in another; each process's result and its cache hits, and the two processes' stderr
    lines."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "kvfast", tree / "kvfast", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tree), "NUMBA_CACHE_DIR": str(tmp_path / "cache"), **extra}
    outs, err = [], []
    for step in range(2):
        if step == 1:
            with open(tree / "kvfast" / edited, "a") as f:
                f.write("\n# edited\n")
        run = subprocess.run([sys.executable, "-c", HITS], env=env, capture_output=True, text=True, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        outs.append(run.stdout.strip())
        err += run.stderr.splitlines()
    return outs, err


def test_a_kernel_is_compiled_again_after_another_kvfast_numba_source_changes(tmp_path):
    """In a cache directory the user chose, a kvfast kernel's entry is stamped with the hash of every kvfast Numba
    source (``cache_guard.key_entries``): a changed constant in kvfast/model/bugs.py (read by kernels in other
    files) makes an unchanged file's kernel a cache miss, never stale machine code."""
    assert _hits_after_an_edit(tmp_path, "model/bugs.py") == (["6.0 0", "6.0 0"], [])


def test_the_keyed_cache_control_hits_after_an_edit_outside_the_key(tmp_path):
    """Control: an edit to a file outside the key (kvfast/validation.py uses no Numba) leaves the entry fresh: the
    second process loads it (one hit), so the check above can fail."""
    assert _hits_after_an_edit(tmp_path, "validation.py") == (["6.0 0", "6.0 1"], [])


def test_with_numba_cache_locator_classes_set_kvfast_caches_no_kernel_and_says_so(tmp_path):
    """Issue 42: with ``NUMBA_CACHE_LOCATOR_CLASSES`` set Numba uses the locators it names, never kvfast's keyed
    one, so an edit of kvfast/model/bugs.py left reduce.py's entry fresh (a hit: stale machine code). kvfast then
    caches none of its kernels and says why in one line per process. Control: without the variable, the test
    above, where the same harness hits after an edit outside the key."""
    from numba.core import config

    if not hasattr(config, "CACHE_LOCATOR_CLASSES"):
        pytest.skip("this Numba reads no NUMBA_CACHE_LOCATOR_CLASSES (0.60: the option came in 0.61)")
    outs, err = _hits_after_an_edit(tmp_path, "model/bugs.py", NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator")
    assert outs == ["6.0 0", "6.0 0"]
    assert len(err) == 2, err
    assert all(
        line.startswith("kvfast: NUMBA_CACHE_LOCATOR_CLASSES is set (UserProvidedCacheLocator): ") for line in err
    )
    assert "compiled afresh in every process, not cached" in err[0]
    assert not list((tmp_path / "cache").rglob("*.nbi"))  # nothing written where that locator would have cached
