"""Grids: a study plus axes, read from TOML, validated before any run, expanded lazily.

The TOML form (see ``docs/sweep.md``)::

    study = "exactness"          # a registered study, or "package.module:STUDY"
    description = "..."          # optional

    [fixed]                      # one value per key, in every run
    vocab = 32

    [axes]                       # cartesian product, first axis outermost
    seed = [0, 1, 2]             # or {range = [0, 3]}: 0, 1, 2 (and {range = [START, STOP, STEP]})
    preset = ["f64", "f32", "bf16"]

    [[tied]]                     # values that vary together (zipped), crossed with the axes
    n_layer = [1, 2]
    d_model = [16, 32]

    [[union]]                    # optional sub-grids; each has its own fixed / axes / tied,
    [union.axes]                 # is crossed with the top level (its keys replace top-level
    steps = [4, 8]               # keys of the same name), and the grid is their union

Expansion order is deterministic (axes in TOML order, then tied groups, then
union entries); a config that occurs twice (same run id) is kept once, at its
first position. Every config must set exactly the study's ``config_fields``;
its values are checked by the study's ``validate_config`` and against the column
types, all before any run starts. Nothing is evaluated: ``tomllib`` only.

Planning scales with the axes, not with the runs: each axis value is coerced,
type-checked and turned into its canonical JSON piece once; the study's
``validate_config`` runs once per distinct value of each of its validation
groups (``Study.validate_groups``), not once per run; the run count is a
product of axis lengths; and runs (ids and configs) are generated on demand by
:meth:`Grid.iter_runs` / :meth:`Grid.iter_ids`, so memory does not grow with
the grid. A run id is the same text :func:`kvfast.sweep.ids.run_id` hashes,
assembled from the per-axis pieces by one ``str.format`` per run.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from kvfast.runtime import UserCodeError, call_user, load_object
from kvfast.runtime.load import entry_points_of
from kvfast.sweep.ids import MAX_DEPTH, canonical, canonical_hash
from kvfast.validation import prefixed, require_int, shown

if TYPE_CHECKING:
    from kvfast.sweep.study import Study

TOP_KEYS = ("study", "description", "fixed", "axes", "tied", "union")
SUB_KEYS = ("description", "fixed", "axes", "tied")
ENTRY_POINT_GROUP = "kvfast.studies"
DEFAULT_MAX_RUNS = 10_000_000
_OVERLAP_CHECK_MAX = 64  # union entries compared pairwise for overlap; above this, every id is checked


class GridRun(NamedTuple):
    """One run of a grid: its id and its (normalised) config."""

    run_id: str
    config: dict


class _Factor(NamedTuple):
    """One factor of a (sub-)grid: the keys it sets and its distinct rows of values.

    ``rows[i]`` are the canonical, column-coerced values of ``keys``; ``pieces[i]``
    their canonical JSON pieces (``"key":value``), in the same order.
    """

    keys: tuple[str, ...]
    rows: tuple[tuple, ...]
    pieces: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class _Entry:
    """One union entry (or the whole grid without ``[[union]]``): factors covering every config field."""

    where: str
    factors: tuple[_Factor, ...]
    base: dict  # every config field, in field order; the values of single-row factors
    varying: tuple[_Factor, ...]  # factors with more than one row, in expansion order
    template: str  # str.format template of the canonical id text; {i[k]}: piece k of varying factor i

    @property
    def size(self) -> int:
        return math.prod(len(f.rows) for f in self.varying)

    def ids(self) -> Iterator[str]:
        fmt = self.template.format
        blake = hashlib.blake2b
        for combo in itertools.product(*(f.pieces for f in self.varying)):
            yield blake(fmt(*combo).encode(), digest_size=16).hexdigest()

    def runs(self, select: Iterator[bool] | None = None, seen: set[str] | None = None) -> Iterator[GridRun]:
        """The entry's runs; with ``select``, only those whose next flag is true (no id computed for the others).

        With ``seen`` (ids of runs generated before), runs already seen are skipped and
        consume no flag; new ones are added to it.
        """
        fmt = self.template.format
        blake = hashlib.blake2b
        keys = [f.keys for f in self.varying]
        base = self.base
        pairs = [tuple(zip(f.rows, f.pieces, strict=True)) for f in self.varying]
        for combo in itertools.product(*pairs):
            rid = None
            if seen is not None:  # (a run seen before consumes no flag)
                rid = blake(fmt(*(pieces for _, pieces in combo)).encode(), digest_size=16).hexdigest()
                if rid in seen:
                    continue
                seen.add(rid)
            if select is not None and not next(select):
                continue
            rid = rid or blake(fmt(*(pieces for _, pieces in combo)).encode(), digest_size=16).hexdigest()
            config = base.copy()
            for k, (row, _) in zip(keys, combo, strict=True):
                config.update(zip(k, row, strict=True))
            yield GridRun(rid, config)


@dataclass(frozen=True)
class Grid:
    """A validated grid, expanded on demand.

    ``name``: the built-in grid's name or the TOML file's stem; ``source``: where it
    was read from; ``spec``: the parsed TOML; ``study``: the study it runs;
    ``study_ref``: how the grid named it (a registered name, ``module:ATTR`` or an
    entry point's name). ``len(grid)``: its runs (no run id twice).
    :meth:`iter_runs` / :meth:`iter_ids` generate them in expansion order;
    ``runs`` materialises them (small grids, tests).
    """

    name: str
    source: str
    spec: dict
    study: Study
    entries: tuple[_Entry, ...] = field(repr=False)
    overlapping: frozenset[int] = field(repr=False)  # entries whose runs may repeat another entry's
    size: int = 0
    study_ref: str = ""

    @property
    def spec_hash(self) -> str:
        """Hash of the canonical spec (stored in the manifest)."""
        return canonical_hash(self.spec)

    def __len__(self) -> int:
        return self.size

    def iter_ids(self) -> Iterator[str]:
        """Every run id, in expansion order, each once."""
        seen: set[str] = set()
        for i, entry in enumerate(self.entries):
            ids = entry.ids()
            if i in self.overlapping:  # each id once: the first time it is seen (set.add returns None)
                ids = (rid for rid in ids if rid not in seen and not seen.add(rid))
            yield from ids

    def iter_runs(self, select: Iterable[bool] | None = None) -> Iterator[GridRun]:
        """Every run (id and a fresh config dict), in expansion order, each once.

        ``select``: one flag per run (in the order of :meth:`iter_ids`); only runs flagged
        true are generated, and no id or config is built for the others.
        """
        flags = iter(select) if select is not None else None
        seen: set[str] = set()
        for i, entry in enumerate(self.entries):
            yield from entry.runs(flags, seen if i in self.overlapping else None)

    @functools.cached_property
    def runs(self) -> tuple[GridRun, ...]:
        """Every run, materialised (for small grids; sweeps use :meth:`iter_runs`)."""
        return tuple(self.iter_runs())

    @property
    def configs(self) -> list[dict]:
        """Every run's config (a fresh dict each), in expansion order."""
        return [run.config for run in self.iter_runs()]


def builtin_grids() -> dict[str, Path]:
    """Built-in grid name -> TOML path (``kvfast/data/grids/NAME.toml``), in name order."""
    folder = Path(str(resources.files("kvfast").joinpath("data", "grids")))
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


def resolve(name_or_path: str) -> Path:
    """The TOML file that a built-in grid name or a path names; ``ValueError`` if neither."""
    grids = builtin_grids()
    if name_or_path in grids:
        return grids[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists() or "/" in name_or_path:
        if not path.is_file():
            raise ValueError(f"grid: {name_or_path!r} is not a file")
        return path
    allowed = ", ".join(grids) or "(none)"
    raise ValueError(f"grid: {name_or_path!r} is not a built-in grid; allowed: {allowed}, or a path to a .toml file")


def load_grid(name_or_path: str, max_runs: int = DEFAULT_MAX_RUNS, studies: Mapping[str, Study] | None = None) -> Grid:
    """Read and validate a built-in grid or a grid TOML file (``ValueError`` on any problem); ``studies``: the
    registry its study name is looked up in (default :data:`~kvfast.sweep.study.REGISTERED`)."""
    path = resolve(name_or_path)
    try:
        spec = tomllib.loads(path.read_bytes().decode())  # what tomllib.load does with a binary file
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: TOML syntax error: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a TOML text file (byte {exc.start}: not UTF-8)") from None
    except RecursionError:  # Python's TOML parser recurses once per level of nesting
        raise ValueError(
            f"{path}: arrays or tables nested too deep to parse; allowed: at most {MAX_DEPTH} levels"
        ) from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    return grid_from_spec(spec, name=path.stem, source=str(path), max_runs=max_runs, studies=studies)


def resolve_study(ref: Any, studies: Mapping[str, Study] | None = None) -> Study:
    """The study a grid's ``study`` names: a name in ``studies`` (a registry: the command line passes
    ``kvfast.studies.STUDIES``; default :data:`~kvfast.sweep.study.REGISTERED`, which importing
    ``kvfast.studies`` fills with the built-in studies), a name
    registered by an installed package in the ``kvfast.studies`` entry-point group (kvfast's own built-in
    studies are there too, so a grid naming one loads without importing ``kvfast.studies`` first), or
    ``"package.module:ATTR"`` (a :class:`~kvfast.sweep.study.Study` object), loaded by
    :func:`kvfast.runtime.load_object`'s rules. ``ValueError`` otherwise, one line: also when the study's
    module raises or exits at import (``SystemExit`` of any code, ``KeyboardInterrupt`` from the module,
    any exception; ``os._exit`` where the command line probes the import)."""
    from kvfast.sweep.study import REGISTERED, Study

    studies = REGISTERED if studies is None else studies
    if isinstance(ref, str) and ref in studies:
        return studies[ref]
    allowed = f"{_registered_names(studies)}, an entry point of group {ENTRY_POINT_GROUP!r}, or 'package.module:STUDY'"
    try:
        return load_object(
            ref,
            "study",
            accept=lambda obj: isinstance(obj, Study),
            allowed="a kvfast Study object",
            form=allowed,
            entry_points=lambda: entry_points_of(ENTRY_POINT_GROUP),
        )
    except UserCodeError as exc:
        raise ValueError(f"study: {shown(ref)}: {exc}") from None


def _level(
    table: Any, where: str, allowed: tuple[str, ...], limit: int
) -> tuple[list[str], list[tuple[tuple, list[tuple]]]]:
    """The keys a (sub-)grid sets and its factors: ``(keys, rows of canonical values)`` to cross; ``limit``: the
    most runs the grid may have (no range of more values is expanded)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: {table!r} is not a table")
    for key in table:
        if key not in allowed:
            raise ValueError(f"{where}: key {key!r} is not allowed; allowed: {', '.join(allowed)}")
    seen: dict[str, str] = {}  # key -> the section that sets it
    factors: list[tuple[tuple, list[tuple]]] = []

    def add(section: str, prefix: str, arrays: dict) -> None:
        """One factor: ``arrays``' keys (each set once in the level) and their rows of canonical values."""
        for key in arrays:
            if key in seen:
                raise ValueError(f"{where}: key {key!r} is set twice, in {seen[key]} and in {section}")
            seen[key] = section
        wheres = [f"{prefix}.{key}" for key in arrays]  # how a refusal of a value names it
        factors.append(
            (tuple(arrays), [tuple(map(canonical, row, wheres)) for row in zip(*arrays.values(), strict=True)])
        )

    for section in ("fixed", "axes"):
        part = table.get(section, {})
        if not isinstance(part, dict):
            raise ValueError(f"{where}{section}: {part!r} is not a table")
        for key, value in part.items():
            values = [value] if section == "fixed" else _distinct(_array(value, f"{where}axes.{key}", limit))
            add(f"[{section}]", section, {key: values})
    tied = table.get("tied", [])
    if not isinstance(tied, list):
        raise ValueError(f"{where}tied: {tied!r} is not an array of tables; write [[tied]]")
    for i, group in enumerate(tied):
        if not isinstance(group, dict) or not group:
            raise ValueError(f"tied[{i}]: {group!r} is not allowed; allowed: a non-empty table of equal-length arrays")
        arrays = {key: _array(values, f"{where}tied[{i}].{key}", limit) for key, values in group.items()}
        if len({len(values) for values in arrays.values()}) > 1:
            sizes = ", ".join(f"{k}={len(values)}" for k, values in arrays.items())
            raise ValueError(f"tied[{i}]: arrays have different lengths ({sizes}); allowed: equal lengths")
        add(f"[[tied]] #{i + 1}", "tied", arrays)
    return list(seen), factors


ARRAY_FORM = (
    "an array of values, or {range = [START, STOP]} or {range = [START, STOP, STEP]} "
    "(integers, STOP excluded, STEP not 0; as Python's range)"
)


def _array(values: Any, where: str, limit: int) -> list | range:
    """An axis's (or a tied key's) values: an array as written, or the integers a ``{range = [...]}`` table names.

    ``ValueError`` naming ``where`` and :data:`ARRAY_FORM` for anything else, for an empty array or range, and
    for a range of more than ``limit`` values (refused before it is expanded).
    """
    if isinstance(values, list):
        if not values:
            raise ValueError(f"{where}: [] is empty; allowed: {ARRAY_FORM}, of at least one value")
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{where}: {shown(values)} is not an array; allowed: {ARRAY_FORM}")
    bounds = values.get("range")
    if (
        list(values) != ["range"]
        or not isinstance(bounds, list)
        or len(bounds) not in (2, 3)
        or not all(type(b) is int for b in bounds)
        or bounds[2:] == [0]
    ):
        raise ValueError(f"{where}: {shown(values)} is not allowed; allowed: {ARRAY_FORM}")
    out = range(*bounds)
    if not out:
        raise ValueError(f"{where}: {shown(values)} is empty; allowed: a range of at least one value")
    if len(out) > limit:
        raise ValueError(
            f"{where}: {shown(values)} is {len(out):,} values; allowed: at most {limit:,}, the most runs a grid may "
            "have (raise the limit with --max-runs N, or max_runs=N)"
        )
    return out


def _distinct(values: list) -> list:
    """``values`` without repeats of a plain value (first occurrence kept, order kept), in one pass of C
    hashing, so that an axis of two million copies of one value plans as fast as an axis of one.
    ``1``, ``1.0`` and ``True`` stay apart (their types differ), as do ``0.0`` and ``-0.0``; anything
    else (arrays, tables) is kept for :func:`_factor`'s de-duplication by canonical text."""
    if isinstance(values, range) or not all(type(v) in (str, int, float, bool) for v in values):
        return values
    keys = dict.fromkeys((type(v), v, math.copysign(1.0, v) if type(v) is float else 0.0) for v in values)
    return [key[1] for key in keys] if len(keys) < len(values) else values


_NUMBERED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(.+)$")


def _coerce(value: Any, typ: pa.DataType, key: str = "value") -> Any:
    """A config value in its canonical form, so that one run has one id.

    Integers in float columns become floats (``lr = 1`` and ``lr = 1.0`` are one
    run). A string ``KIND:N`` whose ``N`` is digits (``online:4``) loses its
    leading zeros (``online:04`` is ``online:4``); digits other than ASCII
    (``online:٤``, ``online:²``) are refused, naming ``key``.
    """
    if pa.types.is_floating(typ) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and (m := _NUMBERED.match(value)):
        tail = m.group(2)
        if any(c.isdigit() or c.isnumeric() for c in tail) and not tail.isascii():
            raise ValueError(f"{key}: {value!r} is not allowed; allowed: ASCII digits 0-9 after ':'")
        if tail.isdigit() and len(tail) > 1 and tail.startswith("0"):
            return f"{m.group(1)}:{int(tail)}"
    if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and isinstance(value, list):
        return [_coerce(v, typ.value_type, key) for v in value]
    return value


def _factor(keys: tuple, rows: list[tuple], fields: dict[str, pa.DataType], cache: dict) -> _Factor:
    """Coerce, type-check and de-duplicate one factor's rows (each distinct value once per field)."""
    kept: dict[tuple, tuple] = {}  # a row's pieces -> its values, each distinct row once, first position kept
    for row in rows:
        values, pieces = [], []
        for key, value in zip(keys, row, strict=True):
            token = (key, json.dumps(value, sort_keys=True, allow_nan=True), type(value).__name__)
            hit = cache.get(token)
            if hit is None:
                coerced = _coerce(value, fields[key], key)
                # the canonical JSON text of the entry, as kvfast.sweep.ids.canonical_json writes it
                piece = (
                    json.dumps(key) + ":" + json.dumps(coerced, sort_keys=True, separators=(",", ":"), allow_nan=True)
                )
                hit = cache[token] = (coerced, piece)
            values.append(hit[0])
            pieces.append(hit[1])
        kept.setdefault(tuple(pieces), tuple(values))
    return _Factor(tuple(keys), tuple(kept.values()), tuple(kept))


def _template(study: Study, fields: dict, factors: list[_Factor], varying: list[_Factor]) -> str:
    """The ``str.format`` template of ``{"config":{...},"study":NAME,"version":V}`` with sorted keys."""

    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    where: dict[str, str] = {}
    for f in factors:
        i = next((j for j, v in enumerate(varying) if v is f), None)
        for k, key in enumerate(f.keys):
            where[key] = escape(f.pieces[0][k]) if i is None else f"{{{i}[{k}]}}"
    config = ",".join(where[key] for key in sorted(fields))
    tail = escape(f',"study":{json.dumps(study.name)},"version":{json.dumps(study.version)}}}')
    return "{{" + escape('"config":{') + config + "}}" + tail


def grid_from_spec(
    spec: dict,
    name: str = "<grid>",
    source: str = "<spec>",
    max_runs: int = DEFAULT_MAX_RUNS,
    studies: Mapping[str, Study] | None = None,
) -> Grid:
    """Validate a parsed grid spec (the TOML as a dict) and plan its runs. ``ValueError`` names the problem.

    A grid of more than ``max_runs`` runs (counted from its axes, before anything
    is expanded) is refused. ``studies``: the registry the spec's study name is looked up in (see
    :func:`resolve_study`).
    """
    if not isinstance(spec, dict):
        raise ValueError(f"{name}: the grid is not a table")
    require_int(max_runs, "--max-runs", 1)
    study_ref = spec.get("study")
    if study_ref is None:
        from kvfast.sweep.study import REGISTERED

        names = _registered_names(REGISTERED if studies is None else studies)
        raise ValueError(f"{name}: study: missing; allowed: {names}, or 'package.module:STUDY'")
    try:
        study = resolve_study(study_ref, studies)
        raw_entries = _raw_entries(spec, study, max_runs)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    raw = sum(math.prod(len(rows) for _, rows in factors) for _, factors in raw_entries)
    if raw > max_runs:
        raise ValueError(
            f"{name}: {raw:,} runs is not allowed; allowed: at most {max_runs:,} runs "
            "(raise the limit with --max-runs N, or max_runs=N)"
        )
    fields, cache, entries = study.config_fields, {}, []
    for where, raw_factors in raw_entries:  # factors coerced and de-duplicated, the fixed values, the id template
        factors = [_factor(keys, rows, fields, cache) for keys, rows in raw_factors]
        varying = [f for f in factors if len(f.rows) > 1]
        base = dict.fromkeys(fields)
        for f in factors:
            if len(f.rows) == 1:
                base.update(zip(f.keys, f.rows[0], strict=True))
        entries.append(_Entry(where, tuple(factors), base, tuple(varying), _template(study, fields, factors, varying)))
    _validate_entries(entries, study, name)
    overlapping = _overlapping(entries)
    spec = canonical(spec)
    size = sum(e.size for i, e in enumerate(entries) if i not in overlapping)
    size += len(set(itertools.chain.from_iterable(entries[i].ids() for i in overlapping)))
    return Grid(name, source, spec, study, tuple(entries), frozenset(overlapping), size, study_ref)


def _registered_names(studies: Mapping[str, Study]) -> str:
    """The study names a grid may use, for a refusal: the registry's and the installed entry points' (the built-in
    studies are entry points of kvfast itself), or what to do when there are none."""
    names = set(studies) | set(entry_points_of(ENTRY_POINT_GROUP))
    if names:
        return ", ".join(sorted(names))
    return (
        "a registered name (none is found: an installation older than the built-in studies' entry points needs "
        "`pip install -e .` again, or `import kvfast.studies` registers them)"
    )


def _raw_entries(spec: dict, study: Study, limit: int) -> list[tuple[str, list]]:
    """Per sub-grid (``[[union]]`` entry, or the grid itself): ``(where, factors)`` before coercion, the
    sub-grid's keys replacing top-level keys of the same name; every config field set, none unknown. ``limit``:
    the most runs allowed (see :func:`_array`). A ``ValueError`` does not name the grid (the caller does)."""
    top_keys, top_factors = _level(spec, "", TOP_KEYS, limit)
    top_keys = [k for k in top_keys if k not in ("study", "description")]
    union = spec.get("union", [{}]) or [{}]
    if not isinstance(union, list):
        raise ValueError(f"union: {shown(union)} is not an array of tables; write [[union]]")
    fields = study.config_fields
    raw_entries: list[tuple[str, list]] = []
    for i, sub in enumerate(union):
        where = f"union[{i}]." if "union" in spec else ""
        sub_keys, sub_factors = _level(sub, where, SUB_KEYS, limit)
        keys = set(top_keys) | set(sub_keys)  # exactly the study's config fields
        unknown = sorted(keys - set(fields))
        if unknown:
            raise ValueError(
                f"axis {unknown[0]!r} is not a config field of study {study.name!r}; allowed: {', '.join(fields)}"
            )
        missing = [f for f in fields if f not in keys]
        if missing:
            raise ValueError(
                f"{missing[0]}: missing from the grid ({where or 'grid'}); set it in [fixed] or [axes]; "
                f"study {study.name!r} needs: {', '.join(fields)}"
            )
        kept = [f for f in top_factors if not (set(f[0]) & set(sub_keys))]
        raw_entries.append((where or "grid", kept + sub_factors))
    return raw_entries


def _validate_entries(entries: list[_Entry], study: Study, name: str) -> None:
    """The study's ``validate_config`` once per distinct value of each validation group (see
    ``Study.validate_groups``), then each column's type, each distinct value once.

    A group's values are set into its entry's first config (itself validated first), so a failure names the
    group's field and value.
    """
    # the declared validation groups plus every other field alone; or all fields at once
    declared, fields = study.validate_groups, list(study.config_fields)
    groups = [tuple(fields)] if declared is None else [tuple(g) for g in declared]
    named = {key for group in groups for key in group}
    groups += [(key,) for key in fields if key not in named]
    done: set = set()

    def check(config: dict) -> None:
        token = tuple(map(repr, config.values()))
        if token in done:
            return
        try:
            where = f"study {study.name!r}: validate_config"
            call_user(where, study.validate_config, dict(config), passthrough=(ValueError,))
        except ValueError as exc:  # a missing extra stays one (kvfast grids says which)
            raise prefixed(exc, name) from None
        except UserCodeError as exc:  # not the ValueError of its contract: one line naming the config
            raise ValueError(f"{name}: {exc} (config {shown(config)})") from None
        done.add(token)

    for entry in entries:
        reference = next(entry.runs()).config
        check(reference)
        owner = {key: f for f in entry.varying for key in f.keys}
        for group in groups:
            # the varying factors that set the group's fields, each once, in the group's order
            involved = list({id(f): f for key in group if (f := owner.get(key)) is not None}.values())
            for combo in itertools.product(*(f.rows for f in involved)):
                config = dict(reference)
                for f, row in zip(involved, combo, strict=True):
                    config.update((k, v) for k, v in zip(f.keys, row, strict=True) if k in group)
                check(config)
    for f_name, typ in study.config_fields.items():
        distinct: dict[str, Any] = {}
        for entry in entries:
            for f in entry.factors:
                if f_name in f.keys:
                    k = f.keys.index(f_name)
                    for row, pieces in zip(f.rows, f.pieces, strict=True):
                        distinct.setdefault(pieces[k], row[k])
        values = list(distinct.values())
        if not fits(values, typ):  # name the first value that does not fit (or all, where each fits alone)
            bad = next((v for v in values if not fits([v], typ)), values)
            raise ValueError(f"{name}: {f_name}: {shown(bad)} is not allowed; allowed: values of type {typ}")


def _overlapping(entries: list[_Entry]) -> set[int]:
    """The sub-grids that may share a run with another (their ids are de-duplicated when listed)."""
    if len(entries) > _OVERLAP_CHECK_MAX:
        return set(range(len(entries)))
    # field -> the canonical texts of its values, per entry: two entries whose value sets for some field are
    # disjoint share no run
    values = [{key: {p[k] for p in f.pieces} for f in e.factors for k, key in enumerate(f.keys)} for e in entries]
    overlapping: set[int] = set()
    for i, j in itertools.combinations(range(len(entries)), 2):
        if all(values[i][key] & values[j][key] for key in values[i]):
            overlapping |= {i, j}
    return overlapping


def as_grid(grid: Grid | str | os.PathLike | dict | Iterable[dict], study: str | None = None) -> Grid:
    """A :class:`Grid` from a grid, a built-in grid name or TOML path, a parsed spec (dict), or configs of ``study``."""
    if isinstance(grid, Grid):
        return grid
    if isinstance(grid, str | os.PathLike):
        return load_grid(str(grid))
    if isinstance(grid, dict):
        return grid_from_spec(grid)
    if study is None:
        raise ValueError("study: None is not allowed with a list of configs; allowed: a study name")
    return grid_from_configs(study, grid)


def grid_from_configs(study: str, configs: Iterable[dict], name: str = "<configs>") -> Grid:
    """The grid of exactly these configs of ``study``, through :func:`grid_from_spec`.

    Each config is one ``[[union]]`` entry of ``[fixed]`` values, so the same
    validation, column types, run ids and de-duplication apply as to a TOML grid.
    """
    union = []
    for i, config in enumerate(configs):
        if not isinstance(config, dict):
            raise ValueError(f"{name}: configs[{i}]: {type(config).__name__} is not allowed; allowed: a dict")
        union.append({"fixed": dict(config)})
    if not union:
        raise ValueError(f"{name}: configs: empty; allowed: at least one config")
    return grid_from_spec({"study": study, "union": union}, name=name, source=name)


def fits(values: list, typ: pa.DataType) -> bool:
    """Whether ``values`` make an Arrow array of type ``typ`` (a column of results)."""
    try:
        pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
        return False
    return True
