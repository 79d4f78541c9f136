"""Generation: cached decoding, one position over the stored K/V buffer in one compiled call, and greedy generation.

The decode kernel runs the forward's block (:mod:`kvfast.model.block`) on one row
and the same attention row kernel, so with the same numerics a decode step equals
the matching row of a full recompute bit for bit. The catalogue's bugs
(:mod:`kvfast.model.bugs`) each change one line here.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from kvfast.kernels.attention import BLOCKED, ROW, STANDARD, Blocks, Heads, Keys, new_scratch
from kvfast.kernels.indirect import one_compile_at_a_time, through_address
from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.rowops import embed_into
from kvfast.model import bugs as B
from kvfast.model.block import activations
from kvfast.model.cache import KVCache
from kvfast.model.compiled import (
    _store_rows,
    block_input_at,
    block_output_at,
    head_at,
    named,
)
from kvfast.model.config import ModelConfig
from kvfast.model.transformer import Weights, forward_prepared
from kvfast.model.validate import require_config, require_numerics, require_token, require_tokens
from kvfast.numerics import Numerics
from kvfast.validation import require_int

row_at = through_address(ROW)
blocked_at = through_address(BLOCKED)


@one_compile_at_a_time
@nb.njit(**JIT_OPTIONS)
def decode_kernel(kern, w, n_head, eps, fmt, attn, attn_block, kc, vc, length, prefill_len, token, bug, window, logits):
    """``n = logits.shape[0]`` greedy decode steps: writes ``logits`` (n, vocab), stores K/V, returns the new
    cache length.

    Step ``i`` feeds ``token`` (``i = 0``) or the argmax of step ``i - 1``'s logits (:func:`first_max`, NumPy's
    ``argmax``) at the cache's next position; one step is ``n = 1``. ``kern``, ``w``, ``fmt``: the table of
    kernels, the stacked weights and the formats as :func:`kvfast.model.compiled.forward_kernel` takes them;
    ``kc``, ``vc``: the cache's (n_layer, capacity, d) buffers, written in place at row ``slot``. The block is
    the forward's (:mod:`kvfast.model.block`) on one row; every line a catalogue bug changes is marked.
    ``attn``/``attn_block``: ``Numerics.attention_codes`` (a real kernel's attention order; for splitcount the
    call's key range is the row's own ``lo..hi-1``). Its helpers are inlined in Numba IR or written out here
    (called, each was compiled on its own; inlined, each argument was a copy).
    """
    kern, w, fmt = named(kern, w, fmt)
    d = w.wte.shape[1]
    acts = activations(np.int64(1), d, w.w1.shape[2])  # acts.x: the residual stream, updated in place by each layer
    tokens = np.empty(1, dtype=np.int64)  # (not np.full: one more function to compile)
    positions = np.empty(1, dtype=np.int64)
    hf = np.empty((1, d))
    no_att = np.empty((0, 0, 0))  # no probabilities kept
    row = np.int64(0)  # not the literal 0: the row kernels are compiled once, for the forward's int64 rows too
    work = new_scratch(kc.shape[1], d // n_head)  # attention's work arrays, for every layer and step
    for i in range(logits.shape[0]):
        if i > 0:
            token = first_max(logits[i - 1])
        scale = 1.0 / math.sqrt(d // n_head)
        p = length
        slot = length
        new_length = length + 1
        if bug == B.POSOFF:
            p = length - 1  # posoff
        elif bug == B.POSFROZEN:
            p = prefill_len  # posfrozen
        if bug == B.FREEZE and length > prefill_len:
            slot = length - 1  # freeze
            new_length = length
        lo = 0
        hi = slot + 1
        if bug == B.STALE:
            hi = slot  # stale
        elif bug == B.EVICT:
            lo = max(0, hi - window)  # evict
        elif bug == B.MASKFROZEN:
            hi = prefill_len + 1  # maskfrozen
        if bug == B.NOSCALE:
            scale = 1.0  # noscale
        heads = Heads(n_head, scale)
        tokens[0] = token
        positions[0] = p
        embed_into(w.wte, w.wpe, tokens, positions, fmt.storage, acts.x)  # x = wte[token] + wpe[p]
        for layer in range(w.g1.shape[0]):
            block_input_at(kern.block_input, kern, w, layer, eps, fmt, acts)  # h = rmsnorm(x) * g1; q, k, v
            if bug == B.KVSWAP:  # store the row's k, v at row slot of the layer's buffers
                _store_rows(kc[layer], slot, acts.v)  # kvswap
                _store_rows(vc[layer], slot, acts.k)
            else:
                _store_rows(kc[layer], slot, acts.k)
                _store_rows(vc[layer], slot, acts.v)
            keys = Keys(kc[layer], vc[layer], lo, hi)  # y = attention(q, k, v) over keys lo .. hi - 1
            if attn == STANDARD:
                row_at(kern.attention.row, acts.q, acts.y, no_att, row, keys, heads, fmt, work, kern.attention)
            else:
                blocks = Blocks(attn, attn_block, lo, hi)  # splitcount cuts the row's own keys
                blocked_at(kern.attention.blocked, acts.q, acts.y, row, keys, heads, fmt, blocks, work, kern.attention)
            block_output_at(kern.block_output, kern, w, layer, eps, fmt, acts)  # x = x_mid + silu(h2 @ w1) @ w2
        head_at(kern.head, kern, w, eps, fmt, acts.x, hf, acts.inv1, logits[i : i + 1])  # (rmsnorm(x) * gf) @ w_out
        length = new_length
    return length


@nb.njit(**JIT_OPTIONS, inline="always")
def first_max(row) -> int:
    """The index of ``row``'s first maximum, or of its first NaN: ``numpy.argmax``, the token a greedy step
    feeds (NumPy's own loop: a value not ``<=`` the best so far replaces it, and a NaN ends the scan). Inlined in
    :func:`decode_kernel`'s Numba IR (called, it was compiled on its own and optimised again there)."""
    best = row[0]
    at = 0
    if best != best:
        return 0
    for j in range(1, row.shape[0]):
        value = row[j]
        if not value <= best:
            best = value
            at = j
            if value != value:
                break
    return at


def decode_prepared(
    config: ModelConfig, w: Weights, cache: KVCache, token: int, numerics: Numerics, bug: int = B.NONE
) -> np.ndarray:
    """One decode step on prepared weights (no validation here); returns logits (vocab,)."""
    return decode_greedy_prepared(config, w, cache, token, 1, numerics, bug)[0]


def decode_greedy_prepared(
    config: ModelConfig, w: Weights, cache: KVCache, token: int, n: int, numerics: Numerics, bug: int = B.NONE
) -> np.ndarray:
    """``n`` greedy decode steps on prepared weights (no validation here; the cache has room for ``n``), in one
    compiled call: the first fed ``token``, each next the argmax (first maximum) of the step before's logits.
    Returns their logits ``(n, vocab)``, the rows :func:`decode_prepared` returns step by step."""
    logits = np.empty((n, config.vocab))
    length = cache.length
    new_length = decode_kernel(
        *w.leading_args(config, numerics), cache.k, cache.v, length, cache.prefill_len, token, bug, B.EVICT_WINDOW,
        logits,
    )  # fmt: skip
    cache.advance(new_length - length)
    return logits


def decode_step(
    config: ModelConfig,
    params: dict,
    cache: KVCache,
    token: int,
    pos: int,
    numerics: Numerics,
    bug: str | None = None,
) -> np.ndarray:
    """Logits ``(vocab,)`` of ONE new token at position ``pos`` over the cache, appending its K and V.

    ``pos`` must be the cache's next free position (``cache.length``). ``bug``
    selects a catalogue bug (:data:`kvfast.BUGS`) on this path.
    """
    config = require_config(config)
    numerics = require_numerics(numerics)
    code = B.bug_code(bug)
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: {type(cache).__name__} is not allowed; allowed: a KVCache")
    token = require_token(config, token)
    pos = require_int(pos, "pos")
    if pos >= config.max_pos:
        raise ValueError(f"pos: {pos} is out of range; allowed: integers in [0, {config.max_pos})")
    if cache.length == 0:
        raise ValueError("cache: empty; allowed: a cache filled by forward() (a prefill) first")
    if pos != cache.length:
        raise ValueError(f"pos: {pos} is not the cache's next position; allowed: {cache.length}")
    cache.require_fits(config, numerics, 1)
    w = Weights.cached(config, params, numerics)
    return decode_prepared(config, w, cache, token, numerics, code)


def generate(
    config: ModelConfig,
    params: dict,
    prompt,
    steps: int,
    numerics: Numerics,
    use_cache: bool = True,
    bug: str | None = None,
    decode_numerics: Numerics | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy generation of ``steps`` new tokens after ``prompt``.

    Returns ``(tokens, logits)``: the new tokens ``(steps,)`` and the logits that
    chose each of them ``(steps, vocab)``. Row 0 comes from the prompt's forward;
    row i >= 1 from decode step i (with the cache) or from a full recompute of
    the whole sequence (without). ``decode_numerics`` lets the decode steps
    run in another order, accumulator or attention kernel than the prefill
    (same storage).
    """
    config = require_config(config)
    numerics = require_numerics(numerics)
    decode_nx = numerics if decode_numerics is None else require_numerics(decode_numerics, "decode_numerics")
    prompt = require_tokens(config, prompt, field="prompt")
    steps = require_int(steps, "steps", 1)
    if prompt.shape[0] + steps - 1 > config.max_pos:
        raise ValueError(
            f"steps: {steps} after a prompt of {prompt.shape[0]} pass max_pos={config.max_pos}; "
            f"allowed: at most {config.max_pos - prompt.shape[0] + 1}"
        )
    code = B.bug_code(bug)
    if not use_cache and (code != B.NONE or decode_numerics is not None):
        raise ValueError("bug/decode_numerics: only allowed with use_cache=True")
    if decode_nx.storage != numerics.storage:
        raise ValueError(
            f"decode_numerics.storage: {decode_nx.storage!r} differs from numerics.storage "
            f"{numerics.storage!r}; allowed: the same storage (the cache is shared)"
        )
    w = Weights.cached(config, params, numerics)
    return generate_prepared(config, w, prompt, steps, numerics, use_cache, code, decode_nx)


def generate_prepared(
    config: ModelConfig,
    w: Weights,
    prompt: np.ndarray,
    steps: int,
    numerics: Numerics,
    use_cache: bool = True,
    bug: int = B.NONE,
    decode_numerics: Numerics | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`generate` on prepared weights and checked arguments."""
    logits = np.empty((steps, config.vocab))
    if use_cache:
        # the last token is chosen, never decoded: positions 0 .. P + steps - 2 are stored
        cache = KVCache.empty(config, numerics, prompt.shape[0] + steps - 1)
        logits[0] = forward_prepared(config, w, prompt, numerics, cache)[-1]
        if steps > 1:  # one compiled call: each step feeds the argmax of the one before (first_max: np.argmax)
            decode_nx = numerics if decode_numerics is None else decode_numerics
            token = int(np.argmax(logits[0]))
            logits[1:] = decode_greedy_prepared(config, w, cache, token, steps - 1, decode_nx, bug)
    else:
        seq = prompt
        for i in range(steps):
            logits[i] = forward_prepared(config, w, seq, numerics)[-1]
            seq = np.append(seq, np.argmax(logits[i]))
    tokens = np.argmax(logits, axis=1)
    return tokens, logits
