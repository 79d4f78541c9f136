"""Where a cold start's compile time goes: CPU seconds per compiled kernel specialisation.

    PYTHONPATH=$PWD python benchmarks/compile_profile.py [--preset f64] [--all] [--reproduce] [--warm-check]

Points Numba's cache at an empty temporary directory, then imports kvfast and runs the same
``generate`` as the cold start of ``kvfast bench kernels`` in this process, recording every
compilation with Numba's event API (``numba:compile``). Prints the total CPU time, then one line per
kernel called from Python (its time includes the kernels it compiles on the way), and with
``--all`` every nested compilation too, deepest indented; a kernel listed twice with different
argument types (e.g. ``Literal[int](0)`` against ``int64``) was compiled twice.

``--reproduce``: what ``kvfast reproduce``'s grids run, instead of one preset: ``generate`` (a
prefill and decode steps) in every storage/accumulator pair of the precision grid (the other grids'
pairs are among them; order and attention kernel are run-time arguments, so one of each), the forward
with a tape and its gradients (``loss_and_grads``: training, gradcheck) and the forward's trace;
and ``generate`` with a real kernel's attention order (the precision grid's flash-attention kinds: their row
kernel is compiled on first use); prints the CPU seconds of each step and the total, the figure of the "at
most 20 s" target. CPU time
(``time.process_time``), not wall: the machine may be shared.

``--warm-check``: a warm start instead (kvfast's own Numba cache, filled by a first run): the whole
command ``kvfast check kvfast.studies.check:kvfast_model ...`` (a 1-layer model, a 4-token prompt, 8
decode steps, the decode scenario) in a fresh process, CPU (user + system, the process and its children)
and wall from start to exit, median of ``--repeats``; and, for scale, a fresh process that only imports
``kvfast.cli``. The figure of the "at most 0.5 s to its first run" target.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def _timed(args: list[str]) -> tuple[float, float]:
    """CPU seconds (user + system of the child and its children) and wall seconds of ``python ARGS``."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1])}
    env.pop("NUMBA_CACHE_DIR", None)  # kvfast's own cache directory
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def warm_check(repeats: int) -> None:
    """Print the warm ``kvfast check`` figures (see the module doc)."""
    _timed(CHECK)  # fills the cache if it is cold
    for name, args in (("kvfast check of kvfast's model (whole command)", CHECK),
                       ("python -c 'import kvfast.cli' (for scale)", ["-c", "import kvfast.cli"])):  # fmt: skip
        samples = [_timed(args) for _ in range(repeats)]
        cpu = statistics.median(s[0] for s in samples)
        wall = statistics.median(s[1] for s in samples)
        print(f"{name}: {cpu:.3f} s CPU, {wall:.3f} s wall (median of {repeats}, warm Numba cache)")
    print(f"load average {os.getloadavg()[0]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="f64", choices=["f64", "f32", "bf16"])
    parser.add_argument("--all", action="store_true", help="also list nested compilations")
    parser.add_argument("--reproduce", action="store_true", help="every format kvfast reproduce runs, timed by step")
    parser.add_argument("--warm-check", action="store_true", help="a warm kvfast check of kvfast's model, whole")
    parser.add_argument("--repeats", type=int, default=5, help="--warm-check: fresh processes timed (median)")
    args = parser.parse_args()
    if args.warm_check:
        warm_check(args.repeats)
        return 0
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvfast-numba-")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
