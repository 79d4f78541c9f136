"""What guards a run and a worker: :mod:`kvfast.runtime.worker`, re-exported under its old name."""

from kvfast.runtime.worker import INTERRUPTED, RunTimeout, deadline, on_sigint, worker_start

__all__ = ["INTERRUPTED", "RunTimeout", "deadline", "on_sigint", "worker_start"]
