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
:func:`own_cache_dir` and :func:`writable` find out, before any kernel is compiled, whether the cache directory
can be used: kvfast's own directory only if this user owns every level kvfast makes and nobody else can write
them (Numba loads its index files with :mod:`pickle`: whoever can write there can run code as this user), the
user's ``NUMBA_CACHE_DIR`` if it can be written. Where it cannot, or where the entries cannot be keyed, one line
on stderr says so and kvfast's kernels are compiled afresh in each process, not cached (``JIT_OPTIONS``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path

_reported: set[str] = set()


def _report_damage(path: str, exc: BaseException) -> None:
    if path in _reported:
        return
    _reported.add(path)
    directory = os.path.dirname(os.path.dirname(path)) or os.path.dirname(path)
    _note(
        f"the Numba cache file {path} is damaged ({type(exc).__name__}); compiling that kernel "
        f"again and rewriting it (to clear the whole cache, delete {directory})"
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
    stamp of their file (once per process; a later call's ``key`` is ignored); False, with one line on stderr,
    where it cannot: the caller must then not cache them.

    Numba's one public way to choose its locators is ``NUMBA_CACHE_LOCATOR_CLASSES``, and where it is set
    Numba uses the locators it names and never the keyed one below. kvfast does not rewrite it: every child
    process inherits the variable, and one without kvfast (another environment, another tool) would fail to
    import kvfast's locator on its first cached function; setting Numba's configuration alone is undone when
    Numba reloads it from the environment."""
    from numba.core import config

    config.reload_config()  # as Numba's compiler does: the variable as it is now
    locators = getattr(config, "CACHE_LOCATOR_CLASSES", None)  # read by Numba from 0.61 on (0.60 has no such option)
    if locators:
        _note(
            f"NUMBA_CACHE_LOCATOR_CLASSES is set ({locators}): kvfast cannot stamp its kernels' "
            "cache entries with the hash of its sources under those locators, so its kernels are compiled afresh "
            "in every process, not cached (unset it to cache them)"
        )
        return False
    from numba.core import caching

    # public from Numba 0.61; 0.60 (the lowest kvfast declares) names the same class with an underscore
    provided = getattr(caching, "UserProvidedCacheLocator", None) or getattr(caching, "_UserProvidedCacheLocator", None)
    if provided is None:  # pragma: no cover - another Numba's internals
        _note("this Numba has no cache locators kvfast can key: its kernels are compiled afresh, not cached")
        return False
    if any(getattr(cls, "_kvfast_keyed", False) for cls in caching.CacheImpl._locator_classes):
        return True
    root = str(package.resolve()) + os.sep

    class KeyedLocator(provided):
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

    caching.CacheImpl._locator_classes = [KeyedLocator, *caching.CacheImpl._locator_classes]
    return True


def _note(line: str) -> None:
    print(f"kvfast: {line}", file=sys.stderr, flush=True)


def writable(directory: Path) -> bool:
    """Whether kernels can be cached in ``directory`` (created if missing); else one line on stderr."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        _note(
            f"the Numba cache directory {directory} cannot be written ({exc.strerror}); kvfast's kernels are "
            "compiled afresh in every process, not cached; set NUMBA_CACHE_DIR to a writable directory"
        )
        return False
    return True


def _not_private(path: Path) -> str | None:
    """Why ``path`` may not hold this user's cache (``None``: it may): Numba loads its index files with pickle,
    so whoever else can write there can run code as this user. The entry itself (``lstat``: a symbolic link is
    its maker's) and what it names must be this user's, and what it names a directory nobody else can write."""
    uid = os.getuid()
    entry, target = path.lstat(), path.stat()
    if entry.st_uid != uid or target.st_uid != uid:
        return f"it is owned by uid {entry.st_uid if entry.st_uid != uid else target.st_uid}, not this user ({uid})"
    if not stat.S_ISDIR(target.st_mode):
        return "it is not a directory"
    if target.st_mode & 0o022:
        return f"its group or others can write it (mode {stat.S_IMODE(target.st_mode):o})"
    return None


def own_cache_dir(base: Path, names: tuple[str, ...]) -> Path | None:
    """kvfast's own cache directory ``base/NAME/...``: each level of ``names`` made by this user, mode 0700, if
    missing, and each (made now or found) used only if it is this user's and nobody else can write it
    (:func:`_not_private`), the last one writable; else ``None``, with one line on stderr saying why (kvfast's
    kernels are then not cached).

    Where it cannot be used, there is no fallback directory: one under the shared temporary directory would have
    a name the next process can find, which is a name another user can create first, planted with index files;
    a private ``tempfile.mkdtemp`` per process would be compiled into once and removed, costing what no cache
    costs (every process compiles the kernels it runs), with a directory to make, check and remove besides."""
    path = base
    try:
        base.mkdir(exist_ok=True)  # ~/.cache, say: not a missing home
        for name in names:
            path = path / name
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=0o700)
            why = _not_private(path)
            if why is not None:
                _note(
                    f"not caching kernels in {path}: {why}; kvfast's kernels are compiled afresh in every "
                    f"process; remove {path} (kvfast makes it again, 0700) or set NUMBA_CACHE_DIR to a directory "
                    "of yours"
                )
                return None
    except OSError as exc:
        _note(
            f"the Numba cache directory {path} cannot be made ({exc.strerror}); kvfast's kernels are compiled "
            "afresh in every process, not cached; set NUMBA_CACHE_DIR to a writable directory"
        )
        return None
    return path if writable(path) else None
