"""Writing result rows: Arrow tables of the study's schema, buffered and written as Parquet parts.

The writer is the one consumer of rows: every backend hands it ``(runs, rows)``
for each finished chunk (rows in any order; ``runs`` give each row its config
columns). A row whose values do not fit the schema is stored as an ``error``
row (``ResultTypeError``) instead of failing the part. It also keeps the
sweep's tallies: ``counts`` (status -> runs written by this sweep), ``ran``,
``compute_s`` and ``recent`` (the wall times of the last ``ok`` runs, which the
planner sizes chunks from).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from kvfast.sweep.grid import GridRun, fits
from kvfast.sweep.store import PART_ROWS, ResultsDir, schema_for

if TYPE_CHECKING:
    from kvfast.sweep.study import Study

FLUSH_S = 1.0  # seconds between two parts written while rows come in (an interrupted sweep loses no more)


class Writer:
    """Turns result rows into Arrow tables of the study's schema and writes parts.

    Tables are buffered and written as one part when :data:`FLUSH_S` seconds have
    passed since the last write or :data:`PART_ROWS` rows are buffered (and by
    :meth:`flush`). ``counts``: status -> runs written by this sweep.
    """

    def __init__(self, store: ResultsDir, study: Study, progress) -> None:
        self.store = store
        self.study = study
        self.schema = schema_for(study)
        self.config_names = list(study.config_fields)
        self.progress = progress
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.last_flush = time.monotonic()
        self.ran = 0
        self.counts: Counter[str] = Counter()
        self.written: set[str] = set()  # ids of runs written that had a stored row before (see ``watch``)
        self.watch: set[str] = set()
        self.compute_s = 0.0
        self.recent: deque = deque(maxlen=64)

    def __call__(self, runs: Sequence[GridRun], rows: list[dict]) -> None:
        if not rows:
            return
        configs = {r.run_id: r.config for r in runs}  # rows come in any order
        ordered = [configs[row["run_id"]] for row in rows]
        columns = {name: [c[name] for c in ordered] for name in self.config_names}
        columns.update((name, [row[name] for row in rows]) for name in self.schema.names if name not in columns)
        statuses = columns["status"]
        try:
            table = pa.Table.from_pydict(columns, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
            full = [{**c, **row} for c, row in zip(ordered, rows, strict=True)]
            table = pa.concat_tables([self._one_row(r) for r in full])
            statuses = table.column("status").to_pylist()
        self.buffer.append(table)
        self.buffered += len(rows)
        self.counts.update(statuses)
        self.compute_s += sum(r["wall_s"] or 0.0 for r in rows)
        self.recent.extend(r["wall_s"] for r, status in zip(rows, statuses, strict=True) if status == "ok")
        if self.watch:
            self.written.update(r["run_id"] for r in rows if r["run_id"] in self.watch)
        self.ran += len(rows)
        if self.buffered >= PART_ROWS or time.monotonic() - self.last_flush >= FLUSH_S:
            self.flush()
        if self.progress is not None:
            self.progress.set_postfix(errors=self.ran - self.counts.get("ok", 0), refresh=False)
            self.progress.update(len(rows))

    def flush(self) -> None:
        """Write the buffered rows as one part."""
        if self.buffer:
            self.store.write_part(self.buffer)
        self.buffer, self.buffered = [], 0
        self.last_flush = time.monotonic()

    def _one_row(self, row: dict) -> pa.Table:
        try:
            return pa.Table.from_pylist([row], schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
            pass
        fields = self.study.result_fields
        bad = next((f"{n}: {row[n]!r} does not fit type {t}" for n, t in fields.items() if not fits([row[n]], t)), "?")
        fixed = {**row, **dict.fromkeys(fields), "status": "error", "error": f"ResultTypeError: {bad}"}
        return pa.Table.from_pylist([fixed], schema=self.schema)
