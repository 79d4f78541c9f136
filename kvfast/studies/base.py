"""What a study is: the sweep's contract, :mod:`kvfast.sweep.study` (re-exported here, where studies have always
imported it from)."""

from kvfast.sweep.study import Claim, Fact, Figure, Study

__all__ = ["Claim", "Fact", "Figure", "Study"]
