"""A results directory: a manifest, append-only Parquet parts, a lock.

Layout of ``DIR``:

- ``_sweep.json`` -- the manifest (grid spec and hash, study name/version/schema,
  library versions, machine, history of sweeps). Its name starts with ``_`` so
  that Parquet readers (``pd.read_parquet(DIR)``) skip it.
- ``part-NNNNNNNN-XXXXXXXX.parquet`` -- parts, several runs each, numbered in
  write order. Each is written to a hidden ``.part-*.tmp`` name and renamed
  into place when complete, so a reader never sees a half-written part. Every page
  carries a checksum (Parquet's CRC-32), verified on every read (:meth:`ResultsDir.read_part`):
  bytes changed on disk are an error naming the part, never other numbers.
- ``.lock`` -- held (``flock``) by the sweep writing here; released by the OS
  when that process ends, however it ends.

A run stored twice (a retried error, say) is resolved by :func:`load`: the row
in the highest-numbered part wins. At the end of a sweep the parts are
compacted: into one part (latest row per run, sorted by run id) up to
:data:`COMPACT_ROWS` rows; above that, small parts are merged, in write order,
into parts of about :data:`PART_ROWS` rows (reading everything at once would
need memory that grows with the grid).

Sizes: a part holds up to :data:`PART_ROWS` (1,048,576) rows in row groups of
:data:`ROW_GROUP_ROWS` (131,072). A 10^6-row sweep is one file of 8 row groups,
a 10^7-row one about ten files: few enough files that listing and opening them
costs nothing next to reading them, row groups large enough that per-group
overhead is small and small enough that pyarrow, DuckDB and Polars read a file
with several threads and skip groups by their min/max statistics (a compacted
part is sorted by ``run_id``, so a lookup by id reads one group).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvfast.validation import one_line, shorten

if TYPE_CHECKING:
    from kvfast.sweep.study import Study


MANIFEST = "_sweep.json"
LOCK = ".lock"
WARMUP = ".warmup"
TIMEOUTS = ".timeouts"  # ids of runs whose worker killed itself at the time limit
FORMAT = "kvfast-results-1"
PART_RE = re.compile(r"^part-(\d{8})-([0-9a-f]{8})\.parquet$")
STATUSES = ("ok", "error", "crashed", "timeout")
REQUIRED = ("format", "study", "study_version", "schema")  # manifest keys every command relies on
QUARANTINE = "_quarantine"
PART_ROWS = 1 << 20
ROW_GROUP_ROWS = 1 << 17
COMPACT_ROWS = 2 * PART_ROWS
BOOKKEEPING: dict[str, pa.DataType] = {
    "status": pa.string(),
    "error": pa.string(),
    "wall_s": pa.float64(),
}


class StorageError(Exception):
    """Results could not be written (disk full, quota, read-only): one line saying what is stored and what to do."""


def schema_for(study: Study) -> pa.Schema:
    """The explicit Arrow schema of a study's results.

    ``run_id``, then the config columns, then the result columns, then
    ``status``, ``error``, ``wall_s``. Result columns are null in error and
    crash rows.
    """
    names = ["run_id", *study.config_fields, *study.result_fields, *BOOKKEEPING]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"study {study.name!r}: column {dupes[0]!r} appears twice in its schema")
    fields = [pa.field("run_id", pa.string(), nullable=False)]
    columns = (study.config_fields, study.result_fields, BOOKKEEPING)
    fields += [pa.field(n, t) for part in columns for n, t in part.items()]
    meta = {"kvfast.study": study.name, "kvfast.study_version": study.version}
    return pa.schema(fields, metadata=meta)


def schema_text(schema: pa.Schema) -> list[list[str]]:
    """``[[name, type], ...]``: how the manifest records a schema."""
    return [[f.name, str(f.type)] for f in schema]


def versions() -> dict[str, str]:
    """Versions of kvfast and the libraries that make its numbers."""
    import importlib

    from kvfast._version import __version__

    out = {"kvfast": __version__, "python": platform.python_version()}
    out.update({m: importlib.import_module(m).__version__ for m in ("numpy", "numba", "pyarrow", "pandas", "joblib")})
    out.update({m: sys.modules[m].__version__ for m in ("dask", "distributed") if m in sys.modules})  # if in use
    return out


def machine() -> dict:
    """The machine, in a few words (no host name)."""
    return {**{key: getattr(platform, key)() for key in ("system", "release", "machine", "processor")},
            "cpu_count": os.cpu_count()}  # fmt: skip


def list_parts(path: str | os.PathLike) -> list[Path]:
    """The complete parts of a results directory, in write order (oldest first)."""
    found = sorted((int(m.group(1)), p.name, p) for p in Path(path).iterdir() if (m := PART_RE.match(p.name)))
    return [p for *_, p in found]


class ResultsDir:
    """One results directory (see the module docstring for its layout)."""

    def __init__(self, path: str | os.PathLike, option: str = "DIR") -> None:
        """``option``: how the command line names the path (``DIR``, ``--out``), for the refusals below.

        Refused (``ValueError``, one line naming ``option``): a name over 255 bytes or a path over 4,000 (the
        file system's limits), and a path that is not valid UTF-8 (the file system may take it; pyarrow, which
        reads and writes the parts, cannot)."""
        self.path = Path(path)
        self.manifest_path = self.path / MANIFEST
        try:
            str(self.path).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{option}: {os.fsencode(self.path)!r} is not allowed (not valid UTF-8: pyarrow, which writes and "
                "reads the results, takes UTF-8 paths only); allowed: a path in UTF-8"
            ) from None
        longest = max((len(os.fsencode(part)) for part in self.path.parts), default=0)
        if longest > 255 or len(os.fsencode(self.path)) > 4000:
            raise ValueError(
                f"{option}: {str(self.path)[:60]!r}... is not allowed ({longest} bytes in one name); "
                "allowed: names of at most 255 bytes, paths of at most 4,000"
            )
        self.part_metadata: dict[str, str] = {}  # written into every part's schema metadata (for `kvfast repair`)

    # -- reading -------------------------------------------------------------------------

    def manifest(self) -> dict | None:
        """The manifest, or ``None`` if there is none (and no part either).

        ``ValueError`` (one line naming the file and the remedy) if it cannot be read,
        is not JSON, not a JSON object, not kvfast's format or lacks a key, and if it
        is missing while parts are stored.
        """
        path = self.manifest_path
        if not path.exists():
            if self.path.is_dir() and self.parts():
                raise ValueError(f"{path}: missing while results are stored; {self.remedy()}")
            return None
        try:
            data = json.loads(path.read_bytes())
        except OSError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.strerror}); {self.remedy()}") from None
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({str(exc).splitlines()[0]}); {self.remedy()}") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: a JSON {type(data).__name__}, not a kvfast manifest (an object); {self.remedy()}"
            )
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, not {FORMAT!r}; {self.remedy()}")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ValueError(f"{path}: key {missing[0]!r} is missing; {self.remedy()}")
        if not isinstance(data.get("history", []), list):
            raise ValueError(f"{path}: key 'history' is not a list; {self.remedy()}")
        return data

    def remedy(self) -> str:
        """The one-line way back for a broken results directory."""
        return f"run `kvfast repair {self.path}` to rebuild it from the stored parts, or use another --out"

    def read_part(self, part: Path, **kwargs) -> pa.Table:
        """One part (``pq.read_table`` arguments), the checksum of every page it reads verified; ``ValueError``
        naming it and the remedy if it is unreadable or damaged (a page whose bytes changed after it was written).
        Parts written before kvfast wrote checksums have none: they read as before, unverified."""
        try:
            return pq.read_table(part, page_checksum_verification=True, **kwargs)
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise ValueError(
                f"{part}: not a readable Parquet part ({_why(exc)}); "
                f"run `kvfast repair {self.path}` to move it aside (its runs run again on the next `kvfast run`)"
            ) from None

    def require_writable(self, study: Study, fresh: bool = False) -> None:
        """Refuse (``ValueError``) a directory that a sweep of ``study`` may not write into.

        Refused: a file; an unwritable directory; a non-empty directory without a
        kvfast manifest (foreign); results of another study, study version or
        schema (unless ``fresh``). Reads only; writes nothing.
        """
        p = self.path
        if p.exists() and not p.is_dir():
            raise ValueError(f"--out: {str(p)!r} is not a directory")
        existing = p if p.exists() else next((a for a in p.parents if a.exists()), Path("."))
        if not existing.is_dir():
            raise ValueError(f"--out: {str(p)!r} is not writable ({str(existing)!r} is not a directory)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"--out: {str(p)!r} is not writable (no write permission on {str(existing)!r})")
        if not p.exists():
            return
        try:
            manifest = self.manifest()
        except ValueError:
            if fresh:  # a broken kvfast directory: --fresh replaces it, as asked
                return
            raise
        if manifest is None:
            foreign = [c.name for c in p.iterdir() if c.name not in (LOCK, WARMUP, TIMEOUTS, QUARANTINE)]
            if foreign:
                raise ValueError(
                    f"--out: {str(p)!r} is not a kvfast results directory (it holds {foreign[0]!r} and no "
                    f"{MANIFEST}); allowed: a new or empty directory, or one a sweep wrote"
                )
        elif not fresh and (reason := self.mismatch(study, manifest)):
            raise ValueError(f"--out: {str(p)!r} {reason}; use another --out, or --fresh to replace them")

    def mismatch(self, study: Study, manifest: dict | None = None) -> str | None:
        """Why stored results cannot be extended by ``study`` (another study, version, schema), or ``None``."""
        manifest = manifest if manifest is not None else self.manifest()
        if manifest is None:
            return None
        if manifest.get("study") != study.name:
            return f"holds results of study {manifest.get('study')!r}, not {study.name!r}"
        if manifest.get("study_version") != study.version:
            return (
                f"holds results of {study.name} version {manifest.get('study_version')!r}; "
                f"this kvfast has version {study.version!r}"
            )
        if manifest.get("schema") != schema_text(schema_for(study)):
            return f"holds results with another schema than study {study.name!r} has now"
        return None

    def parts(self) -> list[Path]:
        """Complete parts, oldest first."""
        return list_parts(self.path) if self.path.is_dir() else []

    def stored_index(self) -> StoredIndex:
        """The latest stored status of every run, as sorted NumPy arrays (read from the Parquet columns)."""
        parts = self.parts()
        if not parts:
            return StoredIndex.build(np.empty(0, "S32"), np.empty(0, np.int8))
        # every column is read, to verify its pages: a damaged result is found here, before a run is skipped
        table = _latest(pa.concat_tables([self.read_part(p).select(["run_id", "status"]) for p in parts]))
        ids = _fixed_ids(table.column("run_id"))
        codes = pc.index_in(table.column("status"), value_set=pa.array(STATUSES)).fill_null(STATUSES.index("crashed"))
        return StoredIndex.build(ids, codes.to_numpy().astype(np.int8))

    # -- writing (call these only while holding the lock) --------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's lock (creating the directory); ``ValueError`` if another sweep holds it."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"--out: {str(self.path)!r} is not writable ({exc.strerror})") from None
        try:
            _lock(fd)
        except OSError:
            try:
                other = os.read(fd, 32).decode().strip() or "?"
            finally:
                os.close(fd)
            raise ValueError(
                f"--out: {str(self.path)!r} is in use by another sweep (pid {other}); "
                "wait for it to finish or use another --out"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            yield
        finally:
            _unlock(fd)
            os.close(fd)

    def clear(self) -> None:
        """Delete stored parts and the manifest (``--fresh``; temporaries are :meth:`remove_temporaries`' to delete);
        other files are kept."""
        for part in self.parts():
            part.unlink()
        if self.manifest_path.is_dir() and not self.manifest_path.is_symlink():
            shutil.rmtree(self.manifest_path)
        self.manifest_path.unlink(missing_ok=True)

    def remove_temporaries(self) -> None:
        """Delete hidden temporaries left by a killed writer, and stale timeout markers (call only while
        holding the lock)."""
        for p in self.path.iterdir():
            if p.name.startswith((".part-", f".{MANIFEST}.")) and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)
        for p in (self.path / TIMEOUTS).glob("*"):
            p.unlink(missing_ok=True)

    def write_part(self, table: pa.Table | list[pa.Table]) -> Path:
        """Write one part (a table, or tables of one schema): a hidden temporary name, then an atomic rename."""
        # one table (zero-copy): row groups of ROW_GROUP_ROWS rows, not one per buffered chunk (each group and
        # each write_table call has a fixed cost: a 216-run sweep's 4 chunks took twice the time of one table)
        table = pa.concat_tables(table if isinstance(table, list) else [table])
        if self.part_metadata:
            extra = {k.encode(): v.encode() for k, v in self.part_metadata.items()}
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **extra})
        seq = max((int(m.group(1)) for p in self.path.iterdir() if (m := PART_RE.match(p.name))), default=0) + 1
        name = f"part-{seq:08d}-{secrets.token_hex(4)}.parquet"
        tmp = self.path / f".{name}.tmp"
        try:
            pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, write_page_checksum=True)
        except BaseException:  # an interrupt mid-write leaves no temporary behind
            tmp.unlink(missing_ok=True)
            raise
        final = self.path / name
        os.replace(tmp, final)
        return final

    def compact(self, schema: pa.Schema) -> None:
        """Few parts from many. Safe to interrupt (a part is deleted only once its rows are in a newer one).

        Up to :data:`COMPACT_ROWS` rows in all: one part, the latest row per run, sorted
        by run id. Above: parts smaller than :data:`PART_ROWS` are merged in write order
        into parts of about that size (a run stored twice keeps both rows; the later
        part's wins in :func:`load`).
        """
        parts = self.parts()
        if len(parts) <= 1:
            return
        rows = [pq.ParquetFile(p).metadata.num_rows for p in parts]
        if sum(rows) <= COMPACT_ROWS:
            self._merge(parts, schema, latest=True)
            return
        # only parts newer than every big one: merging never reorders rows
        start = max((i + 1 for i, n in enumerate(rows) if n >= PART_ROWS), default=0)
        group: list[Path] = []
        count = 0
        for part, n in zip(parts[start:], rows[start:], strict=True):
            group.append(part)
            count += n
            if count >= PART_ROWS:
                self._merge(group, schema)
                group, count = [], 0
        if len(group) > 1:
            self._merge(group, schema)

    def _merge(self, group: list[Path], schema: pa.Schema, latest: bool = False) -> None:
        """One part of ``group``'s rows (``latest``: the latest row per run, sorted by run id), then ``group`` gone."""
        self.write_part(
            read_parts(group, schema, self) if latest else [self.read_part(p, schema=schema) for p in group]
        )
        for p in group:
            p.unlink()

    def write_manifest(self, manifest: dict) -> None:
        tmp = self.path / f".{MANIFEST}.{secrets.token_hex(4)}.tmp"  # written whole, then renamed into place
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.manifest_path)


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}  # a refused write: disk full...


def utc_now() -> str:
    """Now, as the manifest writes times (``2026-12-07T12:00:00Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _manifest(study: str, version: str | None, schema: pa.Schema, made_by: dict, **fields) -> dict:
    """A manifest of ``study``'s results in this ``schema`` (``made_by``: the library versions), written now on this
    machine; ``fields`` override."""
    now = utc_now()
    base = {"format": FORMAT, "study": study, "study_version": version, "schema": schema_text(schema), "created": now,
            "updated": now, "versions": made_by, "machine": machine(), "grid": None, "grid_name": None,
            "grid_hash": None, "grid_runs": None, "history": []}  # fmt: skip
    return {**base, **fields}


def new_manifest(study: Study, old: dict | None) -> dict:
    """A manifest for ``study`` keeping ``old``'s creation time and history (one entry per sweep, with the
    versions it ran under)."""
    old = old or {}
    fields = {"created": old["created"]} if "created" in old else {}
    history = list(old.get("history", []))
    return _manifest(study.name, study.version, schema_for(study), versions(), history=history, **fields)


class StoredIndex(NamedTuple):
    """Stored runs: each run id (``S32``: its 32 hex digits, the whole id), sorted, and its status ``codes``
    (index into :data:`STATUSES`)."""

    ids: np.ndarray
    codes: np.ndarray

    @classmethod
    def build(cls, ids: np.ndarray, codes: np.ndarray) -> StoredIndex:
        order = np.argsort(ids, kind="stable")  # (stored ids come sorted already: a cheap pass)
        return cls(ids[order], codes[order])

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, run_ids: list[str]) -> np.ndarray:
        """The status code of each of ``run_ids``, -1 where none is stored (exact: the whole id compared)."""
        if not len(self.ids):
            return np.full(len(run_ids), -1, np.int8)
        needles = np.array(run_ids, dtype="S32")
        at = np.searchsorted(self.ids, needles).clip(max=len(self.ids) - 1)
        return np.where(self.ids[at] == needles, self.codes[at], -1).astype(np.int8)

    def ids_with(self, code: int) -> set[str]:
        """The run ids (hex) stored with status ``code``."""
        return {i.decode() for i in self.ids[self.codes == code].tolist()}


def _why(exc: BaseException) -> str:
    """Why pyarrow could not read a part, in a few words (its first line, shortened)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]


def _fixed_ids(column: pa.ChunkedArray) -> np.ndarray:
    """A column of 32-character run ids as a NumPy ``S32`` array (Arrow's fixed-width buffer, no Python strings)."""
    if not len(column):
        return np.empty(0, "S32")
    try:
        fixed = pc.cast(column, pa.binary(32)).combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # ids of other lengths (not kvfast's)
        fixed = None
    if fixed is None or fixed.null_count:  # not kvfast's ids: the slow way
        return np.array(column.to_pylist(), dtype="S32")
    return np.frombuffer(fixed.buffers()[1], "S32", count=len(fixed), offset=fixed.offset * 32)


def _latest(table: pa.Table) -> pa.Table:
    """The latest row per run of ``table`` (rows in write order), sorted by run id: ``table`` itself when its ids
    are strictly increasing already (a compacted part)."""
    ids = _fixed_ids(table.column("run_id"))
    if (ids[1:] > ids[:-1]).all():
        return table
    n = table.num_rows
    order = pa.table({"run_id": table.column("run_id"), "_i": pa.array(np.arange(n, dtype=np.int64))})
    last = order.group_by("run_id", use_threads=False).aggregate([("_i", "max")]).sort_by("run_id")
    return table.take(last.column("_i_max"))


def read_parts(parts: list[Path], schema: pa.Schema | None = None, store: ResultsDir | None = None) -> pa.Table:
    """The latest row per run over ``parts`` (oldest first), sorted by run id."""
    store = store or ResultsDir(parts[0].parent)
    tables = [store.read_part(p, schema=schema) for p in parts]
    # every part's columns the results' own (the manifest's, or else the first part's): a foreign Parquet file
    # named like a part, found by ``kvfast.load``, is named
    try:
        columns = (store.manifest() or {}).get("schema")
    except ValueError:  # no manifest (one Parquet file loaded on its own): the first part decides
        columns = None
    expected = [name for name, _ in columns] if isinstance(columns, list) else tables[0].schema.names
    if "run_id" not in expected:
        raise ValueError(f"{parts[0]}: not kvfast results (no run_id column); allowed: a kvfast results directory")
    for table, part in zip(tables, parts, strict=True):
        if table.schema.names != expected:
            missing = [c for c in expected if c not in table.schema.names]
            raise ValueError(
                f"{part}: not a part of these results (its columns {shorten(', '.join(table.schema.names), 120)}; "
                f"missing {shorten(', '.join(missing), 120) or 'none'}); move it out of {store.path}"
            )
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as exc:
        raise ValueError(
            f"{store.path}: its parts do not fit together ({one_line(exc)[:160]}); a file that is not a part of "
            "these results lies among them: move it out of the directory"
        ) from None
    return _latest(table)


def load(path: str | os.PathLike) -> pd.DataFrame:
    """A results directory (or one Parquet file) as a DataFrame: one row per run, sorted by ``run_id``.

    A run stored twice gives its latest row. Columns: see ``docs/sweep.md``.
    Integer columns with nulls (error rows) come back as float64, exactly as
    ``pd.read_parquet`` gives them. ``ValueError`` if ``path`` holds no results.
    """
    p = Path(path)
    if p.is_file():
        return read_parts([p]).to_pandas()
    if not p.is_dir():
        raise ValueError(f"{str(p)!r}: no such results directory")
    if not list_parts(p):  # no runs stored yet: the study's columns, no rows
        from kvfast.sweep.grid import resolve_study

        manifest = ResultsDir(p).manifest() or {}
        try:  # the grid's own reference to its study (a name, package.module:STUDY), else the study's name
            study = resolve_study(manifest.get("study_ref") or manifest.get("study"))
        except ValueError:
            raise ValueError(f"{str(p)!r}: no results (no part-*.parquet files)") from None
        return schema_for(study).empty_table().to_pandas()
    for attempt in range(49):  # a sweep compacting meanwhile deletes parts it merged: list them again
        with contextlib.suppress(FileNotFoundError):
            return read_parts(list_parts(p)).to_pandas()
        time.sleep(0.01 * (attempt + 1))
    return read_parts(list_parts(p)).to_pandas()


if sys.platform == "win32":  # pragma: no cover - not tested here
    import msvcrt

    def _lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


def repair(path: str | os.PathLike) -> str:
    """Make a broken results directory usable again; returns one line saying what was done.

    Unreadable parts (truncated, corrupt, or damaged: a page whose checksum differs) are moved
    into ``DIR/_quarantine/`` (their runs are then not stored: the next sweep runs them). A missing or broken
    manifest is rebuilt from the metadata each part carries (study, version,
    schema, grid, versions; the broken one is moved into the quarantine folder
    too). ``ValueError`` if ``path`` is not a directory, is in use by a sweep,
    or its parts disagree about their study.
    """
    store = ResultsDir(path)
    if not store.path.is_dir():
        raise ValueError(f"DIR: {str(store.path)!r} is not a directory")
    done: list[str] = []

    def quarantine(path: Path, name: str) -> None:
        (store.path / QUARANTINE).mkdir(exist_ok=True)
        os.replace(path, store.path / QUARANTINE / name)

    with store.locked():
        store.remove_temporaries()
        good: list[tuple[Path, pa.Schema]] = []
        for part in store.parts():
            try:
                good.append((part, pq.read_table(part, page_checksum_verification=True).schema))
            except (OSError, pa.ArrowException) as exc:  # unreadable, or damaged (a page checksum that differs)
                quarantine(part, part.name)
                done.append(f"moved unreadable {part.name} into {QUARANTINE}/ ({_why(exc)})")
        try:
            manifest = store.manifest()
            broken = None
        except ValueError as exc:
            manifest, broken = None, str(exc)
        if manifest is not None:
            studies = {(s.metadata or {}).get(b"kvfast.study", b"").decode() for _, s in good}
            if studies - {manifest["study"]}:
                done.append(
                    f"parts of other studies ({', '.join(sorted(studies - {manifest['study']}))}) left as they are"
                )
        elif good or store.manifest_path.exists():
            if store.manifest_path.exists():
                quarantine(store.manifest_path, f"{MANIFEST}.broken-{secrets.token_hex(4)}")
            if good:
                store.write_manifest(_manifest_from_parts(store, good))
                done.append(
                    f"rebuilt {MANIFEST} from {len(good):,} parts" + (f" ({broken.split(';')[0]})" if broken else "")
                )
            else:
                done.append(
                    f"moved the broken {MANIFEST} into {QUARANTINE}/ (no readable part: the directory starts afresh)"
                )
    if not done:
        return f"{store.path}: nothing to repair ({len(store.parts()):,} readable parts, manifest ok)"
    return f"{store.path}: " + "; ".join(done) + "; run the sweep again to run the missing runs"


def _manifest_from_parts(store: ResultsDir, parts: list[tuple[Path, pa.Schema]]) -> dict:
    metas = [{k.decode(): v.decode() for k, v in (s.metadata or {}).items()} for _, s in parts]
    newest = metas[-1]
    studies = {m.get("kvfast.study") for m in metas}
    if len(studies) != 1 or None in studies:
        raise ValueError(
            f"{store.path}: its parts name studies {sorted(map(str, studies))}; cannot rebuild {MANIFEST}: move the "
            "parts of the other study away, or use another --out"
        )
    grid, old_versions = None, {}
    with contextlib.suppress(ValueError):
        grid = json.loads(newest.get("kvfast.grid", "null"))
    with contextlib.suppress(ValueError):
        old_versions = json.loads(newest.get("kvfast.versions", "{}"))
    return _manifest(
        newest["kvfast.study"], newest.get("kvfast.study_version"), parts[-1][1].remove_metadata(),
        old_versions if isinstance(old_versions, dict) else {}, grid=grid,
        grid_name=newest.get("kvfast.grid_name"), study_ref=newest.get("kvfast.study_ref", newest["kvfast.study"]),
        history=[{"repaired": utc_now(), "from_parts": len(parts)}],
    )  # fmt: skip
