"""Grids: a study plus axes, read from TOML, expanded and validated before any run.

The TOML form (see ``docs/sweep.md``)::

    study = "exactness"          # a registered study (kvfast.studies.STUDIES)
    description = "..."          # optional

    [fixed]                      # one value per key, in every run
    vocab = 32

    [axes]                       # cartesian product, first axis outermost
    seed = [0, 1, 2]
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
"""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from kvfast.sweep.ids import canonical, run_id, spec_hash

if TYPE_CHECKING:
    from kvfast.studies.base import Study

TOP_KEYS = ("study", "description", "fixed", "axes", "tied", "union")
SUB_KEYS = ("description", "fixed", "axes", "tied")


class Run(NamedTuple):
    """One run of a grid: its id and its (normalised) config."""

    run_id: str
    config: dict


@dataclass(frozen=True)
class Grid:
    """An expanded, validated grid.

    ``name``: the built-in grid's name or the TOML file's stem; ``source``: where it
    was read from; ``spec``: the parsed TOML; ``runs``: every run, in expansion order,
    no run id twice.
    """

    name: str
    source: str
    spec: dict
    study: Study
    runs: tuple[Run, ...]

    @property
    def spec_hash(self) -> str:
        """Hash of the canonical spec (stored in the manifest)."""
        return spec_hash(self.spec)

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def configs(self) -> list[dict]:
        """Every run's config (a fresh dict each), in expansion order."""
        return [dict(r.config) for r in self.runs]


def grids_dir() -> Path:
    """The folder of built-in grid TOMLs (``kvfast/data/grids``)."""
    return Path(str(resources.files("kvfast").joinpath("data", "grids")))


def builtin_grids() -> dict[str, Path]:
    """Built-in grid name -> TOML path, in name order."""
    folder = grids_dir()
    return {p.stem: p for p in sorted(folder.glob("*.toml"))} if folder.is_dir() else {}


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


def load_grid(name_or_path: str) -> Grid:
    """Read, expand and validate a built-in grid or a grid TOML file (``ValueError`` on any problem)."""
    path = resolve(name_or_path)
    try:
        with open(path, "rb") as fh:
            spec = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: TOML syntax error: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    return grid_from_spec(spec, name=path.stem, source=str(path))


def _level(table: Any, where: str, allowed: tuple[str, ...]) -> tuple[list[str], list[list[dict]]]:
    """The keys a (sub-)grid sets and its factors: lists of partial configs to cross."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: {table!r} is not a table")
    for key in table:
        if key not in allowed:
            raise ValueError(f"{where}: key {key!r} is not allowed; allowed: {', '.join(allowed)}")
    seen: dict[str, str] = {}

    def claim(key: str, section: str) -> None:
        if key in seen:
            raise ValueError(f"{where}: key {key!r} is set twice, in {seen[key]} and in {section}")
        seen[key] = section

    factors: list[list[dict]] = []
    fixed = table.get("fixed", {})
    if not isinstance(fixed, dict):
        raise ValueError(f"{where}fixed: {fixed!r} is not a table")
    for key, value in fixed.items():
        claim(key, "[fixed]")
        factors.append([{key: canonical(value, f"fixed.{key}")}])
    axes = table.get("axes", {})
    if not isinstance(axes, dict):
        raise ValueError(f"{where}axes: {axes!r} is not a table")
    for key, values in axes.items():
        claim(key, "[axes]")
        if not isinstance(values, list):
            raise ValueError(f"axes.{key}: {values!r} is not an array; allowed: an array of values, e.g. [{values!r}]")
        if not values:
            raise ValueError(f"axes.{key}: [] is empty; allowed: an array of at least one value")
        factors.append([{key: canonical(v, f"axes.{key}")} for v in values])
    tied = table.get("tied", [])
    if not isinstance(tied, list):
        raise ValueError(f"{where}tied: {tied!r} is not an array of tables; write [[tied]]")
    for i, group in enumerate(tied):
        if not isinstance(group, dict) or not group:
            raise ValueError(f"tied[{i}]: {group!r} is not allowed; allowed: a non-empty table of equal-length arrays")
        lengths = {}
        for key, values in group.items():
            claim(key, f"[[tied]] #{i + 1}")
            if not isinstance(values, list) or not values:
                raise ValueError(f"tied[{i}].{key}: {values!r} is not allowed; allowed: a non-empty array")
            lengths[key] = len(values)
        if len(set(lengths.values())) > 1:
            sizes = ", ".join(f"{k}={n}" for k, n in lengths.items())
            raise ValueError(f"tied[{i}]: arrays have different lengths ({sizes}); allowed: equal lengths")
        keys = list(group)
        rows = zip(*(group[k] for k in keys), strict=True)
        factors.append([{k: canonical(v, f"tied.{k}") for k, v in zip(keys, row, strict=True)} for row in rows])
    return list(seen), factors


def _expand(factors: list[list[dict]]) -> list[dict]:
    out = []
    for combo in itertools.product(*factors):
        config: dict = {}
        for part in combo:
            config.update(part)
        out.append(config)
    return out


def _coerce(value: Any, typ: pa.DataType) -> Any:
    """Integers in float columns become floats (so ``lr = 1`` and ``lr = 1.0`` are one run)."""
    if pa.types.is_floating(typ) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and isinstance(value, list):
        return [_coerce(v, typ.value_type) for v in value]
    return value


def grid_from_spec(spec: dict, name: str = "<grid>", source: str = "<spec>") -> Grid:
    """Expand and validate a parsed grid spec (the TOML as a dict). ``ValueError`` names the problem."""
    from kvfast.studies import STUDIES

    if not isinstance(spec, dict):
        raise ValueError(f"{name}: the grid is not a table")
    study_name = spec.get("study")
    if study_name is None:
        raise ValueError(f"{name}: study: missing; allowed: {', '.join(sorted(STUDIES))}")
    if not isinstance(study_name, str) or study_name not in STUDIES:
        raise ValueError(f"{name}: study: {study_name!r} is not allowed; allowed: {', '.join(sorted(STUDIES))}")
    study = STUDIES[study_name]
    try:
        top_keys, top_factors = _level(spec, "", TOP_KEYS)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    top_keys = [k for k in top_keys if k not in ("study", "description")]
    union = spec.get("union", [{}]) or [{}]
    if not isinstance(union, list):
        raise ValueError(f"{name}: union: {union!r} is not an array of tables; write [[union]]")
    configs: list[dict] = []
    key_sets: list[tuple[str, set[str]]] = []
    for i, sub in enumerate(union):
        where = f"union[{i}]." if "union" in spec else ""
        try:
            sub_keys, sub_factors = _level(sub, where, SUB_KEYS)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        # sub-grid keys replace top-level keys of the same name
        kept = [f for f in top_factors if not (set(f[0]) & set(sub_keys))]
        key_sets.append((where or "grid", set(top_keys) | set(sub_keys)))
        configs.extend(_expand(kept + sub_factors))
    fields = study.config_fields
    for where, keys in key_sets:
        unknown = sorted(keys - set(fields))
        if unknown:
            raise ValueError(
                f"{name}: axis {unknown[0]!r} is not a config field of study {study.name!r}; "
                f"allowed: {', '.join(fields)}"
            )
        missing = [f for f in fields if f not in keys]
        if missing:
            raise ValueError(
                f"{name}: {missing[0]}: missing from the grid ({where}); set it in [fixed] or [axes]; "
                f"study {study.name!r} needs: {', '.join(fields)}"
            )
    runs: dict[str, Run] = {}
    for config in configs:
        config = {f: _coerce(config[f], t) for f, t in fields.items()}
        try:
            study.validate_config(config)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        rid = run_id(study.name, study.version, config)
        if rid not in runs:
            runs[rid] = Run(rid, config)
    for f, t in fields.items():
        _validate_column(name, f, t, [r.config[f] for r in runs.values()])
    return Grid(name=name, source=source, spec=canonical(spec), study=study, runs=tuple(runs.values()))


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


def _validate_column(name: str, field: str, typ: pa.DataType, values: list) -> None:
    """``ValueError`` unless every value of a config column fits its Arrow type."""
    try:
        pa.array(values, type=typ)
        return
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
        pass
    for v in values:
        try:
            pa.array([v], type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
            raise ValueError(f"{name}: {field}: {v!r} is not allowed; allowed: values of type {typ}") from None
    raise ValueError(f"{name}: {field}: values do not fit type {typ}")
