"""Issue 46: the manifest records the git commit and dirty flag of kvfast's code and of the study's module, and the
sha256 of the module's file; ``kvfast show`` prints them; a resume by other code warns and is never refused; outside
a repository, with the module untracked, or with no git at all, they are ``None`` and the sweep runs as before.
Real ``kvfast run`` and ``kvfast show`` processes, a real git repository."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from shared import ROOT, environment
from shared import kvfast as run_kvfast

from kvfast.sweep import MANIFEST

STUDY = """\
import pyarrow as pa
from kvfast.sweep import Study

STUDY = Study(
    name="prov", version="1", description="provenance test", run=lambda config: {"y": config["x"] * 1.5},
    config_fields={"x": pa.int64()}, result_fields={"y": pa.float64()}, validate_config=lambda config: None,
    summarize=lambda df: df[["x", "y"]],
)
"""

pytestmark = [pytest.mark.skipif(shutil.which("git") is None, reason="git"), pytest.mark.subprocess]


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True).stdout.strip()


def kvfast(folder: Path, *argv: str, path: str | None = None) -> subprocess.CompletedProcess:
    """``kvfast ARGV`` with ``folder`` as the working directory (where ``study = "mystudy:STUDY"`` is imported from);
    ``path``: another ``PATH``. Exit code 0 asserted."""
    env = environment(GIT_CEILING_DIRECTORIES=str(folder.parent), **({} if path is None else {"PATH": path}))
    proc = run_kvfast(*argv, cwd=folder, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def sweep(folder: Path, xs: list[int], out: Path, path: str | None = None, module: str = "mystudy") -> tuple[dict, str]:
    """Run the grid of ``xs`` of ``module``'s study into ``out``; ``(the manifest's provenance, stderr)``."""
    (folder / "g.toml").write_text(f'study = "{module}:STUDY"\n[axes]\nx = {xs}\n')
    proc = kvfast(folder, "run", "g.toml", "--out", str(out), "--jobs", "1", "--quiet", path=path)
    return json.loads((out / MANIFEST).read_text())["provenance"], proc.stderr


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kvfast_code() -> dict:
    """kvfast's own commit and dirty flag, as git says, where this kvfast is a git checkout."""
    if subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", "kvfast/__init__.py"],
                      capture_output=True).returncode:  # fmt: skip
        return {"commit": None, "dirty": None}
    return {"commit": git(ROOT, "rev-parse", "HEAD"), "dirty": git(ROOT, "status", "--porcelain", "-uno") != ""}


def test_provenance_names_the_commits_and_the_study_file_and_never_refuses_a_resume(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    module = repo / "mystudy.py"
    module.write_text(STUDY)
    git(repo, "init", "-q")
    git(repo, "add", "mystudy.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "study")
    first = git(repo, "rev-parse", "HEAD")
    out = tmp_path / "out"
    code, err = sweep(repo, [0, 1, 2], out)
    assert code["kvfast"] == kvfast_code()
    assert code["study"] == {"module": "mystudy", "sha256": sha256(module), "commit": first, "dirty": False}
    shown = kvfast(repo, "show", str(out)).stdout.splitlines()
    assert f"study module mystudy: sha256 {sha256(module)}; git {first}, dirty: false" in shown, shown
    rows = pd.read_parquet(out).drop(columns="wall_s").sort_values("run_id").reset_index(drop=True)

    # edited and not committed: dirty, another sha256; the resume runs, warns, and keeps both sweeps' provenance
    old_sha = sha256(module)
    module.write_text(STUDY + "# edited\n")
    code, err = sweep(repo, [0, 1, 2, 3], out)
    assert code["study"] == {"module": "mystudy", "sha256": sha256(module), "commit": first, "dirty": True}
    assert f"study module sha256 {old_sha[:12]} -> {sha256(module)[:12]}" in err and err.startswith("warning: "), err
    assert f"git {first}, dirty: true" in kvfast(repo, "show", str(out)).stdout

    # committed: the commit moved, clean again; warned, not refused
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "edit")
    second = git(repo, "rev-parse", "HEAD")
    code, err = sweep(repo, [0, 1, 2, 3, 4], out)
    assert code["study"] == {"module": "mystudy", "sha256": sha256(module), "commit": second, "dirty": False}
    assert f"study module commit {first[:12]} -> {second[:12]}" in err and "sha256" not in err, err
    history = json.loads((out / MANIFEST).read_text())["history"]
    assert [h["provenance"]["study"]["commit"] for h in history] == [first, first, second]
    assert [h["provenance"]["study"]["dirty"] for h in history] == [False, True, False]
    # a control: a resume by the same code says nothing
    assert sweep(repo, [0, 1, 2, 3, 4], out)[1] == ""

    # the stored numbers are those of a sweep outside any repository, without git at all
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "mystudy.py").write_text(STUDY)
    code, _ = sweep(plain, [0, 1, 2], tmp_path / "o-plain")
    assert code["study"] == {"module": "mystudy", "sha256": old_sha, "commit": None, "dirty": None}
    assert (
        "study module mystudy: sha256 " + old_sha + "; not in a git repository"
        in kvfast(plain, "show", str(tmp_path / "o-plain")).stdout
    )
    no_git = tmp_path / "bin"  # a PATH without git
    no_git.mkdir()
    code, _ = sweep(repo, [0, 1, 2], tmp_path / "o-nogit", path=str(no_git))
    assert code == {
        "kvfast": {"commit": None, "dirty": None},
        "study": {"module": "mystudy", "sha256": sha256(module), "commit": None, "dirty": None},
    }
    for other in ("o-plain", "o-nogit"):
        again = pd.read_parquet(tmp_path / other).drop(columns="wall_s").sort_values("run_id").reset_index(drop=True)
        pd.testing.assert_frame_equal(again, rows)

    # a module in a repository but not tracked there has no commit (its code is in none)
    (repo / "other.py").write_text(STUDY)
    code, _ = sweep(repo, [0], tmp_path / "o-untracked", module="other")
    assert code["study"] == {"module": "other", "sha256": old_sha, "commit": None, "dirty": None}
