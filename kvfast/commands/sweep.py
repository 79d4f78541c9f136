"""Sweep commands: ``kvfast grids``, ``run``, ``show``, ``study``, ``reproduce``.

Bad input (unknown grid, axis or value, TOML syntax error, out-of-range value,
unwritable or foreign output directory, a directory in use) is a ``ValueError``:
one line on stderr and exit code 2, before any run starts. A sweep that ends
with failed or lost runs exits 1; an interrupted one 130.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed: an integer >= 1")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a number of seconds > 0")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("grids", help="list the built-in grids and their run counts")
    p.set_defaults(func=cmd_grids)

    p = sub.add_parser("run", help="run a grid (built-in name or TOML file) into a results directory")
    p.add_argument("grid", metavar="GRID_OR_TOML", help="a built-in grid name (see `kvfast grids`) or a .toml file")
    p.add_argument("--out", required=True, metavar="DIR", help="results directory (created; resumed if it exists)")
    _exec_options(p)
    p.add_argument(
        "--backend",
        default="fork",
        choices=["fork", "loky", "threading", "dask"],
        help="default: fork (processes forked after the warm-up; loky where fork is unavailable)",
    )
    p.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler address (with --backend dask)")
    p.add_argument("--retry-errors", action="store_true", help="also re-run runs stored as error or crashed")
    p.add_argument("--fresh", action="store_true", help="delete stored results in DIR first")
    p.add_argument(
        "--max-runs",
        type=_jobs,
        default=None,
        metavar="N",
        help="refuse a grid of more than N runs, counted from its axes before anything runs (default 10,000,000)",
    )
    p.add_argument(
        "--stall-timeout",
        type=_positive,
        default=300.0,
        metavar="S",
        help="Dask: give up when no chunk finishes for S seconds (default 300)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("show", help="summary table of a results directory")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("study", help="run a study's built-in grid and print its summary")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--out", metavar="DIR", help="results directory (default: results/NAME)")
    _exec_options(p)
    p.set_defaults(func=cmd_study)

    p = sub.add_parser(
        "reproduce", help="run every study's built-in grid, print the seed's claims table and write the report"
    )
    p.add_argument("--out", default="results/reproduce", metavar="DIR", help="default: results/reproduce")
    _exec_options(p)
    p.set_defaults(func=cmd_reproduce)


def _exec_options(p) -> None:
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N", help="worker processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _table(df: pd.DataFrame) -> str:
    if df is None or len(df) == 0:
        return "(no rows)"
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.max_colwidth", 80):
        return df.to_string(index=False)


def cmd_grids(args) -> int:
    from kvfast.sweep.grid import builtin_grids, load_grid

    rows = []
    for name, path in builtin_grids().items():
        try:
            g = load_grid(str(path))
            rows.append(
                {"grid": name, "study": g.study.name, "runs": len(g), "description": g.spec.get("description", "")}
            )
        except ValueError as exc:
            rows.append({"grid": name, "study": "?", "runs": "invalid", "description": str(exc)})
    print(_table(pd.DataFrame(rows)))
    return 0


def cmd_run(args) -> int:
    from kvfast.sweep.engine import run_sweep
    from kvfast.sweep.grid import DEFAULT_MAX_RUNS, load_grid

    grid = load_grid(args.grid, max_runs=args.max_runs or DEFAULT_MAX_RUNS)
    report = run_sweep(
        grid,
        args.out,
        jobs=args.jobs,
        backend=args.backend,
        scheduler=args.scheduler,
        retry_errors=args.retry_errors,
        fresh=args.fresh,
        quiet=args.quiet,
        stall_s=args.stall_timeout,
    )
    print(report.line())
    return _exit(report)


def _exit(report) -> int:
    if report.interrupted:
        return EXIT_INTERRUPTED
    if not report.ok:
        failed = report.total - report.counts.get("ok", 0)
        print(
            f"{report.study}: {failed:,} runs not ok; see `kvfast show {report.out}`, "
            "re-run with --retry-errors to retry them",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0


def _summary(study, df: pd.DataFrame) -> str:
    try:
        return _table(study.summarize(df))
    except Exception as exc:  # noqa: BLE001 - a study's summary bug must not hide the others
        return f"(summary failed: {type(exc).__name__}: {exc})"


def cmd_show(args) -> int:
    from kvfast.studies import STUDIES
    from kvfast.sweep.store import ResultsDir, load

    store = ResultsDir(args.dir)
    if not store.path.is_dir():
        raise ValueError(f"DIR: {args.dir!r} is not a directory")
    manifest = store.manifest()
    if manifest is None:
        raise ValueError(f"DIR: {args.dir!r} is not a kvfast results directory (no _sweep.json)")
    df = load(args.dir)
    name = manifest["study"]
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    print(
        f"{args.dir}: study {name} v{manifest['study_version']}, last grid {manifest.get('grid_name')!r} "
        f"({manifest.get('grid_runs') or 0:,} runs); {len(df):,} runs stored: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()))
    )
    bad = df[df["status"] != "ok"] if len(df) else df
    if len(bad):
        print("failed runs (first 10):")
        print(_table(bad[["run_id", "status", "error"]].head(10)))
    study = STUDIES.get(name)
    if study is None and manifest.get("study_ref"):
        from kvfast.sweep.grid import resolve_study

        try:
            study = resolve_study(manifest["study_ref"])
        except ValueError as exc:
            print(f"(study {name!r}: {exc}; no summary)")
            return 0
    if study is None:
        print(f"(study {name!r} is not registered in this kvfast; no summary)")
        return 0
    print(_summary(study, df))
    claims = _claims(study, df)
    if len(claims):
        print(_table(claims))
    return 0


def _claims(study, df: pd.DataFrame) -> pd.DataFrame:
    from kvfast.report.claims import COLUMNS, study_claims

    return study_claims(study, df)[COLUMNS]


def _study_grid(name: str):
    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import builtin_grids, load_grid

    if name not in STUDIES:
        raise ValueError(f"study: {name!r} is not allowed; allowed: {', '.join(sorted(STUDIES))}")
    grids = builtin_grids()
    if name not in grids:
        raise ValueError(f"study: {name!r} has no built-in grid (kvfast/data/grids/{name}.toml)")
    grid = load_grid(str(grids[name]))
    if grid.study.name != name:
        raise ValueError(f"grid {name}: runs study {grid.study.name!r}, not {name!r}")
    return grid


def _run_study(grid, out: Path, jobs, quiet: bool):
    from kvfast.sweep.engine import run_sweep
    from kvfast.sweep.store import ResultsDir, load

    reason = ResultsDir(out).mismatch(grid.study) if (out / "_sweep.json").exists() else None
    if reason:
        print(f"note: {out} {reason}; starting it afresh", file=sys.stderr)
    report = run_sweep(grid, out, jobs=jobs, quiet=quiet, fresh=bool(reason))
    print(report.line())
    return report, load(out)


def cmd_study(args) -> int:
    grid = _study_grid(args.name)
    out = Path(args.out or f"results/{args.name}")
    report, df = _run_study(grid, out, args.jobs, args.quiet)
    print(_summary(grid.study, df))
    claims = _claims(grid.study, df)
    if len(claims):
        print(_table(claims))
    return _exit(report)


def cmd_reproduce(args) -> int:
    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import builtin_grids
    from kvfast.sweep.store import ResultsDir

    root = Path(args.out)
    grids = builtin_grids()
    plan = []
    for name in sorted(STUDIES):
        if name not in grids:
            print(f"note: study {name!r} has no built-in grid; skipped", file=sys.stderr)
            continue
        grid = _study_grid(name)  # every grid validated before the first run
        ResultsDir(root / name).require_writable(grid.study, fresh=True)
        plan.append(grid)
    t0 = time.perf_counter()
    status = 0
    for grid in plan:
        print(f"\n== {grid.study.name}: {grid.study.description}")
        report, df = _run_study(grid, root / grid.study.name, args.jobs, args.quiet)
        print(_summary(grid.study, df))
        status = status or _exit(report)
        if report.interrupted:
            break
    print(f"\n== claims ({len(plan)} studies, {time.perf_counter() - t0:.1f} s; results in {root})")
    from kvfast.report import claims_markdown, claims_table, load_results, write_report

    try:
        print(claims_markdown(claims_table(load_results(root))))
        print(f"\nreport: {write_report(root)}")
    except ValueError as exc:  # nothing stored yet (interrupted before the first study ended)
        print(f"note: no report: {exc}", file=sys.stderr)
    return status
