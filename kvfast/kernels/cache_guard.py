"""Numba's on-disk cache, made safe to trust: a damaged file is a cache miss, never the model's error.

Numba reads a cache entry with :mod:`pickle`; a damaged index (``.nbi``) or data file (``.nbc``) — a
disk that filled up, a copy cut short, two machines writing one shared directory — raises from the
first call of the kernel (``UnpicklingError``, ``UnicodeDecodeError``, ``OverflowError``, ``EOFError``).
That call is inside the model under test, so without this guard the checker blames the model and a
sweep stores every run as the model's error, again on every retry.

:func:`install` wraps the two readers of ``numba.core.caching.IndexDataCacheFile``: a file that cannot
be read back is treated as absent (the kernel is compiled again and its entry rewritten, which repairs
the cache), and one line on stderr names the file and the directory to delete.
:func:`key_entries` makes every cache entry of kvfast's own kernels depend on all of kvfast's Numba sources,
not only the file that defines the kernel: Numba's freshness stamp of a cached function is its own file's
hash, so a kernel whose file did not change but which reads a constant or calls a kernel from a changed file
would load stale machine code from a cache directory the user chose (``NUMBA_CACHE_DIR``; kvfast's default
directory is keyed by the same hash in its path). An entry written by another kvfast version is then a miss:
compiled again and rewritten.
:func:`usable_cache_dir` finds out, before any kernel is compiled, whether the cache directory can be
written, and otherwise names it and falls back to a private directory under the system's temporary
directory (Numba would otherwise compile every kernel again in every process, minutes each time).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

_reported: set[str] = set()


def _report_damage(path: str, exc: BaseException) -> None:
    if path in _reported:
        return
    _reported.add(path)
    directory = os.path.dirname(os.path.dirname(path)) or os.path.dirname(path)
    print(
        f"kvfast: the Numba cache file {path} is damaged ({type(exc).__name__}); compiling that kernel "
        f"again and rewriting it (to clear the whole cache, delete {directory})",
        file=sys.stderr,
        flush=True,
    )


def install() -> bool:
    """Wrap Numba's cache readers (once per process); False if this Numba has no such readers."""
    try:
        from numba.core.caching import IndexDataCacheFile
    except ImportError:  # pragma: no cover - a Numba without the module: nothing to guard
        return False
    if getattr(IndexDataCacheFile, "_kvfast_guarded", False):
        return True
    load_index, load_data = (
        getattr(IndexDataCacheFile, "_load_index", None),
        getattr(IndexDataCacheFile, "_load_data", None),
    )
    if load_index is None or load_data is None:  # pragma: no cover - another Numba's internals
        return False

    def guarded_load_index(self):
        try:
            return load_index(self)
        except Exception as exc:  # noqa: BLE001 - any failure to read the index back is damage
            _report_damage(self._index_path, exc)
            return {}  # absent: the kernel compiles and save() writes a fresh index over the damaged one

    def guarded_load_data(self, name):
        try:
            return load_data(self, name)
        except OSError:
            raise  # a missing data file: Numba's own load() treats it as absent
        except Exception as exc:  # noqa: BLE001
            _report_damage(self._data_path(name), exc)
            raise OSError(f"damaged cache file {name}") from exc  # load() treats OSError as absent

    IndexDataCacheFile._load_index = guarded_load_index
    IndexDataCacheFile._load_data = guarded_load_data
    IndexDataCacheFile._kvfast_guarded = True
    return True


def key_entries(package: Path, key: str) -> bool:
    """Stamp the cache entries of the functions defined under ``package`` with ``key`` besides Numba's own
    stamp of their file (once per process; a later call's ``key`` is ignored); False if this Numba has no such
    locator classes."""
    try:
        from numba.core.caching import CacheImpl, UserProvidedCacheLocator
    except ImportError:  # pragma: no cover - another Numba's internals
        return False
    if any(getattr(cls, "_kvfast_keyed", False) for cls in CacheImpl._locator_classes):
        return True
    root = str(package.resolve()) + os.sep

    class KeyedLocator(UserProvidedCacheLocator):
        """Numba's locator for a user-provided cache directory (kvfast always sets one), for kvfast's own
        files only, with ``key`` in the freshness stamp."""

        _kvfast_keyed = True

        @classmethod
        def from_function(cls, py_func, py_file):
            if not os.path.realpath(py_file).startswith(root):
                return None  # the user's own kernels: Numba's locators, as without kvfast
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return (super().get_source_stamp(), key)

    CacheImpl._locator_classes = [KeyedLocator, *CacheImpl._locator_classes]
    return True


def writable(directory: Path) -> bool:
    """Whether kernels can be cached in ``directory`` (created if missing)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError:
        return False
    return True


def usable_cache_dir(wanted: Path, fallback_key: str) -> Path:
    """``wanted`` if it can be written; else a private directory under the temporary directory, with
    one line on stderr saying so (the next start reuses it, instead of compiling for minutes again)."""
    if writable(wanted):
        return wanted
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    fallback = Path(tempfile.gettempdir()) / f"kvfast-numba-{uid}" / fallback_key
    if writable(fallback):
        print(
            f"kvfast: the Numba cache directory {wanted} cannot be written; caching kernels in {fallback} "
            "instead (set NUMBA_CACHE_DIR to a writable directory to choose)",
            file=sys.stderr,
            flush=True,
        )
        return fallback
    print(
        f"kvfast: the Numba cache directory {wanted} cannot be written, nor {fallback}; every process "
        "compiles its kernels again (minutes); set NUMBA_CACHE_DIR to a writable directory",
        file=sys.stderr,
        flush=True,
    )
    return wanted
