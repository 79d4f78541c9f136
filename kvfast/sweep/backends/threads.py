"""``--backend threading``: chunks fanned out to threads of the sweep's process (joblib's threading backend).

A time limit interrupts a run's Python code only: a thread cannot be killed, so a
run blocked in C code (a sleep, a Numba kernel) runs until it returns. There is no
worker process to lose: a run that kills the process ends the sweep.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from kvfast.sweep.backends import Job, Outcome
from kvfast.sweep.grid import GridRun
from kvfast.sweep.rows import run_chunk


def execute(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """Fan chunks out to ``job.jobs`` threads, two chunks per thread dispatched ahead."""
    from joblib import Parallel, delayed

    planner = job.planner(runs, total)

    def tasks() -> Iterator:
        while (chunk := planner.take()) is not None:
            yield delayed(run_chunk)(job.study, chunk, job.limits)

    parallel = Parallel(n_jobs=job.jobs, backend="threading", batch_size=1, return_as="generator_unordered")
    with warnings.catch_warnings():  # joblib's note about tasks cancelled by an interrupt
        warnings.filterwarnings("ignore", message=".*tasks have been successfully executed")
        for index, rows in parallel(tasks()):
            job.write(planner.returned(index), rows)
    return Outcome(workers=job.jobs, chunk_size=planner.largest)
