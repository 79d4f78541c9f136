"""A Dask ``--preload`` module for tests/sweep/test_sweep_dask_versions.py: the worker it is preloaded into says it runs
another kvfast (``0.0.0-other``), as a worker on a machine with another install would."""

import kvfast._version

kvfast._version.__version__ = "0.0.0-other"
