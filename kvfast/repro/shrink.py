"""Shrinking a finding: :func:`shrink_case` searches, greedily and within a time budget, for the smallest case
kvfast still calls ``bug``, one dimension at a time (delta debugging's one-at-a-time reduction):

1. the decode steps, cut to the first step that is a bug (at least one);
2. the prompt, one token at a time from its start, then from its end (a resume keeps two tokens);
3. the model: fewest layers (per-layer lists cut with them), the hidden size halved (its feed-forward width and
   head size with it), one attention head, one key/value head, the vocabulary halved (the tokens taken modulo
   it); each only where the architecture accepts it (transformers builds and runs the model);
4. the steps once more.

A candidate is kept only when kvfast's control check of it (:func:`kvfast.repro.case.check_case`, the injected
bug injected again) says ``bug`` in the case's scenario. The case has one scenario and the plainest cache the
model takes already (a ``DynamicCache``, or the model's own). A case whose weights travel as a file (not a seed)
keeps its model. :class:`Shrunk` says what shrank, what could not, and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from kvfast.repro.case import Case, case_adapter, check_case, find_case
from kvfast.validation import require_int

DEFAULT_SECONDS = 60.0
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
SMALLEST_HIDDEN = 8
SMALLEST_VOCAB = 16


@dataclass(frozen=True)
class Shrunk:
    """What :func:`shrink_case` found: the smallest ``case`` kept (kvfast calls it ``bug``), the steps that
    shrank it (``"layers 2 -> 1"``), the dimensions it could not shrink with the reason, the candidates checked,
    the seconds spent and whether the budget ran out first."""

    case: Case
    shrank: tuple[str, ...]
    not_shrunk: tuple[str, ...]
    tried: int
    seconds: float
    out_of_time: bool

    def lines(self) -> list[str]:
        out = [f"shrank: {'; '.join(self.shrank) or 'nothing'}"]
        out += [f"not shrunk: {why}" for why in self.not_shrunk]
        budget = " (the time budget ran out)" if self.out_of_time else ""
        out.append(f"{self.tried} candidates checked in {self.seconds:.1f} s{budget}")
        return out


def _first(config: dict, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if isinstance(config.get(k), int) and not isinstance(config.get(k), bool)), None)


def _with_layers(config: dict, n: int) -> dict | None:
    key = _first(config, LAYER_KEYS)
    old = config.get(key) if key else None
    if old is None or old <= n:
        return None
    out = {**config, key: n}
    for k, v in config.items():  # per-layer lists (layer_types, ...) keep their first n entries
        if isinstance(v, list) and len(v) == old:
            out[k] = v[:n]
    return out


def _heads(config: dict) -> int | None:
    key = _first(config, HEAD_KEYS)
    return config[key] if key else None


def _with_hidden(config: dict, hidden: int) -> dict | None:
    key = _first(config, HIDDEN_KEYS)
    heads = _heads(config)
    if key is None or config[key] <= hidden or (heads and hidden % heads):
        return None
    old = config[key]
    out = {**config, key: hidden}
    ffn = _first(config, FFN_KEYS)
    if ffn:
        out[ffn] = max(1, config[ffn] * hidden // old)
    if heads and config.get("head_dim") == old // heads:
        out["head_dim"] = hidden // heads
    return out


def _with_heads(config: dict, keys: tuple[str, ...], n: int) -> dict | None:
    key = _first(config, keys)
    if key is None or config[key] <= n:
        return None
    out = {**config, key: n}
    hidden = _first(config, HIDDEN_KEYS)
    if keys == HEAD_KEYS and hidden and config.get("head_dim") == config[hidden] // config[key]:
        out["head_dim"] = config[hidden] // n
    if keys == HEAD_KEYS:
        kv = _first(config, KV_KEYS)
        if kv and config[kv] > n:
            out[kv] = n
    return out


def _with_vocab(case: Case, vocab: int) -> Case | None:
    old = case.config.get("vocab_size")
    if not isinstance(old, int) or old <= vocab:
        return None
    config = {**case.config, "vocab_size": vocab}
    for key in TOKEN_ID_KEYS:
        if isinstance(config.get(key), int) and config[key] >= vocab:
            config[key] = 0
    return replace(
        case,
        config=config,
        prompt=tuple(t % vocab for t in case.prompt),
        tokens=tuple(t % vocab for t in case.tokens),
    )


def _candidates(case: Case, dim: str) -> Case | None:
    """The next smaller case along ``dim`` (``None``: none smaller)."""
    c = case.config
    if dim == "steps":
        keep = max(1, case.first_bug_step or 0)
        return replace(case, tokens=case.tokens[:keep]) if keep < case.steps else None
    least = 2 if case.scenario == "resume" else 1
    if dim in ("prompt start", "prompt end") and len(case.prompt) > least:
        prompt = case.prompt[1:] if dim == "prompt start" else case.prompt[:-1]
        return replace(case, prompt=prompt, split=None)
    if case.weights is not None:
        return None
    config = None
    if dim == "layers":
        config = _with_layers(c, 1)
    elif dim == "hidden size":
        key = _first(c, HIDDEN_KEYS)
        config = _with_hidden(c, c[key] // 2) if key and c[key] // 2 >= SMALLEST_HIDDEN else None
    elif dim == "heads":
        config = _with_heads(c, HEAD_KEYS, 1)
    elif dim == "key/value heads":
        config = _with_heads(c, KV_KEYS, 1)
    elif dim == "vocabulary":
        vocab = c.get("vocab_size")
        return _with_vocab(case, vocab // 2) if isinstance(vocab, int) and vocab // 2 >= SMALLEST_VOCAB else None
    return None if config is None else replace(case, config=config)


DIMENSIONS = ("steps", "prompt start", "prompt end", "layers", "hidden size", "heads", "key/value heads", "vocabulary")


def _size(case: Case, dim: str) -> str:
    c = case.config
    keys = {"layers": LAYER_KEYS, "hidden size": HIDDEN_KEYS, "heads": HEAD_KEYS, "key/value heads": KV_KEYS}
    if dim == "steps":
        return str(case.steps)
    if dim.startswith("prompt"):
        return f"{len(case.prompt)} tokens"
    if dim == "vocabulary":
        return str(c.get("vocab_size"))
    key = _first(c, keys[dim])
    return str(c.get(key)) if key else "-"


def _verdict(case: Case):
    """``(adapter, report)`` when kvfast calls ``case`` a ``bug``, else ``(None, why not)``."""
    try:
        adapter = case_adapter(case)
        report = check_case(case, adapter)
    except Exception as exc:  # noqa: BLE001 - the architecture refuses the candidate: not kept, and why
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    s = report.scenarios.get(case.scenario)
    if s is None or s.verdict != "bug":
        return None, f"kvfast calls it {s.verdict if s else report.verdict!r}"
    return (adapter, report), None


def shrink_case(case: Case, seconds: float = DEFAULT_SECONDS) -> Shrunk:
    """The smallest case kvfast still calls ``bug`` that the greedy search finds within ``seconds`` (see the
    module doc); ``ValueError`` for a case that is not a ``bug`` to begin with."""
    if case.verdict != "bug":
        raise ValueError(f"case: verdict {case.verdict!r} is not allowed; allowed: a case kvfast calls 'bug'")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"seconds: {seconds!r} is not allowed; allowed: a number > 0")
    start = time.monotonic()
    kept, found = case, None
    shrank: list[str] = []
    why: dict[str, str] = {}
    tried = 0
    progress = True
    out_of_time = False
    while progress and not out_of_time:
        progress = False
        for dim in DIMENSIONS:
            while True:
                if time.monotonic() - start > seconds:
                    out_of_time = True
                    break
                candidate = _candidates(kept, dim)
                if candidate is None:
                    break
                tried += 1
                result, reason = _verdict(candidate)
                if result is None:
                    why[dim] = f"{dim} {_size(kept, dim)} -> {_size(candidate, dim)}: {reason}"
                    break
                adapter, report = result
                step = report.scenarios[kept.scenario].first_bug_step
                shrank.append(f"{dim} {_size(kept, dim)} -> {_size(candidate, dim)}")
                kept, found = replace(candidate, first_bug_step=step, split=candidate.split), (adapter, report)
                why.pop(dim, None)
                progress = True
            if out_of_time:
                break
    if found is not None and kept.promote is not None:  # the logic check's case: checked again from its dtype
        kept = find_case(
            case_adapter(replace(kept, promote=None)), kept.prompt, kept.scenario, continuation=list(kept.tokens),
            seed=kept.seed, command=case.command, promote=kept.promote,
        )  # fmt: skip
    elif found is not None:  # the kept case measured again, as a case of its own (thresholds, deviations, drafts)
        adapter, report = found
        kept = find_case(
            adapter, kept.prompt, kept.scenario, continuation=list(kept.tokens), seed=kept.seed,
            command=case.command, report=report,
        )  # fmt: skip
    not_shrunk = [why[d] for d in DIMENSIONS if d in why]
    if case.weights is not None:
        not_shrunk.append("the model: its weights travel as a file (not a seed), so its sizes are kept")
    if out_of_time:
        not_shrunk.append(f"the search stopped at its budget of {seconds:g} s: smaller may exist")
    return Shrunk(kept, tuple(shrank), tuple(not_shrunk), tried, time.monotonic() - start, out_of_time)


def shrink_seconds(value) -> float:
    """``--repro-seconds``'s value checked (``ValueError`` naming it)."""
    return float(require_int(value, "--repro-seconds", 1))
