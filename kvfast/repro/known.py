"""Known upstream cache bugs, so that a finding is labelled ``known`` (with its reference), ``new``, or
``injected`` (a bug of kvfast's own catalogues, put there on purpose: never an upstream finding).

:data:`KNOWN`: one :class:`KnownBug` per entry: the library, the release range it holds in (a PEP 440 specifier),
the architectures and scenarios it shows in (``fnmatch`` patterns), what it is, and where it is recorded (an
upstream issue or pull request where one is known, else where kvfast measured it). Seeded with the findings
docs/check.md names.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

KNOWN_LABEL, NEW_LABEL, INJECTED_LABEL = "known", "new", "injected"
LABELS = (NEW_LABEL, KNOWN_LABEL, INJECTED_LABEL)  # the order a listing shows them in: new findings first


@dataclass(frozen=True)
class KnownBug:
    """One known cache bug (see the module doc)."""

    library: str
    releases: str
    architectures: tuple[str, ...]
    scenarios: tuple[str, ...]
    summary: str
    reference: str

    def matches(self, library: str, version: str, architecture: str, scenario: str) -> bool:
        from packaging.specifiers import SpecifierSet

        return (
            library == self.library
            and SpecifierSet(self.releases).contains(version, prereleases=True)
            and any(fnmatch.fnmatchcase(architecture, p) for p in self.architectures)
            and any(fnmatch.fnmatchcase(scenario, p) for p in self.scenarios)
        )


#: The known cache bugs (docs/check.md, section 9: the scan's findings on transformers 5.24 and over releases).
KNOWN: tuple[KnownBug, ...] = (
    KnownBug(
        "transformers", ">=5.0", ("mamba", "falcon_mamba", "jamba"), ("resume",),
        "continuing a cache by more than one token restarts the recurrent state from zero (the multi-token scan "
        "takes no initial state); generate continuing a cache by 2 tokens is off from the full recompute",
        "docs/check.md, section 9 'The scoreboard of transformers 5.24' (kvfast scan; no upstream issue known)",
    ),
    KnownBug(
        "transformers", ">=5.0", ("moshi",), ("*",),
        "the cache keeps only the sliding window while the attention mask is fully causal: generate drifts from "
        "the recompute once the sequence passes the window",
        "docs/check.md, section 9 'The scoreboard of transformers 5.24' (kvfast scan; no upstream issue known)",
    ),
    KnownBug(
        "transformers", "<4.57.6", ("gemma2",), ("decode", "resume"),
        "a DynamicCache given to Gemma 2 ignores its sliding window in decode (generate used its own HybridCache); "
        "measured in 4.46.3, gone in 4.57.6",
        "docs/check.md, section 9 'Over transformers releases' (benchmarks/scan_releases.py)",
    ),
)  # fmt: skip


def label(
    library: str, version: str, architecture: str, scenario: str, injected: bool = False
) -> tuple[str, str | None]:
    """``(label, reference)``: ``injected`` for a catalogue bug put there by kvfast, ``known`` with the first
    matching entry's reference, else ``new`` (no reference)."""
    if injected:
        return INJECTED_LABEL, "kvfast's own bug catalogue (kvfast.bugs): injected on purpose"
    for bug in KNOWN:
        if bug.matches(library, version, architecture, scenario):
            return KNOWN_LABEL, bug.reference
    return NEW_LABEL, None
