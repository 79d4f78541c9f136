"""``--jobs 1``: every run in the sweep's own process, one chunk after another, no pool.

A run that kills the process ends the sweep (a rerun resumes it); a time limit
interrupts Python code and sleeps (``SIGALRM``) but not a run stuck in C code.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvfast.sweep.backends import Job, Outcome
from kvfast.sweep.grid import GridRun
from kvfast.sweep.rows import run_chunk

CHUNK = 64


def execute(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """Run ``runs`` here in chunks of ``job.chunk_size`` (default 64), writing each chunk's rows."""
    size = job.chunk_size or CHUNK
    while chunk := list(itertools.islice(runs, size)):
        job.write(chunk, run_chunk(job.study, (0, chunk), job.limits)[1])
    return Outcome(workers=1, chunk_size=size)
