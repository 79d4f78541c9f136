"""``kvfast.bugs``: the bug catalogues kvfast tests its checker against, and detector scoring. Test tooling,
not the product: :mod:`kvfast.check` never imports it; it imports :mod:`kvfast.check` (its bugs subclass the
checker's adapters), and the studies import both.

Every bug has one shape, :class:`~kvfast.bugs.bug.Bug` (name, description, where it first acts, how it is
injected); the catalogues (:data:`CATALOGUES`), each a :class:`~kvfast.bugs.bug.Catalogue` (``{name: Bug}``):

- :data:`~kvfast.bugs.kvfast_model.KVFAST_BUGS`: kvfast's own model's eight bugs (one changed line each in
  the model's decode kernel; :data:`kvfast.BUGS` their descriptions);
- :data:`~kvfast.bugs.hf.HF_BUGS`: cache bugs of a Hugging Face model's cache path
  (:func:`~kvfast.bugs.hf.inject_hf_bug`);
- :data:`~kvfast.bugs.operations.OP_BUGS`: bugs of the cache operations (rollback, fork, reorder, padded
  batches; :func:`~kvfast.bugs.operations.inject_op_bug`);
- :data:`~kvfast.bugs.lossy.LOSSY_BUGS`: bugs of kvfast's own lossy cache (:func:`~kvfast.bugs.lossy.inject_lossy_bug`).

:mod:`kvfast.bugs.score` scores any detector against a catalogue (the metrics, the built-in detectors,
``score_detector``, ``compare_detectors``; :func:`kvfast.score_detector` fills in the detector study's cases).
Importing this package imports neither torch nor pandas.
"""

from __future__ import annotations

from kvfast.bugs.bug import Bug, Catalogue
from kvfast.bugs.hf import HF_BUGS
from kvfast.bugs.kvfast_model import KVFAST_BUGS
from kvfast.bugs.lossy import LOSSY_BUGS
from kvfast.bugs.operations import OP_BUGS

#: Every catalogue by the adapter it injects into.
CATALOGUES: dict[str, Catalogue] = {
    "kvfast": KVFAST_BUGS,
    "hf": HF_BUGS,
    "operations": OP_BUGS,
    "lossy": LOSSY_BUGS,
}

__all__ = ["CATALOGUES", "HF_BUGS", "KVFAST_BUGS", "LOSSY_BUGS", "OP_BUGS", "Bug", "Catalogue"]
