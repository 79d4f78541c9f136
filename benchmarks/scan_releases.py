"""``kvfast scan`` over several transformers releases, merged into one dataset with a ``transformers_version`` column.

    python benchmarks/scan_releases.py --releases 4.46.3 4.52.4 4.57.6 5.24.0 --out results/scan_releases

Per release: an environment made once with ``pip install --target ENVS/transformers-X transformers==X``
(``huggingface_hub<1.0`` beside a 4.x release; the numpy and torch that pip puts there are removed, so that every
release runs on this environment's CPU torch and numpy), then ``kvfast scan`` in a child process with that folder
first on ``PYTHONPATH`` into ``OUT/X`` (resumable: a rerun runs only what is missing). The release this
environment has installed runs without a folder. The architectures are those of ``--families`` that the release
has (each release's own auto mapping). Then every release's stored runs are merged into ``OUT/merged.parquet``
and two tables are printed: the worst clean verdict per architecture, dtype and scenario in each release (a
column per release), and the cells whose verdict changes between releases (a clean ``bug`` in one release that is
``rounding`` in the next is a real bug of that release, or a fix).

A release that cannot be installed, or whose scan fails, is reported in one line and left out; the rest go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RELEASES = ("4.46.3", "4.52.4", "4.57.6", "5.0.0", "5.24.0")
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


def child_env(target: Path | None) -> dict:
    path = [str(p) for p in (target, ROOT) if p is not None]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}


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
    from kvfast.studies.scan import VERDICTS

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--releases", nargs="+", default=list(DEFAULT_RELEASES))
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--bugs", nargs="+", default=["none"], help="injected bugs (default: none, clean runs only)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="results/scan_releases")
    p.add_argument("--envs", default=None, help="where release environments go (default: OUT/envs)")
    args = p.parse_args(argv)
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
