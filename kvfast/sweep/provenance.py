"""Where the code of a sweep came from: kvfast's and the study module's git commit and dirty flag, and the sha256 of
the study module's file. The manifest records it for the last sweep and in each sweep's history entry.

A file's commit is that of the git repository that tracks it (``git`` run with a short timeout); ``None`` when git
is absent, slow or fails, or the file is not tracked (not in a repository, untracked, or ignored as a virtual
environment inside a project is): provenance never fails a sweep. ``dirty``: tracked files of that repository
differ from its commit (as ``git describe --dirty``: untracked files do not count).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfast.sweep.grid import Grid

GIT_TIMEOUT_S = 5.0
CHANGES = (("kvfast", "commit"), ("study", "sha256"), ("study", "commit"))  # a resume warns when one differs


def provenance(grid: Grid) -> dict:
    """``{"kvfast": {"commit", "dirty"}, "study": {"module", "sha256", "commit", "dirty"}}`` for a sweep of ``grid``.

    The study's module: the one its grid names (``study = "package.module:STUDY"``), else the one that defines its
    run function. Unknown values are ``None``."""
    ref = grid.study_ref
    name = ref.split(":")[0] if isinstance(ref, str) and ":" in ref else getattr(grid.study.run, "__module__", None)
    file = getattr(sys.modules.get(name or ""), "__file__", None)
    study = {"module": name, "sha256": None, "commit": None, "dirty": None}
    if file:
        try:
            study["sha256"] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        except OSError:
            pass
        study.update(git_state(Path(file)))
    return {"kvfast": git_state(Path(__file__).resolve().parents[1] / "__init__.py"), "study": study}


def git_state(path: Path) -> dict:
    """``{"commit": HEAD's hash, "dirty": bool}`` of the git repository tracking the file ``path``; ``None`` values
    when none does, or git cannot say."""
    folder = path.parent
    if _git(folder, "ls-files", "--error-unmatch", "--", path.name) is None:
        return {"commit": None, "dirty": None}
    commit = _git(folder, "rev-parse", "--verify", "HEAD")
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip())}


def _git(folder: Path, *args: str) -> str | None:
    """``git`` 's output in ``folder``, or ``None`` if it is absent, fails or takes longer than GIT_TIMEOUT_S."""
    try:
        proc = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(folder), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def changes(was: dict | None, now: dict) -> list[str]:
    """What differs between two sweeps' provenance, in words (``kvfast commit 1a2b3c4d5e6f -> 0f9e8d7c6b5a``), where
    both are known."""
    out = []
    for part, key in CHANGES:
        before, after = _get(was, part, key), _get(now, part, key)
        if before and after and before != after:
            out.append(f"{'kvfast' if part == 'kvfast' else 'study module'} {key} {str(before)[:12]} -> {after[:12]}")
    return out


def lines(record: dict | None) -> list[str]:
    """How ``kvfast show`` prints a manifest's provenance (nothing for a manifest written before it was kept)."""
    if not isinstance(record, dict):
        return []

    def git(part: str) -> str:
        commit = _get(record, part, "commit")
        if not commit:
            return "not in a git repository"
        return f"git {commit}, dirty: {str(_get(record, part, 'dirty')).lower()}"

    sha = _get(record, "study", "sha256") or "unknown"
    return [
        f"kvfast code: {git('kvfast')}",
        f"study module {_get(record, 'study', 'module')}: sha256 {sha}; {git('study')}",
    ]


def _get(record: dict | None, part: str, key: str):
    value = record.get(part) if isinstance(record, dict) else None
    return value.get(key) if isinstance(value, dict) else None
