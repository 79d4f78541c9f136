"""Clean tiny models through every scenario on several transformers releases: a verdict count per release.

    python benchmarks/scan_releases.py --releases 4.57.6 5.0.0 5.10.4 5.15.1 5.24.0 5.25.0 [--envs DIR]
    python benchmarks/scan_releases.py --venv PATH [--venv PATH ...]

Per release: an environment (``--venv PATH``: a virtual environment, run with its own python; ``--releases X``: a
folder made once with ``pip install --target ENVS/transformers-X transformers==X``, ``huggingface_hub<1.0`` beside
a 4.x release, the numpy and torch pip puts there removed, so the release runs on this environment's CPU torch and
numpy, and this environment's :data:`HIDDEN` packages hidden from it; the release installed here runs without a
folder). In each, a child process imports this checkout's kvfast and checks the clean tiny models (:data:`MODELS`:
every family of :data:`kvfast.check.hf.FAMILIES`, Llama over a ``StaticCache``, Mamba and Mamba-2 from
:func:`kvfast.studies.architectures.tiny_architecture`) in every scenario, on a prompt longer than Mistral's window
and one shorter, 10 decode steps: control mode in float32 with sdpa, and exact mode in bfloat16 with eager
attention (where cache and recompute agree bit for bit, so any ``divergent`` is false), the attention families
only. It prints a markdown table, one row per release: models, scenario reports, and how many are ``bug``,
``inconclusive``, ``divergent`` (exact mode), ``skipped`` (reasons summarised), an error of the model's, and
``rounding`` / ``exact``. On a clean model a ``bug`` or ``divergent`` is a false alarm unless the release's own
cache is at fault (docs/check.md, "Transformers releases", names each such finding).

``--scan`` instead runs ``kvfast scan`` per release (``--families``, ``--dtypes``, ...) into ``OUT/release``
and merges the runs into ``OUT/merged.parquet`` with a ``transformers_version`` column, printing the worst
clean verdict per architecture, dtype and scenario in each release and the cells whose verdict changes.

A release that cannot be installed, or whose run fails, is reported in one line and left out; the rest go on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RELEASES = ("4.57.6", "5.0.0", "5.10.4", "5.15.1", "5.24.0", "5.25.0")
DEFAULT_FAMILIES = (
    "llama",
    "gpt2",
    "mistral",
    "qwen2",
    "gemma",
    "gemma2",
    "phi3",
    "opt",
    "gpt_neox",
    "bloom",
    "falcon",
)
#: Packages pip brings with transformers that must come from this environment (a second copy would shadow it).
SHADOWING = ("numpy", "torch")


def installed_release() -> str:
    import transformers

    return str(transformers.__version__)


def environment(release: str, envs: Path) -> Path | None:
    """The folder that holds ``release`` (made once), or ``None`` for the release installed here."""
    if release == installed_release():
        return None
    target = envs / f"transformers-{release}"
    if (target / ".complete").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    pins = [f"transformers=={release}"] + (["huggingface_hub<1.0"] if release.startswith("4.") else [])
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), *pins]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip install {' '.join(pins)} failed: {done.stderr.strip().splitlines()[-1:]}")
    for entry in target.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() in SHADOWING:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
    (target / ".complete").write_text(release + "\n")
    return target


#: Packages of this environment a release folder's child must not see: transformers imports the hub's ``kernels``
#: wherever it finds it, and the one the newest transformers brings fails with an older release (its
#: huggingface_hub lacks names; an older ``kernels`` asks for a GPU build of torch). Every release runs its reference
#: code without it, as on any machine without ``kernels``.
HIDDEN = ("kernels",)


def child_env(target: Path | None) -> dict:
    path = [str(p) for p in (target, ROOT) if p is not None]
    hidden = ",".join(HIDDEN) if target is not None else ""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "KVFAST_SCAN_HIDDEN": hidden}


def release_types(target: Path | None) -> list[str]:
    """The causal-LM model types of the release in ``target`` (its own auto mapping)."""
    code = "import json; from kvfast.studies.architectures import causal_lm_types as t; print(json.dumps(list(t())))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(target))
    if out.returncode:
        raise RuntimeError(f"cannot read its architectures: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def scan_release(release: str, args, envs: Path) -> Path:
    """``kvfast scan`` of ``release`` into ``OUT/release``; the results directory."""
    target = environment(release, envs)
    have = release_types(target)
    families = [f for f in args.families if f in have]
    if not families:
        raise RuntimeError(f"none of {', '.join(args.families)} is a causal-LM type of transformers {release}")
    out = Path(args.out) / release
    cmd = [sys.executable, "-m", "kvfast.cli", "scan", "--families", *families, "--out", str(out), "--quiet"]
    cmd += ["--dtypes", *args.dtypes, "--seeds", str(args.seeds), "--prompts", str(args.prompts)]
    cmd += ["--steps", str(args.steps), "--bugs", *args.bugs, "--jobs", str(args.jobs)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(target), cwd=ROOT)
    print(done.stdout.splitlines()[0] if done.stdout else "", flush=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"kvfast scan exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return out


def worst(verdicts: pd.Series) -> str:
    from kvfast.studies.hf_scan import VERDICTS

    rank = {v: i for i, v in enumerate(VERDICTS)}
    return max(verdicts, key=lambda v: rank.get(v, len(VERDICTS)))


def by_release(merged: pd.DataFrame) -> pd.DataFrame:
    """Architecture x dtype x scenario (clean runs): the worst verdict in each release, a column per release."""
    clean = merged[(merged["status"] == "ok") & (merged["bug"] == "none")]
    table = clean.pivot_table(
        index=["architecture", "dtype", "scenario"], columns="transformers_version", values="verdict", aggfunc=worst
    )
    order = sorted(table.columns, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit()))
    return table[order].fillna("-").reset_index()


def changes(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of :func:`by_release` whose verdict differs between releases where both ran."""
    releases = [c for c in table.columns if c not in ("architecture", "dtype", "scenario")]
    keep = table[releases].apply(lambda row: len({v for v in row if v != "-"}) > 1, axis=1)
    return table[keep]


# --- clean models through every scenario (the default) ----------------------------------------------------

#: (name, how the child builds it, exact mode too): the clean tiny models every release must check cleanly
MODELS = (
    ("llama", "family", True),
    ("gpt2", "family", True),
    ("mistral", "family", True),
    ("qwen2", "family", True),
    ("llama+static", "static", True),
    ("mamba", "architecture", False),
    ("mamba2", "architecture", False),
)
#: a prompt longer than Mistral's window of 12, and one shorter (its rollbacks then start inside the window)
PROMPTS = (list(range(3, 19)), [5, 9, 2, 7, 4])
STEPS = 10
#: the columns of the table, in order (a report's verdict, or ``error``: the model's own error)
COUNTED = ("bug", "inconclusive", "divergent", "skipped", "error")


def _model(name: str, how: str, dtype: str, attention: str):
    """The clean model ``name`` as the child builds it (an ``HFModel`` or a transformers model)."""
    import transformers

    from kvfast.check.hf import HFModel
    from kvfast.studies.architectures import tiny_architecture
    from kvfast.testing import tiny_model

    if how == "architecture":
        return tiny_architecture(name, dtype, "auto", 0)
    family = name.split("+")[0]
    model = tiny_model(family, dtype, attention, 0)
    if how == "static":
        return HFModel(model, new_cache=lambda: transformers.StaticCache(config=model.config, max_cache_len=64))
    return model


def child() -> None:
    """In a release's environment: every model, mode and scenario; one JSON line per scenario report."""
    for name in filter(None, os.environ.get("KVFAST_SCAN_HIDDEN", "").split(",")):
        sys.modules[name] = None  # find_spec() then answers None and an import raises ImportError
    import torch
    import transformers

    from kvfast.check import ModelUnderTestError, check_cache
    from kvfast.check.options import ALL_SCENARIOS

    torch.set_num_threads(1)
    release = str(transformers.__version__)
    for name, how, exact_too in MODELS:
        modes = [("control", "float32", "sdpa")] + ([("exact", "bfloat16", "eager")] if exact_too else [])
        for mode, dtype, attention in modes:
            for scenario, prompt in itertools.product(ALL_SCENARIOS, PROMPTS):
                row = {"release": release, "model": name, "mode": mode, "scenario": scenario, "prompt": len(prompt)}
                try:
                    model = _model(name, how, dtype, attention)
                    report = check_cache(model, prompt, STEPS, mode=mode, scenarios=scenario)
                except (ModelUnderTestError, ValueError) as exc:
                    print(json.dumps({**row, "verdict": "error", "note": " ".join(str(exc).split())[:300]}))
                    continue
                for got, scenario_report in report.scenarios.items():
                    note = scenario_report.notes[0] if scenario_report.verdict == "skipped" else ""
                    print(json.dumps({**row, "scenario": got, "verdict": scenario_report.verdict, "note": note}))
            sys.stdout.flush()


def _reason(note: str) -> str:
    """A skip's or an error's note, short: the part after the release's name, up to a parenthesis."""
    text = note.split(": ", 2)[-1] if "transformers " in note else note
    return text.split(" (")[0].removeprefix("its ")


def summarise(rows: list[dict]) -> dict:
    """One release's rows as the table's cells."""
    counts = {k: sum(r["verdict"] == k for r in rows) for k in COUNTED}
    passed = sum(r["verdict"] in ("rounding", "exact") for r in rows)
    why: dict[str, int] = {}
    for r in rows:
        if r["verdict"] in ("skipped", "error"):
            key = f"{r['model']} {r['scenario']}: {_reason(r['note'])}"
            why[key] = why.get(key, 0) + 1
    reasons = "; ".join(f"{k} ({n})" for k, n in sorted(why.items())) or "-"
    alarms: dict[str, int] = {}
    for r in rows:
        if r["verdict"] in ("bug", "inconclusive", "divergent"):
            key = f"{r['model']} {r['mode']} {r['scenario']} {r['verdict']}"
            alarms[key] = alarms.get(key, 0) + 1
    where = "; ".join(f"{k} ({n})" for k, n in sorted(alarms.items())) or "-"
    models = len({r["model"] for r in rows})
    return {"models": models, "runs": len(rows), **counts, "passed": passed, "reasons": reasons, "where": where}


def markdown(results: dict[str, list[dict]]) -> str:
    """The table: a row per release (``bug`` and ``divergent`` on clean models are false ones)."""
    head = [
        "release",
        "models",
        "scenario reports",
        *COUNTED,
        "rounding / exact",
        "bug, inconclusive, divergent: where",
    ]
    head += ["skipped and errors: why"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for release, rows in results.items():
        c = summarise(rows)
        cells = [release, c["models"], c["runs"], *(c[k] for k in COUNTED), c["passed"], c["where"], c["reasons"]]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def run_child(python: str, env: dict) -> list[dict]:
    """The child's rows (this file run with ``--child`` by ``python`` in ``env``)."""
    done = subprocess.run([python, __file__, "--child"], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"the child exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def venv_env() -> dict:
    """A virtual environment's child: this checkout first on its path."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def scenarios_main(args) -> int:
    envs = Path(args.envs or Path(args.out) / "envs").absolute()
    envs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    runs = [(f"venv {v}", lambda v=v: run_child(str(Path(v) / "bin" / "python"), venv_env())) for v in args.venv]
    runs += [
        (release, lambda r=release: run_child(sys.executable, child_env(environment(r, envs))))
        for release in args.releases
    ]
    for label, go in runs:
        t0 = time.perf_counter()
        try:
            rows = go()
        except RuntimeError as exc:
            print(f"{label}: left out: {exc}", flush=True)
            continue
        if rows:
            results[rows[0]["release"]] = rows
            print(
                f"transformers {rows[0]['release']}: {len(rows)} reports in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    if not results:
        print("no release was run", file=sys.stderr)
        return 1
    print()
    print(markdown(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--releases", nargs="*", default=None, help="releases to install and run (pip --target)")
    p.add_argument("--venv", action="append", default=[], help="a virtual environment to run in (repeatable)")
    p.add_argument("--envs", default=None, help="where release environments go (default: OUT/envs)")
    p.add_argument("--out", default="results/scan_releases")
    p.add_argument("--scan", action="store_true", help="run kvfast scan per release instead (the options below)")
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--bugs", nargs="+", default=["none"], help="injected bugs (default: none, clean runs only)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child()
        return 0
    if args.releases is None:
        args.releases = [] if args.venv else list(DEFAULT_RELEASES)
    return scan_main(args) if args.scan else scenarios_main(args)


def scan_main(args) -> int:
    envs = Path(args.envs or Path(args.out) / "envs").absolute()
    envs.mkdir(parents=True, exist_ok=True)
    from kvfast.sweep.store import load

    parts = []
    for release in args.releases:
        try:
            parts.append(load(scan_release(release, args, envs)))
        except RuntimeError as exc:
            print(f"transformers {release}: left out: {exc}", flush=True)
    if not parts:
        print("no release was scanned", file=sys.stderr)
        return 1
    merged = pd.concat(parts, ignore_index=True)
    merged.to_parquet(Path(args.out) / "merged.parquet", index=False)
    table = by_release(merged)
    with pd.option_context("display.width", 250, "display.max_rows", 500, "display.max_columns", 30):
        print(f"\nworst clean verdict per release ({len(merged):,} runs; {Path(args.out) / 'merged.parquet'}):")
        print(table.to_string(index=False))
        print("\ncells whose verdict changes between releases:")
        print(changes(table).to_string(index=False) if len(changes(table)) else "(none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
