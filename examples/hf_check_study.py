"""A check study over tiny Hugging Face models: each run builds one with
:func:`kvfast.testing.tiny_model` and checks its KV cache with :func:`kvfast.check_cache`.

Used by ``examples/hf_check.toml``; needs ``kvfast[hf]`` (torch and transformers). For your own
stack, replace ``factory`` in the grid by your own ``module:function`` and ``ARGS`` by its arguments.
"""

from __future__ import annotations

import pyarrow as pa

from kvfast.studies.check import check_study

# the factory's keyword arguments, with their Parquet types: the grid's axes sweep them
ARGS = {"family": pa.string(), "dtype": pa.string(), "attention": pa.string(), "seed": pa.int64()}

STUDY = check_study("hf_check", ARGS, description="tiny Hugging Face models through the cache checker")
