"""Studies: run functions over configs, each with its schema and summary (see :mod:`kvfast.studies.base`)."""

from __future__ import annotations

from kvfast.studies import exactness
from kvfast.studies.base import Claim, Study

STUDIES: dict[str, Study] = {s.name: s for s in (exactness.STUDY,)}

__all__ = ["STUDIES", "Claim", "Study"]
