"""Factories for ``kvfast check``: kvfast's own model, clean and with a catalogue bug; a template for your own.

From the repository's root (the current directory is searched first for the module):
``kvfast check examples.tiny_model:clean --prompt 1,2,3 --steps 64`` passes (exit 0);
``kvfast check examples.tiny_model:posfrozen --prompt 1,2,3 --steps 64`` finds the bug (exit 1).
From anywhere, the same model is built in: ``kvfast check kvfast.bugs.kvfast_model:tiny_model [--factory-arg
bug=posfrozen] ...``.
"""

from __future__ import annotations

import kvfast

CONFIG = kvfast.ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=128)


def clean() -> kvfast.KvfastModel:
    """A random 2-layer model, f32 preset, on kvfast's real cache path."""
    return kvfast.KvfastModel(CONFIG, kvfast.init_params(CONFIG, seed=0), numerics="f32")


def posfrozen() -> kvfast.KvfastModel:
    """The same model with the ``posfrozen`` bug: invisible at decode step 1."""
    return kvfast.KvfastModel(CONFIG, kvfast.init_params(CONFIG, seed=0), numerics="f32", bug="posfrozen")
