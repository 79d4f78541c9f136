"""Sweep-engine scale benchmark: planning, per-worker throughput, resume and load, fresh-process speedup.

    .venv/bin/python benchmarks/scale.py [--sizes 10000,100000,1000000] [--big] [--repeats 3]

Prints Markdown tables of:

- planning time and peak memory against grid size (an exactness grid whose seed axis grows): the
  grid validated and counted (``load_grid``: what a sweep into an empty directory does before its
  first run), and every run id computed (the pass a resumed sweep makes), each in a fresh process;
  peak memory is the process's peak RSS and its growth over the same process after imports; with
  the fitted growth exponent (least squares of log time on log size);
- ``--big``: a 10^7-run grid of tiny runs swept for about 20 s: seconds from the process start to the
  first finished run, and resident memory sampled while it sweeps (bounded by the chunk size);
- runs per second per worker (``--jobs 1``, in-process) on the built-in 1,296-run exactness grid and
  on 20,000 tiny runs, with the engine overhead ``1 - sum of run times / wall``;
- resume and load against stored rows: a results directory of N ``ok`` rows (synthetic results on
  the exactness schema) is written, then timed: finding the pending runs of its grid (reading the
  stored ids and looking every grid id up), ``kvfast.load`` and ``kvfast show``;
- a 10^5-run grid of tiny runs on a Dask LocalCluster of 2 workers against loky and fork (2 workers):
  throughput and whether the stored results are identical;
- the fresh-process speedup of 2 workers over 1 on the exactness grid: ``kvfast run`` in a new
  process each, median of ``--repeats``; sweep wall (``report.wall_s``) and process wall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLAN_CHILD = r"""
import json, resource, sys, time
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import kvfast.studies  # noqa: F401 - registers the built-in studies
from kvfast.sweep.grid import grid_from_spec, load_grid
spec = dict(load_grid("exactness").spec)
base_mb = rss()
n, mode = int(sys.argv[1]), sys.argv[2]
spec["axes"] = dict(spec["axes"], seed=list(range(max(1, n // 432))))
t0 = time.perf_counter()
grid = grid_from_spec(spec, max_runs=10**9)
count = len(grid)
if mode == "ids":
    count = sum(1 for _ in grid.iter_ids())
print(json.dumps({"runs": count, "s": time.perf_counter() - t0, "peak_mb": rss(), "base_mb": base_mb}))
"""

TINY = r"""
import numpy as np, pyarrow as pa
from kvfast.sweep.study import Study
def _validate(config):
    from kvfast.validation import require_int
    require_int(config["x"], "x", 0)
def _run(config):
    return {"y": float(config["x"]) * 0.5}
TINY = Study(name="tiny", version="1", description="a tiny run", run=_run,
             config_fields={"x": pa.int64(), "k": pa.int64()}, result_fields={"y": pa.float64()},
             validate_config=_validate, summarize=lambda df: df.head(0), validate_groups=())
"""

BIG_CHILD = (
    TINY
    + r"""
import json, os, sys, threading, time
t_start = float(sys.argv[2])
first = []
def run(config):
    if not first:
        first.append(time.time())
    return _run(config)
import dataclasses
study = dataclasses.replace(TINY, run=run)
import kvfast.studies
kvfast.studies.STUDIES["tiny"] = study
from kvfast.sweep import grid_from_spec, run_sweep
n = int(sys.argv[3])
spec = {"study": "tiny", "axes": {"x": list(range(n // 1000)), "k": list(range(1000))}}
def sweep():
    grid = grid_from_spec(spec, max_runs=n)
    run_sweep(grid, sys.argv[1], jobs=1, quiet=True)
threading.Thread(target=sweep, daemon=True).start()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
while not first:
    time.sleep(0.05)
samples = []
for _ in range(4):
    time.sleep(5)
    samples.append(round(rss()))
print(json.dumps({"first_run_s": first[0] - t_start, "rss_mb": samples}), flush=True)
os._exit(0)
"""
)

RATE_CHILD = (
    TINY
    + r"""
import json, sys, tempfile
import kvfast.studies
kvfast.studies.STUDIES["tiny"] = TINY
from kvfast.sweep import grid_from_spec, load_grid, run_sweep
which = sys.argv[1]
if which == "tiny":
    grid = grid_from_spec({"study": "tiny", "axes": {"x": list(range(20)), "k": list(range(1000))}})
else:
    grid = load_grid(which)
with tempfile.TemporaryDirectory() as tmp:
    run_sweep(grid, tmp + "/warm", jobs=1, quiet=True, chunk_size=1) if which != "tiny" else None
    report = run_sweep(grid, tmp + "/out", jobs=1, quiet=True)
print(json.dumps({"runs": report.ran, "wall_s": report.wall_s, "compute_s": report.compute_s}))
"""
)

DASK_CHILD = (
    TINY
    + r"""
import json, sys, tempfile, time
import kvfast.studies
kvfast.studies.STUDIES["tiny"] = TINY
from kvfast.sweep import grid_from_spec, load, run_sweep
from kvfast.sweep.backends.dask import dask_client
if __name__ == "__main__":
    n = int(sys.argv[1])
    grid = grid_from_spec({"study": "tiny", "axes": {"x": list(range(n // 1000)), "k": list(range(1000))}})
    out, frames = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("fork", "loky"):
            first = run_sweep(grid, f"{tmp}/{backend}", jobs=2, backend=backend, quiet=True)
            again = run_sweep(grid, f"{tmp}/{backend}-2", jobs=2, backend=backend, quiet=True)
            assert first.ok and again.ok
            out[backend] = [n / first.wall_s, n / again.wall_s]
            frames[backend] = load(f"{tmp}/{backend}").drop(columns="wall_s")
        t0 = time.perf_counter()
        client, cluster = dask_client(2, None)
        start = time.perf_counter() - t0
        address = cluster.scheduler_address
        first = run_sweep(grid, f"{tmp}/dask", jobs=2, backend="dask", scheduler=address, quiet=True)
        again = run_sweep(grid, f"{tmp}/dask-2", jobs=2, backend="dask", scheduler=address, quiet=True)
        client.close()
        cluster.close()
        assert first.ok and again.ok
        out["dask"] = [n / (first.wall_s + start), n / again.wall_s]
        out["dask_start_s"] = start
        frames["dask"] = load(f"{tmp}/dask").drop(columns="wall_s")
    base = frames["loky"]
    out["identical"] = all(f.equals(base) for f in frames.values())
    print(json.dumps(out))
"""
)

RESUME_CHILD = r"""
import io, json, sys, time, contextlib, argparse
from kvfast.sweep.plan import find_pending
from kvfast.sweep.store import ResultsDir, load
from kvfast.sweep.grid import grid_from_spec, load_grid
from kvfast.commands.sweep import cmd_show
out, n = sys.argv[1], int(sys.argv[2])
spec = dict(load_grid("exactness").spec)
spec["axes"] = dict(spec["axes"], seed=list(range(max(1, n // 432))))
grid = grid_from_spec(spec, max_runs=10**9)
t0 = time.perf_counter()
store = ResultsDir(out)
plan = find_pending(grid, store.stored_index(), ())
t_resume = time.perf_counter() - t0
t0 = time.perf_counter()
df = load(out)
t_load = time.perf_counter() - t0
t0 = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    cmd_show(argparse.Namespace(dir=out))
t_show = time.perf_counter() - t0
print(json.dumps({"stored": len(df), "pending": plan.total, "resume_s": t_resume, "load_s": t_load, "show_s": t_show}))
"""

WRITE_CHILD = r"""
import itertools, sys
import numpy as np, pyarrow as pa
from kvfast.studies import STUDIES
from kvfast.sweep.grid import grid_from_spec, load_grid
from kvfast.sweep.store import ResultsDir, new_manifest, schema_for
out, n = sys.argv[1], int(sys.argv[2])
study = STUDIES["exactness"]
spec = dict(load_grid("exactness").spec)
spec["axes"] = dict(spec["axes"], seed=list(range(max(1, n // 432))))
grid = grid_from_spec(spec, max_runs=10**9)
schema = schema_for(study)
store = ResultsDir(out)
with store.locked():
    runs = grid.iter_runs()
    while batch := list(itertools.islice(runs, 1 << 16)):
        cols = {"run_id": [r.run_id for r in batch]}
        for f in study.config_fields:
            cols[f] = [r.config[f] for r in batch]
        m = len(batch)
        cols.update(storage=["float64"] * m, accum=["float64"] * m, max_abs_dev=np.zeros(m),
                    first_bad_step=np.full(m, -1), tokens_equal=np.ones(m, bool), tokens=["1,2,3,4"] * m,
                    status=["ok"] * m, error=[None] * m, wall_s=np.full(m, 1e-3))
        store.write_part(pa.Table.from_pydict(cols, schema=schema))
    store.compact(schema)
    manifest = new_manifest(study, None)
    manifest.update(grid=grid.spec, grid_name="exactness", grid_runs=len(grid))
    store.write_manifest(manifest)
"""


def py(code: str, *args: str, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x): the growth exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def planning(sizes: list[int]) -> None:
    print("## planning: exactness grid, seed axis grown (fresh process each)\n")
    print("| runs | validate + count s | all run ids s | peak RSS MB | growth over imports MB |")
    print("|---|---|---|---|---|")
    counted, ids = [], []
    for n in sizes:
        a = py(PLAN_CHILD, str(n), "count")
        b = py(PLAN_CHILD, str(n), "ids")
        counted.append(a)
        ids.append(b)
        grown = b["peak_mb"] - b["base_mb"]
        print(f"| {b['runs']:,} | {a['s']:.3f} | {b['s']:.2f} | {b['peak_mb']:.0f} | {grown:.0f} |")
    runs = [r["runs"] for r in ids]
    print(
        f"\ngrowth exponent (time ~ runs^k): validate + count k = {slope(runs, [r['s'] for r in counted]):.2f}, "
        f"all ids k = {slope(runs, [r['s'] for r in ids]):.2f}; peak-memory growth k = "
        f"{slope(runs, [max(r['peak_mb'] - r['base_mb'], 1.0) for r in ids]):.2f}\n"
    )


def big(n: int) -> None:
    print(f"## a {n:,}-run grid of tiny runs (--jobs 1), swept for 20 s\n")
    with tempfile.TemporaryDirectory(prefix="kvfast-scale-") as tmp:
        r = py(BIG_CHILD, str(Path(tmp) / "out"), str(time.time()), str(n))
    print(
        f"first run finished {r['first_run_s']:.1f} s after the process started; "
        f"resident memory every 5 s while sweeping: {r['rss_mb']} MB\n"
    )


def rates() -> None:
    print("## runs per second per worker (--jobs 1, in-process, Numba cache warm)\n")
    print("| grid | runs | wall s | runs/s | engine overhead |")
    print("|---|---|---|---|---|")
    for which, label in (("exactness", "exactness (built-in, 1,296 runs)"), ("tiny", "tiny runs (20,000)")):
        r = py(RATE_CHILD, which)
        over = 1 - r["compute_s"] / r["wall_s"]
        print(f"| {label} | {r['runs']:,} | {r['wall_s']:.2f} | {r['runs'] / r['wall_s']:,.0f} | {over:.3f} |")
    print()


def resume(sizes: list[int]) -> None:
    print("## resume and load against stored rows (exactness schema, synthetic ok rows)\n")
    print("| stored rows | pending found s | kvfast.load s | kvfast show s |")
    print("|---|---|---|---|")
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="kvfast-scale-") as tmp:
            out = str(Path(tmp) / "out")
            subprocess.run([sys.executable, "-c", WRITE_CHILD, out, str(n)], check=True)
            r = py(RESUME_CHILD, out, str(n))
        print(f"| {r['stored']:,} | {r['resume_s']:.2f} | {r['load_s']:.2f} | {r['show_s']:.2f} |")
    print()


def dask(n: int) -> None:
    print(f"## Dask LocalCluster (2 workers) against loky and fork (2 workers): {n:,} tiny runs\n")
    with tempfile.TemporaryDirectory(prefix="kvfast-scale-") as tmp:
        script = Path(tmp) / "dask_child.py"  # a file: Dask's worker processes re-import the main module
        script.write_text(DASK_CHILD)
        r = py(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", str(n))
    print("| backend | runs/s, first sweep (pool or cluster start included) | runs/s, second sweep (warm) |")
    print("|---|---|---|")
    for backend in ("fork", "loky", "dask"):
        print(f"| {backend} | {r[backend][0]:,.0f} | {r[backend][1]:,.0f} |")
    print(
        f"\nLocalCluster start {r['dask_start_s']:.1f} s; dask / loky throughput: first sweep "
        f"{r['dask'][0] / r['loky'][0]:.2f}x, warm {r['dask'][1] / r['loky'][1]:.2f}x; "
        f"results identical across backends: {r['identical']}\n"
    )


def fresh_speedup(repeats: int) -> None:
    print(f"## fresh process: `kvfast run exactness`, 1 vs 2 workers (median of {repeats})\n")
    walls: dict[int, list] = {1: [], 2: []}
    for _ in range(repeats):
        for jobs in (1, 2):
            with tempfile.TemporaryDirectory(prefix="kvfast-scale-") as tmp:
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "kvfast.cli", "run", "exactness", "--out", f"{tmp}/o",
                     "--jobs", str(jobs), "--quiet"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                process = time.perf_counter() - t0
            sweep = float(proc.stdout.split(" run now in ")[1].split(" s")[0])
            walls[jobs].append((sweep, process))
    s1 = statistics.median(w[0] for w in walls[1])
    s2 = statistics.median(w[0] for w in walls[2])
    p1 = statistics.median(w[1] for w in walls[1])
    p2 = statistics.median(w[1] for w in walls[2])
    print("| workers | sweep wall s | process wall s |\n|---|---|---|")
    print(f"| 1 | {s1:.2f} | {p1:.2f} |\n| 2 | {s2:.2f} | {p2:.2f} |")
    print(f"\nspeedup 2 vs 1 workers: sweep {s1 / s2:.2f}x, process {p1 / p2:.2f}x\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--big", action="store_true", help="also a 10^7-run grid (time to first run, memory)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="planning,rates,resume,dask,fresh", help="comma-separated sections")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    only = set(args.only.split(","))
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    if "planning" in only:
        planning(sizes)
    if args.big:
        big(10_000_000)
    if "rates" in only:
        rates()
    if "resume" in only:
        resume(sizes)
    if "dask" in only:
        dask(100_000)
    if "fresh" in only:
        fresh_speedup(args.repeats)
    print(f"cpu_count {os.cpu_count()}, load average before {load:.2f} after {os.getloadavg()[0]:.2f}, "
          f"took {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
