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
import time
from concurrent.futures import ThreadPoolExecutor
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
    files = [Path(__file__).resolve().parents[1] / "__init__.py"]
    if file:
        try:
            study["sha256"] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        except OSError:
            pass
        files.append(Path(file))
    states = git_states(files)
    if file:
        study.update(states[1])
    return {"kvfast": states[0], "study": study}


def git_states(paths: list[Path]) -> list[dict]:
    """``{"commit": HEAD's hash, "dirty": bool}`` of the git repository tracking each file of ``paths`` (``None``
    values where none does, or git cannot say), its git processes run side by side (a sweep's start waits for
    the slowest, not for their sum), one ``status`` per repository, all within :data:`GIT_TIMEOUT_S`."""
    deadline = time.monotonic() + GIT_TIMEOUT_S
    with ThreadPoolExecutor(2 * len(paths)) as pool:
        tracked = [pool.submit(_git, p.parent, deadline, "ls-files", "--error-unmatch", "--", p.name) for p in paths]
        heads = [pool.submit(_git, p.parent, deadline, "rev-parse", "--show-toplevel", "HEAD") for p in paths]
        found = {}  # a tracked file -> (its repository: the file's folder where git cannot say, HEAD)
        for path, is_tracked, head in zip(paths, tracked, heads, strict=True):
            if is_tracked.result() is not None:
                top, _, commit = (head.result() or "").partition("\n")
                found[path] = (top or str(path.parent), commit.strip() or None)
        args = ("status", "--porcelain", "--untracked-files=no")
        status = {top: pool.submit(_git, Path(top), deadline, *args) for top, _ in found.values()}
        dirty = {top: future.result() for top, future in status.items()}
    states = []
    for path in paths:
        top, commit = found.get(path, (None, None))
        states.append({"commit": commit, "dirty": None if dirty.get(top) is None else bool(dirty[top].strip())})
    return states


def _git(folder: Path, deadline: float, *args: str) -> str | None:
    """The output of ``git ARGS`` run in ``folder``; ``None`` if it cannot start, fails or still runs at
    ``deadline`` (then killed)."""
    try:
        proc = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(folder), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            timeout=max(0.0, deadline - time.monotonic()),
        )
    except (OSError, subprocess.SubprocessError):  # (TimeoutExpired is one)
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
