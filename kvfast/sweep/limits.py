"""Limits checked before any run: a run's memory, from its config, and the grid's results on disk.

:func:`run_memory_bytes` estimates what one run of kvfast's transformer studies
needs, from the model-shape fields of its config (``n_layer``, ``d_model``,
``n_head``, ``d_ff``, ``vocab``, and the sequence: ``prompt_len + steps`` or
``seq_len``), in float64: the weights, the KV cache and one full forward pass
(the uncached reference recomputes every prefix), times :data:`COPIES` (models
and activations held at once: cached and uncached passes, other storage
precisions). It is an order of magnitude, not a measurement. A config without
these fields (users' studies) has no estimate and is never refused.

:func:`check_memory` refuses a grid whose largest run (per ``[[union]]`` entry,
each field at its largest value there: an upper bound) needs more than the
machine's memory, before any run. :func:`check_disk` refuses a grid whose
results (an uncompressed upper bound per row, from the study's schema) would not
fit in the free space of the results directory's file system.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa

COPIES = 4
_BYTES = 8  # float64
_SHAPE = ("n_layer", "d_model", "d_ff", "vocab")


def run_memory_bytes(config: dict) -> int | None:
    """Estimated bytes one run of ``config`` needs, or ``None`` without model-shape fields."""
    if not all(isinstance(config.get(k), int) for k in _SHAPE):
        return None
    n_layer, d_model, d_ff, vocab = (int(config[k]) for k in _SHAPE)
    n_head = int(config.get("n_head") or 1)
    seq = config.get("seq_len") or (int(config.get("prompt_len") or 0) + int(config.get("steps") or 0)) or 1
    seq = int(seq)
    weights = 2 * vocab * d_model + seq * d_model + n_layer * (4 * d_model * d_model + 2 * d_model * d_ff)
    cache = 2 * n_layer * seq * d_model
    activations = n_layer * seq * (8 * d_model + d_ff + n_head * seq) + seq * vocab
    return COPIES * _BYTES * (weights + cache + activations)


def check_memory(grid, limit: int | None = None) -> None:
    """``ValueError`` (one line, with the estimate) if a run of ``grid`` needs more than ``limit`` bytes
    (default: the machine's memory)."""
    import psutil

    limit = limit or psutil.virtual_memory().total  # default: this machine's physical memory
    for entry in grid.entries:
        config = dict(entry.base)  # each numeric field at its largest value in the entry
        for factor in entry.factors:
            for i, key in enumerate(factor.keys):
                numbers = [row[i] for row in factor.rows if isinstance(row[i], int) and not isinstance(row[i], bool)]
                if numbers:
                    config[key] = max(numbers)
        need = run_memory_bytes(config)
        if need is not None and need > limit:
            shape = ", ".join(
                f"{k}={config[k]}" for k in (*_SHAPE, "n_head", "prompt_len", "steps", "seq_len") if k in config
            )
            raise ValueError(
                f"{grid.name}: its largest run ({shape}) needs about {need / 2**30:,.1f} GiB by kvfast's estimate, "
                f"more than the {limit / 2**30:,.1f} GiB allowed; allowed: smaller runs, or --max-memory GIB to raise "
                "the limit"
            )


# bytes per stored value, uncompressed: Parquet stores less (run ids, repeated configs compress)
_STRING_BYTES = 32
_LIST_BYTES = 128
_ROW_OVERHEAD = 64  # run_id, status, wall_s, error


def row_bytes(study) -> int:
    """An upper-bound estimate of one stored row of ``study`` (its config and result columns)."""
    types = (*study.config_fields.values(), *study.result_fields.values())
    lists = sum(pa.types.is_list(t) or pa.types.is_large_list(t) for t in types)
    strings = sum(pa.types.is_string(t) or pa.types.is_large_string(t) for t in types)
    return _ROW_OVERHEAD + lists * _LIST_BYTES + strings * _STRING_BYTES + (len(types) - lists - strings) * _BYTES


def check_disk(grid, out) -> None:
    """``ValueError`` (one line, with the estimate) if ``grid``'s results would not fit in the free space
    under ``out`` (by :func:`row_bytes`, before any run)."""
    try:  # the free space of the file system that holds ``out`` (or its nearest existing parent)
        here = Path(out).absolute()
        free = shutil.disk_usage(next(p for p in (here, *here.parents) if p.exists())).free
    except OSError:  # a name over the file system's limit, no permission (the store reports those in one line)
        return
    per_row = row_bytes(grid.study)
    need = per_row * len(grid)
    if need > free:
        raise ValueError(
            f"{grid.name}: {len(grid):,} runs need up to {need / 2**30:,.2f} GiB of results by kvfast's estimate "
            f"({per_row} bytes a row, uncompressed), more than the {free / 2**30:,.2f} GiB free under {out}; "
            "allowed: a smaller grid, or free space first"
        )
