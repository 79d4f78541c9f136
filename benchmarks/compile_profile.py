"""Where a cold start's compile time goes: CPU seconds per compiled kernel specialisation.

    PYTHONPATH=$PWD python benchmarks/compile_profile.py [--preset f64] [--all] [--fresh N]
        [--reproduce [--repeats N] [--baseline DIR]] [--warm-check [--repeats N] [--baseline DIR]]

Points Numba's cache at an empty temporary directory, then imports kvfast and runs the same
``generate`` as the cold start of ``kvfast bench kernels`` in this process, recording every
compilation with Numba's event API (``numba:compile``). Prints the total CPU time, then one line per
kernel called from Python (its time includes the kernels it compiles on the way), and with
``--all`` every nested compilation too, deepest indented; a kernel listed twice with different
argument types (e.g. ``Literal[int](0)`` against ``int64``) was compiled twice.

``--reproduce``: what ``kvfast reproduce``'s grids run, instead of one preset: ``generate`` (a
prefill and decode steps) in every storage/accumulator pair of the precision grid (the other grids'
pairs are among them; order and attention kernel are run-time arguments, so one of each), ``generate`` on
the precision grid's wide model in the f64 and f32 accumulators (its f64 products are of the large size class:
the unrolled product bodies, :func:`kvfast.kernels.matmul.size_class`; its f32 ones are not), the forward
with a tape and its gradients (``loss_and_grads``: training, gradcheck) and the forward's trace;
and ``generate`` with a real kernel's attention order (the precision grid's flash-attention kinds: their row
kernel is compiled on first use); prints the CPU seconds of each step and the total, the figure of the "at
most 20 s" target. CPU time
(``time.process_time``), not wall: the machine may be shared.

``--reproduce --repeats N``: the same in ``N`` fresh processes (each with its own empty Numba cache), the median;
with ``--baseline DIR`` also on another kvfast source tree (a ``git archive`` of an earlier commit, run with
``PYTHONPATH=DIR``), the two interleaved, and the ratio of the medians: the machine's speed drifts through the day
(the same tree's cold start moved by 1.4x between hours on the development VM), so a figure is worth quoting only
beside a baseline measured in the same minutes.

``--reproduce --same-entries-as DIR``: after the profile, compare the Numba cache entries it wrote (each cached
function's name and signature, from Numba's index files) with those in ``DIR``, the ``NUMBA_CACHE_DIR`` of a real
``kvfast reproduce`` started with an empty one: the same set means the profile compiles what ``kvfast reproduce``
compiles, no more, no less (exit 1 if not, with the difference).

``--fresh N``: after the profile, each kvfast kernel compiled again ``N`` times, for every signature the run
compiled, in fresh copies (a new dispatcher of the same function; no cache): the least CPU seconds of each, its
own compile alone (what it calls is compiled already), largest first, and their sum; a figure of one kernel
steadier than the profile's nested times on a shared machine (the least of ``N``, interleaved with nothing).

``--warm-check``: a warm start instead (kvfast's own Numba cache, filled by a first run): the whole
command ``kvfast check kvfast.studies.check:kvfast_model ...`` (a 1-layer model, a 4-token prompt, 8
decode steps, the decode scenario) in a fresh process, ``--repeats`` times: its time to the report's first
line (wall, from just before this script starts its process), then CPU (user + system, the process and its
children) and wall of the whole command, medians over the repeats, and, for scale, fresh processes that only
start Python, import NumPy, import Numba, import ``kvfast.cli``, or import the child's modules
(``kvfast.check.checker``), interleaved with the command's rounds, and the child's work step by step in one
fresh process (Python's start, NumPy, Numba, the rest of the checker's imports, Numba's CPU target set up,
the model built, its first call): the floor of the first run, which no arrangement of the command's two
processes goes below.
``--baseline DIR``: the same command on another kvfast source tree (a
``git archive`` of an earlier commit; ``PYTHONPATH=DIR``), interleaved, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECK = [
    "-m", "kvfast.cli", "check", "kvfast.studies.check:kvfast_model", "--prompt", "1,2,3,4", "--steps", "8",
    "--scenarios", "decode",
    *[f"--factory-arg={kv}" for kv in ("seed=0", "n_layer=1", "n_head=2", "d_model=16", "d_ff=32", "vocab=32",
                                        "preset=f64", "order=sequential", "attention=standard", "bug=none")],
]  # fmt: skip


def _env(pythonpath: str | None = None) -> dict:
    here = os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": pythonpath or here}
    env.pop("NUMBA_CACHE_DIR", None)  # kvfast's own cache directory
    return env


def _timed(args: list[str], pythonpath: str | None = None) -> tuple[float, float, float]:
    """CPU seconds (user + system of the child and its children), wall seconds of ``python ARGS`` and wall
    seconds to its first line of output; ``pythonpath``: another kvfast source tree (``--baseline``)."""
    env = _env(pythonpath)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    # from the tree's root: ``python -m`` puts the working directory first on sys.path
    with subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=env["PYTHONPATH"]
    ) as proc:
        proc.stdout.readline()
        first = time.perf_counter() - w0
        proc.stdout.read()
    wall = time.perf_counter() - w0
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, first


SCALE = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import numpy'": ["-c", "import numpy"],
    "python -c 'import numba'": ["-c", "import numba"],
    "python -c 'import kvfast.cli'": ["-c", "import kvfast.cli"],
    "python -c 'import kvfast.check.checker' (the child's imports)": ["-c", "import kvfast.check.checker"],
}
#: the child's work in one fresh process, step by step: where its time to the first run goes
STEPS = r"""
import json, sys, time
marks = [("Python started (its site)", time.time() - float(sys.argv[1]))]
t = time.perf_counter()
def step(label):
    global t
    marks.append((label, time.perf_counter() - t))
    t = time.perf_counter()
import numpy
step("import numpy")
import numba
step("import numba")
import kvfast.check.checker
step("import kvfast.check.checker (the rest of the child's imports)")
from numba.core.registry import cpu_target
cpu_target.target_context.refresh()
step("Numba's CPU target set up (its first dispatch does it)")
from kvfast.bugs.kvfast_model import kvfast_model
model = kvfast_model(0, 1, 2, 16, 32, 32, "f64", "sequential", "standard", "none")
step("kvfast_model(...): its module, parameters, weights (kernels loaded)")
model.recompute([1, 2, 3, 4])
step("first recompute (the forward's cached kernels loaded)")
print(json.dumps(marks))
"""


def _steps() -> list[tuple[str, float]]:
    """:data:`STEPS` in a fresh process: ``(step, seconds)``."""
    env = _env()
    out = subprocess.run(
        [sys.executable, "-c", STEPS, repr(time.time())], env=env, check=True, capture_output=True, text=True
    )
    return [tuple(m) for m in json.loads(out.stdout.splitlines()[-1])]


def warm_check(repeats: int, baseline: str | None = None) -> None:
    """Print the warm ``kvfast check`` figures (see the module doc)."""
    _timed(CHECK)  # fills the cache if it is cold
    base: list[tuple[float, float, float]] = []
    if baseline:
        _timed(CHECK, pythonpath=baseline)
    rounds: list[tuple[float, float, float]] = []
    scale: dict[str, list[float]] = {name: [] for name in SCALE}
    loads = []
    steps: list[list[tuple[str, float]]] = []
    for _ in range(repeats):  # interleaved: the command, then each process for scale
        rounds.append(_timed(CHECK))
        steps.append(_steps())
        if baseline:
            base.append(_timed(CHECK, pythonpath=baseline))
        for name, args in SCALE.items():
            scale[name].append(_timed(args)[1])
        loads.append(os.getloadavg()[0])
    cpu, wall, first = (statistics.median(r[i] for r in rounds) for i in range(3))
    print(f"kvfast check of kvfast's model (whole command): {cpu:.3f} s CPU, {wall:.3f} s wall, {first:.3f} s to "
          f"the report's first line (median of {repeats}, warm Numba cache)")  # fmt: skip
    if baseline:
        b_cpu, b_wall, b_first = (statistics.median(r[i] for r in base) for i in range(3))
        print(f"the same command on the baseline tree {baseline}: {b_cpu:.3f} s CPU, {b_wall:.3f} s wall, "
              f"{b_first:.3f} s to the first line")  # fmt: skip
        print(f"baseline / this tree: {b_cpu / cpu:.2f}x CPU, {b_wall / wall:.2f}x wall (medians, interleaved)")
    print("the child's work in one fresh process, step by step (s, median):")
    for i, (label, _) in enumerate(steps[0]):
        print(f"  {label:<70} {statistics.median(r[i][1] for r in steps):.3f}")
    print(f"  {'sum':<70} {statistics.median(sum(v for _, v in r) for r in steps):.3f}")
    print("for scale, fresh processes (wall s, median):")
    for name, walls in scale.items():
        print(f"  {name:<62} {statistics.median(walls):.3f}")
    print(f"load average (1 min) over the rounds: {min(loads):.2f}-{max(loads):.2f}")


TOTAL = "cold start (import kvfast, every format kvfast reproduce runs): "


def _reproduce_cold(tree: str | None) -> float:
    """This script's ``--reproduce`` in a fresh process on kvfast source tree ``tree`` (None: this one): its total."""
    env = _env(tree)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--reproduce"],
        env=env, check=True, capture_output=True, text=True, cwd=env["PYTHONPATH"],
    )  # fmt: skip
    line = next(line for line in out.stdout.splitlines() if line.startswith(TOTAL))
    return float(line.removeprefix(TOTAL).split()[0])


def reproduce_repeated(repeats: int, baseline: str | None) -> None:
    """``--reproduce`` ``repeats`` times in fresh processes, interleaved with ``baseline``'s if given: each run's
    total, the medians and (with a baseline) their ratio."""
    here = str(Path(__file__).resolve().parents[1])
    trees = [("this tree", here)] + ([(f"baseline {baseline}", baseline)] if baseline else [])
    runs: dict[str, list[float]] = {name: [] for name, _ in trees}
    loads = []
    for _ in range(repeats):
        for name, tree in trees:
            runs[name].append(_reproduce_cold(tree))
            loads.append(os.getloadavg()[0])
    print(f"cold start of everything kvfast reproduce runs, CPU s, {repeats} fresh processes each (empty Numba "
          f"caches{', interleaved' if baseline else ''}):")  # fmt: skip
    print("| tree | runs | median |")
    print("|---|---|---|")
    for name, values in runs.items():
        print(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")
    med = statistics.median(runs["this tree"])
    if baseline:
        ratio = med / statistics.median(runs[trees[1][0]])
        print(f"this tree / baseline: {ratio:.2f} (medians)")
    print(f"this tree: {med:.2f} s CPU (target 20 s: {'met' if med <= 20 else 'NOT met'})")
    print(f"load average (1 min) over the runs: {min(loads):.2f}-{max(loads):.2f}")


def cache_entries(cache_dir: str) -> set[str]:
    """Every entry of a Numba cache directory: ``"INDEX-FILE SIGNATURE TARGET"``, from Numba's index files (a
    pickled format version, then the pickled ``(stamp, overloads)``, keyed by signature and target first)."""
    entries = set()
    for index in Path(cache_dir).rglob("*.nbi"):
        with open(index, "rb") as f:
            pickle.load(f)  # Numba's version
            _stamp, overloads = pickle.loads(f.read())
        entries.update(f"{index.name} {key[0]} {key[1]}" for key in overloads)
    return entries


def same_entries(profiled: str, reproduced: str) -> int:
    """Print whether the profile's cache entries (``profiled``) are those of a real ``kvfast reproduce``
    (``reproduced``); 0 if they are, else 1."""
    ours, theirs = cache_entries(profiled), cache_entries(reproduced)
    if not theirs:
        print(f"no Numba cache entries in {reproduced}")
        return 1
    print(f"Numba cache entries: this profile {len(ours)}, kvfast reproduce ({reproduced}) {len(theirs)}, "
          f"the same set: {'yes' if ours == theirs else 'NO'}")  # fmt: skip
    for label, extra in (("only in this profile", ours - theirs), ("only in kvfast reproduce", theirs - ours)):
        for entry in sorted(extra):
            print(f"  {label}: {entry[:200]}")
    return 0 if ours == theirs else 1


def fresh_compiles(repeats: int) -> None:
    """``--fresh``: every kvfast kernel this process compiled, compiled ``repeats`` times more in fresh copies, for
    each of its signatures; print the least CPU seconds of each, largest first, and the sum."""
    import gc
    import types as pytypes

    import numba as nb
    from numba.core.registry import CPUDispatcher

    rows = []
    for kernel in [d for d in gc.get_objects() if isinstance(d, CPUDispatcher)]:
        f = kernel.py_func
        if not f.__module__.startswith("kvfast"):
            continue
        options = {k: v for k, v in kernel.targetoptions.items() if k != "nopython"}
        for signature in list(kernel.overloads):
            seconds = []
            for i in range(repeats):
                copy = pytypes.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
                copy.__qualname__, copy.__module__ = f"{f.__qualname__}_fresh{i}", f.__module__
                c = time.process_time()
                nb.njit(**options, cache=False)(copy).compile(signature)
                seconds.append(time.process_time() - c)
            rows.append((min(seconds), f.__qualname__, str(signature)[:100]))
    print(f"each kernel's own compile, least of {repeats} fresh copies (CPU s):")
    for seconds, name, signature in sorted(rows, reverse=True):
        print(f"{seconds:7.3f}  {name} {signature}")
    print(f"{sum(r[0] for r in rows):7.3f}  sum")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="f64", choices=["f64", "f32", "bf16"])
    parser.add_argument("--all", action="store_true", help="also list nested compilations")
    parser.add_argument("--reproduce", action="store_true", help="every format kvfast reproduce runs, timed by step")
    parser.add_argument("--warm-check", action="store_true", help="a warm kvfast check of kvfast's model, whole")
    parser.add_argument(
        "--fresh", type=int, default=None, metavar="N",
        help="after the profile, each kernel compiled again N times in fresh copies: its own compile, the least",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=None,
        help="--warm-check (default 5), --reproduce (default: one run in this process; 5 with --baseline): fresh "
        "processes timed (median)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", default=None, metavar="DIR",
        help="--warm-check, --reproduce: also time the command on the kvfast source tree DIR (e.g. `git archive` "
        "of main), interleaved",
    )  # fmt: skip
    parser.add_argument(
        "--same-entries-as", default=None, metavar="DIR",
        help="--reproduce: compare the cache entries written with those of a real kvfast reproduce in cache DIR",
    )  # fmt: skip
    args = parser.parse_args()
    if args.same_entries_as is not None and not args.reproduce:
        parser.error("--same-entries-as needs --reproduce")
    if args.same_entries_as is not None and (args.repeats is not None or args.baseline is not None):
        parser.error("--same-entries-as: one profile in this process; not allowed with --repeats or --baseline")
    if (args.repeats is not None or args.baseline is not None) and not (args.reproduce or args.warm_check):
        parser.error("--repeats and --baseline need --reproduce or --warm-check")
    if args.fresh is not None and (args.fresh < 1 or args.warm_check or args.repeats or args.baseline):
        parser.error("--fresh N (N >= 1): one profile in this process; not with --warm-check, --repeats, --baseline")
    if args.same_entries_as is not None and not Path(args.same_entries_as).is_dir():
        parser.error(f"--same-entries-as: {args.same_entries_as} is not a directory")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.baseline is not None and not (Path(args.baseline) / "kvfast" / "__init__.py").is_file():
        parser.error(f"--baseline: {args.baseline} is not a kvfast source tree (no kvfast/__init__.py)")
    if args.warm_check:
        warm_check(args.repeats or 5, args.baseline)
        return 0
    if args.reproduce and (args.repeats is not None or args.baseline is not None):
        reproduce_repeated(args.repeats or 5, args.baseline)
        return 0
    cache_dir = tempfile.mkdtemp(prefix="kvfast-numba-")
    os.environ["NUMBA_CACHE_DIR"] = cache_dir
    c0 = time.process_time()
    from numba.core import event

    records: list[tuple[float, int, str, str]] = []
    started: list[float] = []

    class Listener(event.Listener):
        def on_start(self, ev):
            started.append(time.process_time())

        def on_end(self, ev):
            seconds = time.process_time() - started.pop()
            name = ev.data["dispatcher"].py_func.__name__
            types = str(ev.data["args"]).replace("Array(float64, 2, 'C', False, aligned=True)", "f64[:, :]")
            records.append(
                (seconds, len(started), name, types.replace("Array(float64, 1, 'C', False, aligned=True)", "f64[:]"))
            )

    event.register("numba:compile", Listener())
    import kvfast

    cfg = kvfast.ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=32)
    params = kvfast.init_params(cfg, 0)
    if args.reproduce:
        print(f"import kvfast and start Numba: {time.process_time() - c0:.2f} s CPU")
        formats = ("f64", "f32", "bf16")
        for storage, accum in [(s, a) for s in formats for a in formats]:
            c = time.process_time()
            kvfast.generate(cfg, params, [1, 2, 3], 4, kvfast.Numerics(storage, accum))
            print(f"generate, storage {storage}, accumulator {accum}: {time.process_time() - c:.2f} s CPU")
        # the precision grid's wide models (d_model 64, d_ff 256, a 16-token prompt): their f64 products are of the
        # large size class (kvfast.kernels.matmul.size_class), so kvfast reproduce compiles the unrolled f64 body for
        # them; the f32 products unroll only from 256 x 256, the bf16 ones never (the f32 runs here show it)
        wide = kvfast.ModelConfig(vocab=32, d_model=64, n_head=4, n_layer=2, d_ff=256, max_pos=32)
        wide_params = kvfast.init_params(wide, 0)
        c = time.process_time()
        for storage, accum in [("f64", "f64"), ("f32", "f32"), ("f64", "f32")]:
            kvfast.generate(wide, wide_params, list(range(1, 17)), 4, kvfast.Numerics(storage, accum))
        print(f"generate, wide model (the precision grid's d_model 64), f64 and f32 accumulators: "
              f"{time.process_time() - c:.2f} s CPU")  # fmt: skip
        c = time.process_time()
        kvfast.generate(cfg, params, [1, 2, 3], 4, kvfast.Numerics(attention="online", attn_block=2))
        print(f"generate, f64, online attention (a real kernel's order): {time.process_time() - c:.2f} s CPU")
        c = time.process_time()
        kvfast.loss_and_grads(cfg, params, [1, 2, 3], [2, 3, 4], kvfast.Numerics())
        kvfast.forward_trace(cfg, params, [1, 2, 3], kvfast.Numerics())
        print(f"loss_and_grads and forward_trace (the layer-by-layer forward): {time.process_time() - c:.2f} s CPU")
        total = time.process_time() - c0
        print(f"cold start (import kvfast, every format kvfast reproduce runs): {total:.2f} s CPU")
    else:
        kvfast.generate(cfg, params, [1, 2, 3], 4, kvfast.Numerics.preset(args.preset))
        total = time.process_time() - c0
        print(f"cold start (import kvfast, one generate, preset {args.preset}): {total:.2f} s CPU")
    for seconds, depth, name, types in records:
        if depth == 0 or args.all:
            print(f"{seconds:7.2f}  {'  ' * depth}{name} {types[:150]}")
    if args.fresh:
        fresh_compiles(args.fresh)
    status = 0 if args.same_entries_as is None else same_entries(cache_dir, args.same_entries_as)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
