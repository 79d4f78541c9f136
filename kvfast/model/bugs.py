"""The bug catalogue: eight realistic KV-cache bugs, each one changed line of the decode path.

Each bug is selected by name on the real decode kernel (``decode_step(...,
bug=NAME)``); the clean path is ``bug=None``. The line each one changes is in
:func:`kvfast.model.generation.decode_kernel`, marked with the bug's name.

Four are visible at the first decode step (the cache is still just the
prefill, but the new token's own computation is wrong) and four are
invisible there: bugs in the cache's *growth*, which first bite at step 2 or
later.
"""

from __future__ import annotations

NONE = 0
STALE = 1
POSOFF = 2
FREEZE = 3
EVICT = 4
POSFROZEN = 5
KVSWAP = 6
NOSCALE = 7
MASKFROZEN = 8

# Width of the unasked-for sliding window of ``evict``: larger than every
# prompt in the built-in studies, so that it first bites after a few steps.
EVICT_WINDOW = 16

BUGS: dict[str, str] = {
    "stale": "attend before appending: attention reads keys 0..len-1, the new token's own K/V are "
    "stored after it (hi = slot instead of slot + 1)",
    "posoff": "position index one behind: wpe[pos - 1] instead of wpe[pos]",
    "freeze": "buffer stops growing: after the first decode step new K/V overwrite the last slot "
    "(slot = length - 1 once length > prefill_len)",
    "evict": f"unasked-for sliding window: attention reads only the last {EVICT_WINDOW} entries "
    f"(lo = max(0, hi - {EVICT_WINDOW}))",
    "posfrozen": "prompt length as the position offset: wpe[prefill_len] instead of wpe[cache length] "
    "(the commonest way to get resuming wrong)",
    "kvswap": "K and V swapped on store: the new token's key goes into the value buffer and vice versa",
    "noscale": "decode misses the 1/sqrt(head_dim) scale of the attention scores",
    "maskfrozen": "attention length computed once at prefill and reused: keys 0..prefill_len instead "
    "of 0..length (hi = prefill_len + 1)",
}
#: each bug's kernel code: its constant above (its upper-case name)
BUG_CODES: dict[str, int] = {name: globals()[name.upper()] for name in BUGS}

# Whether the bug moves the logits at decode step 1 (the signature the tests assert).
VISIBLE_AT_STEP_1: dict[str, bool] = {name: name in ("stale", "posoff", "kvswap", "noscale") for name in BUGS}


def bug_code(bug: str | None) -> int:
    """The kernel code of a bug name (``None`` is the clean path)."""
    if bug is None:
        return NONE
    if not isinstance(bug, str) or bug not in BUG_CODES:
        raise ValueError(f"bug: {bug!r} is not allowed; allowed: None, {', '.join(BUG_CODES)}")
    return BUG_CODES[bug]
