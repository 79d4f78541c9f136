"""Sweep-engine benchmark on the built-in 1,296-run exactness grid.

    .venv/bin/python benchmarks/sweep.py [--grid exactness] [--repeats 3] [--jobs 2] [--backend fork] [--cold-only]

Every measurement runs in a fresh child process (as `kvfast run` would), into a fresh results
directory, and prints one JSON line; this script prints a Markdown table of:

- wall time with 1 worker and with N workers (``--backend``, default fork; median of ``--repeats``),
  and the speedup;
- engine overhead: the fraction of wall time not spent inside runs,
  ``1 - (sum of the runs' own wall_s / workers) / wall`` (perfect balance and zero overhead give 0);
- runs per second;
- the same sweep again in the same process (fresh directory), so the worker pool is already up;
- peak memory: the main process and the largest worker (VmHWM from /proc on Linux);
- cold versus warm compile: the first run of a sweep (in the main process, as warm-up) with an
  empty Numba cache directory, and again with that directory filled; plus the whole N-worker sweep
  wall time and CPU time (the process and the workers it reaped) in both cases, each cold / warm ratio
  (one sample each: compiling is a one-off), and how many functions the main process and the workers
  compiled (Numba's ``numba:compile`` events, which a load from the cache does not raise here; a
  forked worker inherits the listener, so 0 there means the workers ran on what the warm-up
  compiled; the names are printed when not; other backends' workers are not counted). "Workers"
  are every other process: the warm-up helpers (one run per compile key, side by side with the
  main process's) and the pool's workers; a function compiled (same signature) in more than one
  process, which the kernels' compile locks should prevent, is named on its own line (compiled for
  itself: not an overload's body compiled while typing another function, which each process types);
  and the cold sweep's timeline: when each process compiled, from the sweep's start.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
from numba.core import event
main_pid = os.getpid()
compile_log = sys.argv[2] + ".compiles"
class CompileLog(event.Listener):  # inherited by forked workers: every process appends what it compiles
    depth = 0  # compiles in progress in this process (a nested one: an overload's body typed inside another)
    def on_start(self, ev):
        with open(compile_log, "a") as f:
            name, args = ev.data['dispatcher'].py_func.__qualname__, ev.data['args']
            f.write(f"S\t{os.getpid()}\t{name}\t{args}\t{self.depth}\t{time.time()}\n")
        self.depth += 1
    def on_end(self, ev):
        self.depth -= 1
        if not self.depth:
            with open(compile_log, "a") as f:
                f.write(f"E\t{os.getpid()}\t\t\t0\t{time.time()}\n")
event.register("numba:compile", CompileLog())
import kvfast.studies  # noqa: F401 - registers the built-in studies into the sweep's registry
from kvfast.sweep import load, load_grid, run_sweep
grid = load_grid(sys.argv[1])
jobs = int(sys.argv[3])
backend = sys.argv[4]
t_sweep = time.time()
report = run_sweep(grid, sys.argv[2], jobs=jobs, backend=backend, quiet=True)
t_end = time.time()
df = load(sys.argv[2])
first = df.set_index("run_id").loc[grid.runs[0].run_id, "wall_s"]
workers_kb = []
for stat in __import__("glob").glob("/proc/[0-9]*/stat"):
    try:
        fields = open(stat).read().rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid():  # a child of this process: a worker (or loky's resource tracker)
            for line in open(stat[:-4] + "status"):
                if line.startswith("VmHWM:"):
                    workers_kb.append(int(line.split()[1]))
    except (OSError, IndexError, ValueError):
        pass
events = [line.split("\t") for line in open(compile_log).read().splitlines()] if os.path.exists(compile_log) else []
log = [e[1:5] for e in events if e[0] == "S"]
main_compiles = sum(pid == str(main_pid) for pid, _, _, _ in log)
worker_compiles = len(log) - main_compiles
worker_compiled = sorted({name for pid, name, _, _ in log if pid != str(main_pid)})
processes_of = {}
for pid, name, args, depth in log:
    if depth == "0":  # a function compiled for itself (what a nested one is part of differs between processes)
        processes_of.setdefault((name, args), set()).add(pid)
compiled_twice = sorted({name for (name, _), pids in processes_of.items() if len(pids) > 1})
# per process, from the sweep's start: [first compile's start, last compile's end, seconds compiling (top level)]
timeline, started = {}, {}
for kind, pid, _, _, depth, t in events:
    who = "main" if pid == str(main_pid) else pid
    t = float(t) - t_sweep
    if depth == "0" and kind == "S":
        started[pid] = t
        timeline.setdefault(who, [t, t, 0.0])
    elif kind == "E" and pid in started:
        span = timeline[who]
        span[1], span[2] = t, span[2] + t - started.pop(pid)
# same process: the pool is warm
again = run_sweep(grid, sys.argv[2] + "-again", jobs=jobs, backend=backend, quiet=True)
print(json.dumps({
    "jobs": jobs, "ok": report.ok, "ran": report.ran, "wall_s": report.wall_s,
    "compute_s": report.compute_s, "chunk_size": report.chunk_size, "first_run_s": float(first),
    "process_s": time.perf_counter() - t0,
    "main_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "worker_peak_mb": max(workers_kb) / 1024 if workers_kb else None,
    "again_wall_s": again.wall_s, "again_compute_s": again.compute_s,
    "main_compiles": main_compiles, "worker_compiles": worker_compiles, "worker_compiled": worker_compiled,
    "compiled_twice": compiled_twice, "timeline": timeline, "sweep_s": t_end - t_sweep,
}))
"""


def child(grid: str, jobs: int, env: dict | None = None, backend: str = "fork") -> dict:
    """One sweep in a fresh process: its JSON line, plus ``cpu_s``, the CPU seconds of that process and
    the workers it reaped (``RUSAGE_CHILDREN``: user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="kvfast-bench-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, grid, str(Path(tmp) / "out"), str(jobs), backend],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
        )
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if not result["ok"]:
        raise SystemExit(f"benchmark sweep did not finish ok: {result}")
    return result


def cpu_pressure() -> str:
    """Linux PSI: the share of the last minute some runnable task waited for a CPU (other jobs' load)."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return next(f for f in line.split() if f.startswith("avg60=")).split("=")[1] + "%"
    except (OSError, StopIteration, IndexError):
        return "n/a"


def overhead(r: dict) -> float:
    return 1.0 - (r["compute_s"] / r["jobs"]) / r["wall_s"]


def compile_table(args, cold: dict, warm: dict) -> None:
    """The cold / warm compile table, and what was compiled outside the main process."""
    print(
        f"| compile | first run s (main process) | {args.jobs}-worker sweep wall s | "
        "process CPU s (main + workers) | functions compiled: main / workers |\n|---|---|---|---|---|"
    )
    for name, r, digits in (("cold (empty Numba cache)", cold, 2), ("warm (cache filled)", warm, 3)):
        print(
            f"| {name} | {r['first_run_s']:.{digits}f} | {r['wall_s']:.2f} | {r['cpu_s']:.1f} | "
            f"{r['main_compiles']} / {r['worker_compiles']} |"
        )
    print(
        f"| cold / warm (same run) | {cold['first_run_s'] / warm['first_run_s']:.0f}x | "
        f"{cold['wall_s'] / warm['wall_s']:.1f}x | {cold['cpu_s'] / warm['cpu_s']:.1f}x | |"
    )
    for name, r in (("cold", cold), ("warm", warm)):
        if r["worker_compiled"]:
            print(f"compiled outside the main process ({name}): {', '.join(r['worker_compiled'])}")
        twice = ", ".join(r["compiled_twice"]) or "none"
        print(f"compiled in more than one process, same signature ({name}): {twice}")
    others = iter(range(1, len(cold["timeline"]) + 1))
    spans = "; ".join(
        f"{'main process' if who == 'main' else f'process {next(others)}'} {a:.1f}-{b:.1f} ({busy:.1f} s compiling)"
        for who, (a, b, busy) in sorted(cold["timeline"].items(), key=lambda kv: (kv[0] != "main", kv[1][0]))
    )
    print(f"cold sweep, s from its start: compiles (first start-last end) {spans or 'none'}; end {cold['sweep_s']:.1f}")
    print(
        "(cold and warm: one sweep each, a fresh process each, the cold one first; compiling is a one-off, "
        "so these are single samples, not medians)"
    )


def print_load(load_before, pressure_before: str, t0: float) -> None:
    print()
    load_after = os.getloadavg()
    print(
        f"cpu_count {os.cpu_count()}, load average before {load_before[0]:.2f} after {load_after[0]:.2f}, "
        f"CPU pressure (some avg60) before {pressure_before} after {cpu_pressure()}, "
        f"benchmark took {time.perf_counter() - t0:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="exactness")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="the parallel worker count to compare with 1")
    parser.add_argument("--backend", default="fork", help="fork, loky, threading or dask (default fork)")
    parser.add_argument(
        "--cold-only", action="store_true", help="only the cold and warm compile figures (no 1 vs N worker table)"
    )
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    pressure_before = cpu_pressure()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfast-numba-cold-") as cache:
        cold = child(args.grid, args.jobs, {"NUMBA_CACHE_DIR": cache}, args.backend)
        warm = child(args.grid, args.jobs, {"NUMBA_CACHE_DIR": cache}, args.backend)
    if args.cold_only:
        compile_table(args, cold, warm)
        print_load(load_before, pressure_before, t0)
        return 0
    runs = {1: [], args.jobs: []}
    for _ in range(args.repeats):
        for jobs in runs:
            runs[jobs].append(child(args.grid, jobs, backend=args.backend))

    def med(jobs: int, key: str) -> float:
        return statistics.median(r[key] if key != "overhead" else overhead(r) for r in runs[jobs])

    n = runs[1][0]["ran"]
    w1, wn = med(1, "wall_s"), med(args.jobs, "wall_s")
    rows = [
        ("runs in the grid", f"{n:,}", f"{n:,}"),
        ("chunk size (runs)", f"{runs[1][0]['chunk_size']}", f"{runs[args.jobs][0]['chunk_size']}"),
        ("sweep wall s (median)", f"{w1:.2f}", f"{wn:.2f}"),
        ("speedup vs 1 worker", "1.00", f"{w1 / wn:.2f}"),
        ("runs per second", f"{n / w1:,.0f}", f"{n / wn:,.0f}"),
        ("sum of run times s", f"{med(1, 'compute_s'):.2f}", f"{med(args.jobs, 'compute_s'):.2f}"),
        ("engine overhead (fraction of wall)", f"{med(1, 'overhead'):.3f}", f"{med(args.jobs, 'overhead'):.3f}"),
        (
            "sweep wall s, 2nd sweep in the same process (warm pool)",
            f"{med(1, 'again_wall_s'):.2f}",
            f"{med(args.jobs, 'again_wall_s'):.2f}",
        ),
        ("speedup, 2nd sweep", "1.00", f"{med(1, 'again_wall_s') / med(args.jobs, 'again_wall_s'):.2f}"),
        ("process wall s incl. imports", f"{med(1, 'process_s'):.2f}", f"{med(args.jobs, 'process_s'):.2f}"),
        ("peak memory, main process MB", f"{med(1, 'main_peak_mb'):.0f}", f"{med(args.jobs, 'main_peak_mb'):.0f}"),
    ]
    worker_peaks = [r["worker_peak_mb"] for r in runs[args.jobs] if r["worker_peak_mb"]]
    rows.append(("peak memory, largest worker MB", "-", f"{max(worker_peaks):.0f}" if worker_peaks else "n/a"))
    print(
        f"grid {args.grid}, backend {args.backend}: 1 worker vs {args.jobs} workers, "
        f"median of {args.repeats} fresh processes"
    )
    print(f"| figure | 1 worker | {args.jobs} workers |\n|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a} | {b} |")
    print()
    compile_table(args, cold, warm)
    print_load(load_before, pressure_before, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
