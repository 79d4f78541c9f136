"""Sweep commands: ``kvfast grids``, ``run``, ``show``, ``study``, ``reproduce``, ``repair``.

Exit codes of ``run``, ``study`` and ``reproduce`` (:data:`EXIT_CODES`): 0 only
when every run of the grid is stored with status ``ok``; 1 when runs ended as
``error``, ``crashed`` or ``timeout`` rows (``--retry-errors`` reruns them); 2
for bad input, one line, before any run (unknown grid, axis or value, TOML
error, a limit exceeded, an unwritable, foreign, broken or busy results
directory; a user's study module or ``validate_config`` that raises or exits,
``os._exit`` at import included: see :mod:`kvfast.runtime.load`); 3 when runs
were lost (not stored: a stall, a lost Dask scheduler;
a plain rerun runs them); 70 for a bug in kvfast (a traceback, the version
and a line saying so); 74 when results could not be written (disk full), one
line saying what is stored (``kvfast report`` and ``kvfast scan`` too, for their
report or scoreboard: disk full, a name too long, a read-only place, saying
where it would have gone); 130 when interrupted (Ctrl-C; rerun to resume).
A sweep that ends with fewer runs stored ``ok`` than its grid never exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvfast.commands import EXIT_INTERRUPTED, EXIT_KVFAST_BUG, EXIT_STORAGE

if TYPE_CHECKING:  # pandas is imported where a table is printed: building the parsers never loads it
    import pandas as pd

EXIT_FAILED = 1
EXIT_LOST = 3
EXIT_CODES = {
    0: "every run of the grid is stored with status `ok`",
    EXIT_FAILED: "runs stored as `error`, `crashed` or `timeout` (`--retry-errors` reruns them)",
    2: "bad input, one line, before any run: grid, TOML, a limit (`--max-runs`, memory), `--out` unwritable, "
    "foreign, broken (`kvfast repair`), of another study or in use; a study's module or `validate_config` that "
    "raises or exits (any exception, `sys.exit`, `os._exit`, `KeyboardInterrupt`)",
    EXIT_LOST: "runs lost, not stored (a stall, a lost Dask scheduler): a plain rerun runs them",
    EXIT_KVFAST_BUG: "a bug in kvfast: a traceback, the version and a line saying so",
    EXIT_STORAGE: "results, a report or a scoreboard could not be written (disk full, a name too long, a read-only "
    "place): one line with what is stored and where it would have gone; free space (or shorten the name) and rerun",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C): rerun to resume",
}


def _jobs(text: str) -> int | str:
    """``--jobs`` as typed: an integer where the text reads as one, else the text; checked once, with every other
    option, by :class:`~kvfast.sweep.options.SweepOptions` (``--jobs: 'x' is not allowed; ...``)."""
    try:
        return int(text)
    except ValueError:
        return text


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a number of seconds > 0")
    return value


def _gib(text: str) -> int:
    """``--max-memory GIB`` in bytes."""
    return int(_positive(text) * 2**30)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "grids",
        help="list the built-in grids and their run counts",
        description="List the built-in grids: each one's study, number of runs and description. A grid whose "
        "study needs an optional extra that is not installed says which (needs kvfast[hf]).",
    )
    p.set_defaults(func=cmd_grids)

    add_run_parser(sub)

    p = sub.add_parser(
        "show",
        help="summary table of a results directory",
        description="Print what a results directory holds: status counts, provenance, the failed runs, and its "
        "study's summary table and claims.",
    )
    p.add_argument("dir", metavar="DIR", help="a results directory (kvfast run --out)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "repair",
        help="rebuild a missing or broken manifest from the parts; quarantine bad parts",
        description="Repair a results directory: rebuild its manifest (_sweep.json) from its Parquet parts and move "
        "parts that cannot be read into DIR/_quarantine/. The next kvfast run into DIR reruns their runs.",
    )
    p.add_argument("dir", metavar="DIR", help="a results directory (kvfast run --out)")
    p.set_defaults(func=cmd_repair)

    p = sub.add_parser(
        "study",
        help="run a study's built-in grid and print its summary",
        description="Run a study's built-in grid (into results/NAME unless --out says otherwise; resumed if it "
        "exists) and print the study's summary table. Exit codes are kvfast run's.",
    )
    p.add_argument("name", metavar="NAME", help="a built-in grid named after its study (kvfast grids lists them)")
    p.add_argument("--out", metavar="DIR", help="results directory (default: results/NAME)")
    p.add_argument("--fresh", action="store_true", help="replace results of another study or version in DIR")
    add_exec_options(p)
    p.set_defaults(func=cmd_study)

    p = sub.add_parser(
        "reproduce",
        help="run every study's built-in grid, print the write-up's claims table and write the report",
        description="Reproduce the claims of the write-up kvfast started from: run every built-in study that is "
        "part of the reproduction, print each study's summary and the claims table (each claim with the "
        "write-up's figure, kvfast's figure, whether it holds and the criterion that decides it), and write an HTML "
        "report beside the results. Exit codes are kvfast run's: 1 means a run failed, not that a claim does not "
        "hold.",
    )
    p.add_argument("--out", default="results/reproduce", metavar="DIR", help="default: results/reproduce")
    add_exec_options(p)
    p.set_defaults(func=cmd_reproduce)


def add_run_parser(sub) -> None:
    """``kvfast run``: its parser, the grid and the execution options."""
    p = sub.add_parser(
        "run",
        help="run a grid (built-in name or TOML file) into a results directory",
        description="Run a grid into a results directory, one Parquet row per run, on every core by default. A "
        "grid is a built-in one (kvfast grids) or a TOML file naming a study and its axes. Rerunning into the "
        "same directory runs only what is missing. Exit codes: 0 every run stored ok, 1 runs stored as error, "
        "crashed or timeout, 2 bad input (before any run), 3 runs lost (a plain rerun runs them), 74 results "
        "could not be written, 130 interrupted (rerun to resume).",
    )
    p.add_argument("grid", metavar="GRID_OR_TOML", help="a built-in grid name (see `kvfast grids`) or a .toml file")
    p.add_argument("--out", required=True, metavar="DIR", help="results directory (created; resumed if it exists)")
    add_exec_options(p)
    p.add_argument(
        "--backend",
        default="fork",
        choices=["fork", "loky", "threading", "dask"],
        help="default: fork (processes forked after the warm-up; loky where fork is unavailable)",
    )
    p.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler address (with --backend dask)")
    add_resume_options(p)
    p.add_argument(
        "--max-runs",
        type=_jobs,
        metavar="N",
        help="refuse a grid of more than N runs, counted from its axes before anything runs (default 10,000,000)",
    )
    p.add_argument(
        "--run-timeout",
        type=_positive,
        metavar="S",
        help="a run taking longer than S seconds is stored as `timeout` and its worker replaced "
        "(threading: Python code only)",
    )
    p.add_argument(
        "--max-memory",
        type=_gib,
        metavar="GIB",
        help="refuse a grid whose largest run needs more than GIB GiB by kvfast's estimate (default: this machine's)",
    )
    p.add_argument(
        "--stall-timeout",
        dest="stall_s",
        type=_positive,
        default=300.0,
        metavar="S",
        help="Dask: give up when no chunk finishes for S seconds; fork, loky: kill a worker stopped that long "
        "(default 300)",
    )
    p.set_defaults(func=cmd_run)


def add_resume_options(p: argparse.ArgumentParser) -> None:
    """``--retry-errors`` and ``--fresh``: what a rerun into a results directory that exists does (``kvfast
    run``, ``kvfast scan``)."""
    p.add_argument("--retry-errors", action="store_true", help="also re-run runs stored as error, crashed or timeout")
    p.add_argument("--fresh", action="store_true", help="delete stored results in DIR first")


def add_exec_options(p: argparse.ArgumentParser) -> None:
    """``--jobs N`` and ``--quiet``: how a grid runs (``kvfast run``, ``reproduce``,
    ``scan``)."""
    p.add_argument("--jobs", type=_jobs, metavar="N", help="worker processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress (a bar, or a line every few seconds)")


def _table(df: pd.DataFrame) -> str:
    if df is None or len(df) == 0:
        return "(no rows)"
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.max_colwidth", 80):
        return df.to_string(index=False)


def cmd_grids(args) -> int:
    import tomllib

    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import builtin_grids, load_grid
    from kvfast.validation import MissingExtra

    rows = []
    for name, path in builtin_grids().items():
        try:
            spec = tomllib.loads(path.read_text())
            runs = len(load_grid(str(path), studies=STUDIES))
        except MissingExtra as exc:  # a valid grid whose study needs what is not installed: say what
            runs = f"needs kvfast[{exc.extra}]"
        except ValueError as exc:
            spec, runs = {"study": "?", "description": str(exc)}, "invalid"
        rows.append(
            {"grid": name, "study": spec.get("study", "?"), "runs": runs, "description": spec.get("description", "")}
        )
    import pandas as pd

    print(_table(pd.DataFrame(rows)))
    return 0


def sweep_options(args, **given):
    """The ``SweepOptions`` of a command's parsed flags: each flag whose ``dest`` names an option (``--jobs``,
    ``--stall-timeout`` as ``stall_s``, ...), then ``given`` over them; checked by ``SweepOptions``."""
    from dataclasses import fields

    from kvfast.sweep.options import SweepOptions

    flags = {f.name: getattr(args, f.name) for f in fields(SweepOptions) if hasattr(args, f.name)}
    return SweepOptions.build(**{**flags, **given})


def cmd_run(args) -> int:
    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import DEFAULT_MAX_RUNS, load_grid

    out = Path(args.out).absolute()  # before the study's module is imported: user code cannot move it
    options = sweep_options(args)
    grid = load_grid(args.grid, max_runs=args.max_runs or DEFAULT_MAX_RUNS, studies=STUDIES)
    return _exit(_sweep(grid, out, options))


def _sweep(grid, out, options):
    """``run_sweep`` with ``options`` (a ``SweepOptions``), its report's line printed; a Ctrl-C before the first run
    is one line and exit code 130 (``SystemExit``; a failed write is :mod:`kvfast.cli`'s exit code 74)."""
    from kvfast.sweep.engine import run_sweep

    try:
        report = run_sweep(grid, out, options)
    except KeyboardInterrupt:  # before the first run (starting a Dask cluster, say): nothing stored changed
        print("kvfast: interrupted before any run; nothing stored changed", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except SystemExit as exc:  # never let a stray exit end a sweep with its code (0 would be a false pass)
        raise RuntimeError(f"SystemExit({exc.code!r}) escaped the sweep engine") from None
    print(report.line())
    return report


def _exit(report) -> int:
    """The exit code of a finished sweep (see :data:`EXIT_CODES`); 0 only when every run is stored ``ok``."""
    if report.interrupted:
        return EXIT_INTERRUPTED
    failed = sum(n for s, n in report.counts.items() if s != "ok")
    missing = report.total - report.counts.get("ok", 0) - failed
    if failed:
        print(
            f"{report.study}: {failed:,} runs stored as error, crashed or timeout; see `kvfast show {report.out}`; "
            "--retry-errors reruns them",
            file=sys.stderr,
        )
    if report.lost or missing > 0:
        print(
            f"{report.study}: {max(len(report.lost), missing):,} runs lost (not stored); "
            "run the same command again to run them",
            file=sys.stderr,
        )
        return EXIT_LOST
    if failed or not report.ok:
        return EXIT_FAILED
    return 0


def _print_summary(study, df: pd.DataFrame, claims: bool = True) -> None:
    """Print ``study``'s summary table of its runs ``df``, then (``claims``) its claims, if it makes any."""
    try:
        print(_table(study.summarize(df)))
    except Exception as exc:  # noqa: BLE001 - a study's summary bug must not hide the others
        print(f"(summary failed: {type(exc).__name__}: {exc})")
    if claims:
        from kvfast.report.claims import COLUMNS, study_claims

        table = study_claims(study, df)[COLUMNS]
        if len(table):
            print(_table(table))


def _other_study(root: Path, grid) -> bool:
    """True when ``root/STUDY`` holds results of another version of the study (reproduce replaces them)."""
    from kvfast.sweep.store import ResultsDir

    store = ResultsDir(root / grid.study.name)
    if not store.manifest_path.exists():
        return False
    reason = store.mismatch(grid.study)
    if reason:
        print(f"note: {store.path} {reason}; starting it afresh", file=sys.stderr)
    return bool(reason)


def cmd_repair(args) -> int:
    from kvfast.sweep.store import repair

    print(repair(args.dir))
    return 0


def cmd_show(args) -> int:
    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import resolve_study
    from kvfast.sweep.provenance import lines
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
    for line in lines(manifest.get("provenance")):
        print(line)
    bad = df[df["status"] != "ok"] if len(df) else df
    if len(bad):
        print("failed runs (first 10):")
        print(_table(bad[["run_id", "status", "error"]].head(10)))
    try:  # the grid's own reference to its study (a name, package.module:STUDY), else the study's name
        study = resolve_study(manifest.get("study_ref") or name, STUDIES)
    except ValueError as exc:  # its module fails, or a name not in this kvfast
        why = f": {exc}" if manifest.get("study_ref") else " is not registered in this kvfast"
        print(f"(study {name!r}{why}; no summary)")
        return 0
    _print_summary(study, df)
    return 0


def _study_grid(name: str):
    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import builtin_grids, load_grid
    from kvfast.validation import require_choice

    require_choice(name, "study", STUDIES)
    grids = builtin_grids()
    if name not in grids:
        raise ValueError(f"study: {name!r} has no built-in grid (kvfast/data/grids/{name}.toml)")
    grid = load_grid(str(grids[name]), studies=STUDIES)
    if grid.study.name != name:
        raise ValueError(f"grid {name}: runs study {grid.study.name!r}, not {name!r}")
    return grid


def _run_study(grid, out: Path, args, fresh: bool):
    from kvfast.sweep.store import load

    return _sweep(grid, out, sweep_options(args, fresh=fresh)), load(out)  # the sweep first: it writes out


def cmd_study(args) -> int:
    out = Path(args.out or f"results/{args.name}").absolute()  # before any user code (see cmd_run)
    grid = _study_grid(args.name)
    report, df = _run_study(grid, out, args, fresh=args.fresh)
    _print_summary(grid.study, df)
    return _exit(report)


def cmd_reproduce(args) -> int:
    from kvfast.studies import STUDIES
    from kvfast.sweep.grid import builtin_grids
    from kvfast.sweep.store import ResultsDir

    root = Path(args.out).absolute()  # before any user code (see cmd_run)
    grids = builtin_grids()
    plan = []
    for name in sorted(STUDIES):
        if name not in grids:
            print(f"note: study {name!r} has no built-in grid; skipped", file=sys.stderr)
            continue
        if not STUDIES[name].reproduce:  # an experiment: `kvfast study NAME` runs it
            continue
        grid = _study_grid(name)  # every grid validated before the first run
        ResultsDir(root / name).require_writable(grid.study, fresh=True)
        plan.append(grid)
    t0 = time.perf_counter()
    status = 0
    for grid in plan:
        print(f"\n== {grid.study.name}: {grid.study.description}")
        report, df = _run_study(grid, root / grid.study.name, args, fresh=_other_study(root, grid))
        _print_summary(grid.study, df, claims=False)
        status = status or _exit(report)
        if report.interrupted:
            break
    print(f"\n== claims ({len(plan)} studies, {time.perf_counter() - t0:.1f} s; results in {root})")
    from kvfast.report.claims import claims_markdown, claims_table, load_results
    from kvfast.report.page import write_report

    try:
        print(claims_markdown(claims_table(load_results(root))))
        print(f"\nreport: {write_report(root)}")
    except ValueError as exc:  # nothing stored yet (interrupted before the first study ended)
        print(f"note: no report: {exc}", file=sys.stderr)
    return status
