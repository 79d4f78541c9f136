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

:func:`shrink_apart` runs the search in a child process of its own (:mod:`kvfast.runtime.child`), killed
:data:`GRACE_S` after its budget: a candidate that hangs, or crashes its process (transformers on a config it
does not take), ends that process only, and the case is then kept as it was, with why. (A process per candidate
would pay torch's and transformers' imports, seconds each, for every candidate; one forked from a process that
has run torch deadlocks in OpenMP. The one process checks them in a row, as before.)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvfast.repro.case import ReproCase, case_adapter, check_case, find_case, torch_threads

DEFAULT_SECONDS = 60.0
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
SMALLEST_HIDDEN = 8
SMALLEST_VOCAB = 16
#: :func:`shrink_apart`: the seconds its process has after its budget (the candidate in flight, the kept case
#: measured again) before it is killed.
GRACE_S = 30.0


@dataclass(frozen=True)
class Shrunk:
    """What :func:`shrink_case` found: the smallest ``case`` kept (kvfast calls it ``bug``), the steps that
    shrank it (``"layers 2 -> 1"``), the dimensions it could not shrink with the reason, the candidates checked,
    the seconds spent and whether the budget ran out first; ``stopped``: why the search's process ended before
    its result (:func:`shrink_apart`: a candidate hung or crashed it), the case then the one it was given."""

    case: ReproCase
    shrank: tuple[str, ...]
    not_shrunk: tuple[str, ...]
    tried: int
    seconds: float
    out_of_time: bool
    stopped: str = ""

    def lines(self) -> list[str]:
        out = [f"shrank: {'; '.join(self.shrank) or 'nothing'}"]
        out += [f"not shrunk: {self.stopped}"] if self.stopped else []
        out += [f"not shrunk: {why}" for why in self.not_shrunk]
        budget = " (the time budget ran out)" if self.out_of_time else ""
        out.append(f"{self.tried} candidates checked in {self.seconds:.1f} s{budget}")
        return out


def _first(config: dict, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if isinstance(config.get(k), int) and not isinstance(config.get(k), bool)), None)


def _with_layers(config: dict) -> dict | None:
    """One layer (per-layer lists, ``layer_types`` and the like, keep their first entry)."""
    key = _first(config, LAYER_KEYS)
    if key is None or config[key] <= 1:
        return None
    lists = {k: v[:1] for k, v in config.items() if isinstance(v, list) and len(v) == config[key]}
    return {**config, key: 1, **lists}


def _with_hidden(config: dict) -> dict | None:
    """The hidden size halved, the feed-forward width and the head size with it."""
    key = _first(config, HIDDEN_KEYS)
    heads = config.get(_first(config, HEAD_KEYS))  # (None: no key holds them)
    hidden = config[key] // 2 if key else 0
    if hidden < SMALLEST_HIDDEN or (heads and hidden % heads):
        return None
    old = config[key]
    out = {**config, key: hidden}
    ffn = _first(config, FFN_KEYS)
    if ffn:
        out[ffn] = max(1, config[ffn] * hidden // old)
    if heads and config.get("head_dim") == old // heads:
        out["head_dim"] = hidden // heads
    return out


def _with_one(config: dict, keys: tuple[str, ...]) -> dict | None:
    """One attention head (the head size then the hidden size, at most one key/value head) or one key/value head."""
    key = _first(config, keys)
    if key is None or config[key] <= 1:
        return None
    out = {**config, key: 1}
    hidden, kv = _first(config, HIDDEN_KEYS), _first(config, KV_KEYS)
    if keys == HEAD_KEYS and hidden and config.get("head_dim") == config[hidden] // config[key]:
        out["head_dim"] = config[hidden]
    if keys == HEAD_KEYS and kv and config[kv] > 1:
        out[kv] = 1
    return out


def _with_vocab(case: ReproCase) -> ReproCase | None:
    """The vocabulary halved, the tokens taken modulo it (token ids past it set to 0)."""
    old = case.config.get("vocab_size")
    if not isinstance(old, int) or old // 2 < SMALLEST_VOCAB:
        return None
    vocab = old // 2
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


#: The model's dimensions: the config keys that hold each, and its next smaller config (``None``: none smaller).
MODEL_DIMENSIONS = {
    "layers": (LAYER_KEYS, _with_layers),
    "hidden size": (HIDDEN_KEYS, _with_hidden),
    "heads": (HEAD_KEYS, lambda config: _with_one(config, HEAD_KEYS)),
    "key/value heads": (KV_KEYS, lambda config: _with_one(config, KV_KEYS)),
}
DIMENSIONS = ("steps", "prompt start", "prompt end", *MODEL_DIMENSIONS, "vocabulary")


def _candidates(case: ReproCase, dim: str) -> ReproCase | None:
    """The next smaller case along ``dim`` (``None``: none smaller)."""
    if dim == "steps":
        keep = max(1, case.first_bug_step or 0)
        return replace(case, tokens=case.tokens[:keep]) if keep < case.steps else None
    if dim.startswith("prompt"):
        if len(case.prompt) <= (2 if case.scenario == "resume" else 1):
            return None
        return replace(case, prompt=case.prompt[1:] if dim == "prompt start" else case.prompt[:-1], split=None)
    if case.weights is not None:
        return None
    if dim == "vocabulary":
        return _with_vocab(case)
    config = MODEL_DIMENSIONS[dim][1](case.config)
    return None if config is None else replace(case, config=config)


def _size(case: ReproCase, dim: str) -> str:
    if dim == "steps":
        return str(case.steps)
    if dim.startswith("prompt"):
        return f"{len(case.prompt)} tokens"
    key = _first(case.config, MODEL_DIMENSIONS[dim][0] if dim in MODEL_DIMENSIONS else ("vocab_size",))
    return str(case.config[key]) if key else "-"


def _verdict(case: ReproCase):
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


def shrink_case(case: ReproCase, seconds: float = DEFAULT_SECONDS, trying=None) -> Shrunk:
    """The smallest case kvfast still calls ``bug`` that the greedy search finds within ``seconds`` (see the
    module doc); ``ValueError`` for a case that is not a ``bug`` to begin with. ``trying``: called with each
    candidate, in words (``"layers 2 -> 1"``), before it is checked."""
    if case.verdict != "bug":
        raise ValueError(f"case: verdict {case.verdict!r} is not allowed; allowed: a case kvfast calls 'bug'")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"seconds: {seconds!r} is not allowed; allowed: a number > 0")
    start = time.monotonic()
    kept, found, shrank, why, tried = case, None, [], {}, 0
    progress, out_of_time = True, False
    while progress and not out_of_time:
        progress = False
        for dim in DIMENSIONS:
            while not (out_of_time := time.monotonic() - start > seconds):
                candidate = _candidates(kept, dim)
                if candidate is None:
                    break
                tried += 1
                step = f"{dim} {_size(kept, dim)} -> {_size(candidate, dim)}"
                if trying is not None:
                    trying(step)
                result, reason = _verdict(candidate)
                if result is None:
                    why[dim] = f"{step}: {reason}"
                    break
                shrank.append(step)
                found = result
                kept = replace(candidate, first_bug_step=result[1].scenarios[kept.scenario].first_bug_step)
                why.pop(dim, None)
                progress = True
            if out_of_time:
                break
    if found is not None:  # the kept case measured again, as a case of its own (thresholds, deviations, drafts)
        # (the logic check's case: checked again from its dtype, so not from the report found in the promoted one)
        adapter, report = (case_adapter(replace(kept, promote=None)), None) if kept.promote is not None else found
        kept = find_case(
            adapter, kept.prompt, kept.scenario, continuation=list(kept.tokens), seed=kept.seed,
            command=case.command, report=report, promote=kept.promote,
        )  # fmt: skip
    not_shrunk = [why[d] for d in DIMENSIONS if d in why]
    if case.weights is not None:
        not_shrunk.append("the model: its weights travel as a file (not a seed), so its sizes are kept")
    if out_of_time:
        not_shrunk.append(f"the search stopped at its budget of {seconds:g} s: smaller may exist")
    return Shrunk(kept, tuple(shrank), tuple(not_shrunk), tried, time.monotonic() - start, out_of_time)


BOOT = (
    "import json, sys\n"
    "boot = json.loads(sys.argv[1])\n"
    "sys.path[:] = boot['path']\n"
    "from kvfast.repro.shrink import shrink_child\n"
    "shrink_child(boot)\n"
)


def shrink_apart(case: ReproCase, seconds: float = DEFAULT_SECONDS) -> Shrunk:
    """:func:`shrink_case` of ``case`` in a child process of its own (see the module doc), killed ``GRACE_S``
    after ``seconds`` (its imports not counted). Where that process hangs, crashes or fails, the result is
    ``case`` itself, its :attr:`Shrunk.stopped` saying why and which candidate it was checking."""
    import tempfile

    from kvfast.runtime.child import run_in_child

    if case.verdict != "bug":
        raise ValueError(f"case: verdict {case.verdict!r} is not allowed; allowed: a case kvfast calls 'bug'")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvfast-shrink-") as tmp:
        weights = None
        if case.weights is not None:
            import torch

            weights = os.path.join(tmp, "weights.pt")
            torch.save(case.weights, weights)
        progress = os.path.join(tmp, "trying.txt")
        request = {"case": case.to_json(), "weights": weights, "seconds": seconds, "progress": progress,
                   "threads": torch_threads()}  # fmt: skip
        outcome = run_in_child(BOOT, request, seconds + GRACE_S, grace=0.0)
        tried = Path(progress).read_text().splitlines() if os.path.exists(progress) else []
    result = outcome.result or {}
    if result.get("kind") == "shrunk":
        kept = ReproCase.from_json(result["case"])
        kept = replace(kept, weights=case.weights) if kept.seed is None else kept
        found = {k: tuple(v) if isinstance(v, list) else v for k, v in result.items() if k != "kind"}
        return Shrunk(**{**found, "case": kept})
    at = f" while checking the candidate {tried[-1]}" if tried else ""
    if outcome.timed_out:
        why = f"its process was still running {seconds + GRACE_S:g} s after it started{at}, and was killed"
    elif result.get("kind") == "error":
        why = f"its process failed{at}: {result['line']}"
    else:
        why = f"its process ended without a result ({outcome.ended()}){at}"
    return Shrunk(case, (), (), len(tried), time.monotonic() - start, outcome.timed_out, f"the search stopped: {why}")


def shrink_child(boot: dict) -> None:
    """The child process of :func:`shrink_apart`: torch, transformers and kvfast's checker imported before its
    clock starts, then :func:`shrink_case` of the request's case (each candidate appended to the request's
    ``progress`` file before it is checked); writes ``{"kind": "shrunk", ...}`` or ``{"kind": "error", "line"}``."""
    from kvfast.runtime.child import child_done, child_ready, child_started, read_request

    child_started(boot)
    import torch
    import transformers

    import kvfast.check.checker  # noqa: F401 - imported before the clock starts

    request = read_request(boot)
    case = ReproCase.from_json(request["case"])
    try:
        getattr(transformers, case.model_class)  # its module's import, before the clock starts too
    except Exception:  # noqa: BLE001, S110 - the first candidate then says why
        pass
    child_ready(boot)
    try:
        torch.set_num_threads(request["threads"])
        if request["weights"] is not None:
            case = replace(case, weights=torch.load(request["weights"], weights_only=True))
        with open(request["progress"], "a") as log:

            def trying(candidate: str) -> None:
                log.write(candidate + "\n")
                log.flush()

            shrunk = shrink_case(case, request["seconds"], trying)
        result = {"kind": "shrunk", **vars(shrunk), "case": shrunk.case.to_json()}
    except Exception as exc:  # noqa: BLE001 - one line for the parent, which keeps the case unshrunk
        result = {"kind": "error", "line": " ".join(f"{type(exc).__name__}: {exc}".split())[:300]}
    child_done(boot, result)
