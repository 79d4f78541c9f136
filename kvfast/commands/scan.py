"""``kvfast scan [--families ...] [--dtypes ...] [--mode MODE] [--out DIR] [--jobs N] [--markdown]``: every
causal-LM architecture of the installed transformers, checked (in the default mode, ``auto``, unless ``--mode``
says otherwise) and scored (the ``hf_scan`` study, extra ``kvfast[hf]``).

Runs :func:`kvfast.studies.hf_scan.scan_spec`'s grid on the sweep engine (parallel, resumable: a rerun runs only
what is not stored), then prints the scoreboard (:func:`kvfast.studies.hf_scan.scoreboard`) and the skipped
architectures with their reasons, and writes both, as CSV and Markdown, to ``DIR.report/`` (beside the results,
never inside them). ``--markdown`` prints them as Markdown (what docs/check.md pastes); ``kvfast report DIR``
draws the heatmap. Bad input (an unknown family, dtype, scenario or mode; with ``--repro``, a ``DIR.repro`` that is a
file, holds files already, or cannot be written) is one line naming the allowed values, exit 2, before any run.
Exit codes as ``kvfast run`` (:data:`kvfast.commands.sweep.EXIT_CODES`): a skipped architecture is a stored
``ok`` run whose verdict is ``skipped``, not a failure.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DTYPES = ("float32", "bfloat16")


def _names(values: list[str] | None) -> list[str]:
    """Values given as several arguments, comma-separated, or both; in order, once each."""
    return list(dict.fromkeys(v for value in values or () for v in value.split(",") if v))


def add_parser(sub) -> None:
    from kvfast.commands.sweep import add_exec_options, add_resume_options

    p = sub.add_parser(
        "scan",
        help="check every causal-LM architecture of the installed transformers; a scoreboard",
        description="Check every causal-LM architecture of the installed transformers (needs kvfast[hf]): a tiny "
        "random model of each model type, in each scenario, clean and with the Hugging Face bug catalogue "
        "injected, run on the sweep engine (parallel, resumable), then a scoreboard of architecture x dtype x "
        "scenario. Exit codes are kvfast run's.",
    )
    p.add_argument("--families", nargs="+", metavar="TYPE", help="model types (default: every causal-LM type)")
    p.add_argument(
        "--dtypes", nargs="+", metavar="DTYPE", help="default: float32 bfloat16 (bfloat16 with the logic check)"
    )
    p.add_argument("--scenarios", nargs="+", metavar="NAME", help="default: every scenario of the check")
    p.add_argument("--seeds", type=int, default=2, metavar="N", help="weight seeds 0..N-1 (default 2)")
    p.add_argument("--prompts", type=int, default=2, metavar="N", help="prompts per seed (default 2)")
    p.add_argument("--steps", type=int, default=16, metavar="N", help="decode steps (default 16)")
    p.add_argument("--attention", default="auto", metavar="IMPL", help="auto (the class's default), sdpa or eager")
    p.add_argument("--bugs", nargs="+", metavar="BUG", help="injected bugs (default: every bug of the catalogue; none)")
    p.add_argument(
        "--mode", default="auto", metavar="MODE",
        help="the check's mode: auto (the default: exact where bit-equal, else against the order noise), exact or "
        "control",
    )  # fmt: skip
    p.add_argument(
        "--out", default="results/hf_scan", metavar="DIR", help="results directory (default: results/hf_scan)"
    )
    p.add_argument("--markdown", action="store_true", help="print the scoreboard and the skipped table as Markdown")
    p.add_argument(
        "--repro", nargs="?", const="findings", default=None, choices=("findings", "all"),
        help="a shrunk standalone reproducer per bug row in DIR.repro/ (findings: clean runs called bug, natively or "
        "by the float64 logic check alone; all: the injected bugs' rows too), listed new findings first",
    )  # fmt: skip
    p.add_argument("--repro-seconds", type=int, default=60, metavar="S", help="shrinking budget per reproducer")
    add_resume_options(p)
    add_exec_options(p)
    p.set_defaults(func=cmd_scan)


def _choose(values: list[str], allowed: tuple[str, ...], option: str) -> None:
    for value in values:
        if value not in allowed:
            raise ValueError(f"{option}: {value!r} is not allowed; allowed: {', '.join(allowed)}")


def build_grid(args):
    """The scan's grid from the command's arguments; ``ValueError`` (one line) for a bad one."""
    from kvfast.bugs.hf import HF_BUGS
    from kvfast.check.options import MODES
    from kvfast.studies import STUDIES, hf_scan
    from kvfast.studies.hf_common import require_torch
    from kvfast.sweep.grid import grid_from_spec
    from kvfast.sweep.options import check_jobs
    from kvfast.validation import require_int

    require_torch("hf_scan")
    families = _names(args.families) or list(hf_scan.architectures())
    _choose(families, hf_scan.architectures(), "--families")
    dtypes = _names(args.dtypes) or list(DEFAULT_DTYPES)
    _choose(dtypes, hf_scan.DTYPES, "--dtypes")
    scenarios = _names(args.scenarios) or list(hf_scan.scenarios())
    _choose(scenarios, hf_scan.scenarios(), "--scenarios")
    _choose([args.attention], hf_scan.ATTENTION, "--attention")
    mode = getattr(args, "mode", "auto")
    _choose([mode], MODES, "--mode")
    bugs = _names(args.bugs) or list(HF_BUGS)
    bugs = [] if bugs == ["none"] else bugs
    _choose(bugs, tuple(HF_BUGS), "--bugs")
    require_int(args.seeds, "--seeds", 1, 100)
    require_int(args.prompts, "--prompts", 1, 100)
    require_int(args.steps, "--steps", 1, 256)
    require_int(getattr(args, "repro_seconds", 60), "--repro-seconds", 1)
    if args.jobs is not None:
        check_jobs(args.jobs)
    spec = hf_scan.scan_spec(
        families, dtypes, scenarios, args.seeds, args.prompts, args.steps, args.attention, bugs, mode
    )
    return grid_from_spec(spec, name="hf_scan", source="kvfast scan", studies=STUDIES)


def scoreboard_text(df, markdown: bool, findings=None) -> str:
    """The scoreboard, each injected bug over every architecture, then the skipped architectures, as text or
    Markdown; then ``findings`` (``--repro``'s listing, new first, each with its reproducer) where given."""
    from kvfast.commands.sweep import _table
    from kvfast.report.claims import markdown as md
    from kvfast.studies import hf_scan

    board, skipped, bugs = hf_scan.scoreboard(df), hf_scan.skipped_table(df), hf_scan.bug_table(df)
    checked, total = hf_scan.coverage(df)
    head = f"{checked} of {total} architectures checked; {len(skipped)} with skipped runs"
    show = md if markdown else _table
    text = f"{head}\n\n{show(board)}\n\ninjected bugs:\n\n{show(bugs)}\n\nskipped:\n\n{show(skipped)}"
    if findings is None:
        return text
    from kvfast.report.scan_findings import findings_text

    return f"{text}\n\nfindings, new first: {findings_text(findings, markdown) if len(findings) else 'none'}"


def cmd_scan(args) -> int:
    from kvfast.commands.sweep import _exit, _sweep, sweep_options
    from kvfast.report.page import report_dir, report_path, writing_report
    from kvfast.studies import hf_scan
    from kvfast.sweep.store import load

    out = Path(args.out).absolute()
    grid = build_grid(args)
    if args.repro:  # before any run: where the reproducers go (never over earlier ones)
        from kvfast.repro.script import require_repro_dir
        from kvfast.studies.scan_repro import repro_dir

        require_repro_dir(repro_dir(out), "--repro")
    report = _sweep(grid, out, sweep_options(args))
    df = load(out)
    df = df[df["run_id"].isin(set(grid.iter_ids()))]  # this grid's runs (DIR may hold an earlier, larger scan)
    print(scoreboard_text(df, args.markdown))
    where = report_path(out)
    stored = f"{len(df):,} runs are stored in {out}"
    with writing_report(where, stored, what="the scoreboard"):  # a failed write: kvfast.cli's one line, 74
        where = report_dir(out)
        where.mkdir(parents=True, exist_ok=True)
        hf_scan.scoreboard(df).to_csv(where / "scoreboard.csv", index=False, lineterminator="\n")
        hf_scan.skipped_table(df).to_csv(where / "skipped.csv", index=False, lineterminator="\n")
        (where / "scoreboard.md").write_text(scoreboard_text(df, True) + "\n")
    print(f"scoreboard: {where / 'scoreboard.md'} (kvfast report {args.out}: the heatmap)")
    if args.repro:
        with writing_report(where, stored, what="the reproducers"):
            findings = _write_reproducers(df, out, args)
            (where / "scoreboard.md").write_text(scoreboard_text(df, True, findings) + "\n")
    return _exit(report)


def _write_reproducers(df, out: Path, args):
    """``--repro``: the bug rows' reproducers beside the results (:mod:`kvfast.studies.scan_repro`), listed new
    first (printed, and written as ``findings.md`` beside ``findings.csv``); the listing."""
    from kvfast.report.claims import markdown as md
    from kvfast.report.page import report_dir
    from kvfast.report.scan_findings import findings_text
    from kvfast.repro.findings import FINDINGS_MD
    from kvfast.studies.scan_repro import repro_dir, write_scan_reproducers

    table = write_scan_reproducers(df, out, args.repro, float(args.repro_seconds))
    if not len(table):
        print("\nfindings, new first: none (no bug row to reproduce)")
        return table
    print(f"\nfindings, new first: {findings_text(table, args.markdown)}")
    (repro_dir(out) / FINDINGS_MD).write_text(md(table) + "\n")
    print(f"reproducers: {repro_dir(out)}; the scoreboard lists them: {report_dir(out) / 'scoreboard.md'}")
    return table
