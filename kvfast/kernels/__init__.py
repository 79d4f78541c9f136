"""Numba kernels with an explicit summation order and software-rounded precision.

Numba's on-disk cache is invalidated only when the file defining a jitted
function changes, not when a function it calls in another file changes, nor a
module constant it reads (``kvfast/model/bugs.py``). A bit-exactness tool must
never run stale machine code, so before any kernel is compiled or loaded this
package points Numba's cache at a directory keyed by a hash of every kvfast
source file that uses Numba (under ``$XDG_CACHE_HOME/kvfast/numba/`` or
``~/.cache/kvfast/numba/``). Set ``NUMBA_CACHE_DIR`` yourself to override it: the same hash is then in
every kvfast entry's freshness stamp, so an entry another kvfast version wrote there is compiled again.
Child processes (sweep workers) inherit the choice through the environment.
A damaged cache file is compiled again instead of failing the caller. kvfast's kernels are not cached at all
(:data:`CACHED`), said in one line on stderr, where the directory cannot be written, where kvfast's own
directory is not this user's alone, or where ``NUMBA_CACHE_LOCATOR_CLASSES`` is set (the hash cannot be put in
the stamp): :mod:`kvfast.kernels.cache_guard`.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from kvfast.kernels import cache_guard

_PACKAGE = Path(__file__).resolve().parents[1]


def source_key() -> str:
    """A short hash of every kvfast source file that uses Numba (plus the bug constants)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        text = path.read_bytes()
        if b"numba" in text or path.name == "bugs.py":
            digest.update(path.relative_to(_PACKAGE).as_posix().encode())
            digest.update(text)
    return digest.hexdigest()[:16]


def _choose_cache_dir(key: str) -> bool:
    """Point Numba at kvfast's cache directory (or the user's ``NUMBA_CACHE_DIR``), if it can be used; False if
    not (said on stderr: :mod:`kvfast.kernels.cache_guard`). kvfast's own directory is checked in every process,
    a child's too (it inherits it as ``NUMBA_CACHE_DIR``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user and Path(user) != base / "kvfast" / "numba" / key:
        return cache_guard.writable(Path(user))
    chosen = cache_guard.own_cache_dir(base, ("kvfast", "numba", key))
    if chosen is None:
        return False
    os.environ["NUMBA_CACHE_DIR"] = str(chosen)
    if "numba" in sys.modules:  # numba read its config already: tell it too
        sys.modules["numba"].config.CACHE_DIR = str(chosen)
    return True


_KEY = source_key()  # (about 10 ms: read once)
_CACHE_USABLE = _choose_cache_dir(_KEY)
cache_guard.install()
#: whether kvfast's kernels are cached on disk (``JIT_OPTIONS["cache"]``)
CACHED = _CACHE_USABLE and cache_guard.key_entries(_PACKAGE, _KEY)
