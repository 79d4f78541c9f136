"""The cache operations real inference stacks use, as scenarios: ``rollback`` and ``fork``.

Each is defined by what it must equal: a full recompute of the tokens the cache logically holds.
Both feed ``decode`` the same tokens as the ``decode`` scenario (the shared tokens, or the cache's
own greedy ones with ``follow="cache"``), so step ``t`` is still position ``T + t - 1`` and is judged
against the same reference rows, by the same verdict machinery, in the same per-step table.

``rollback`` (speculative decoding, assisted generation; the model's ``crop(n)`` hook: keep the first
``n`` positions). Before decode step ``t = 1, 1 + ROLLBACK_EVERY, ...`` the cache takes ``k`` draft
tokens (``k`` cycles through :data:`DRAFTS`; tokens the shared text does not hold), then
``crop(T + t - 1)`` drops them again and step ``t`` decodes the kept token. Right after the prefill
the scenario calls ``crop(T)``, a rollback of nothing, where a model may prepare for rollbacks (a Hugging
Face cache starts recording its past there, as ``generate`` does after its prefill). Every step after a
rollback must equal the recompute of the kept prefix plus the tokens after it: a crop that keeps one
draft too many shows at the first step after the first rollback. The drafts' own logits are not judged.

``fork`` (prefix caching, parallel sampling, a prompt reused; the hooks ``snapshot() -> state`` and
``restore(state)``). Prefill, ``s0 = snapshot()``; decode steps ``1..h`` (``h = steps // 2``),
``sh = snapshot()``; ``restore(s0)`` and decode a second branch of ``m = max(1, h)`` other tokens;
``restore(sh)`` and decode steps ``h + 1..steps``. Two reports: ``fork`` (the first branch: steps after
``h`` show whether the second branch changed it) and ``fork-branch`` (the second branch against the
recompute of the prompt plus its own tokens; control mode judges it against the run's pooled relative
order noise, the level every position can reach). A snapshot that shares the key buffer with the live
cache shows at step ``h + 1``.

A model without the hooks gets the scenario reported as ``skipped`` with a note, as does a model whose
hook raises ``NotImplementedError`` (a cache kind that cannot roll back: the note names the call and
the reason); any other exception of the model's is :class:`~kvfast.check.protocol.ModelUnderTestError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvfast.check.cache_path import OPERATION_PATHS, CachePath, Unsupported
from kvfast.check.calls import ModelCalls
from kvfast.check.protocol import ModelUnderTestError
from kvfast.check.reference import Reference, SharedReference, per_step_rows
from kvfast.check.report import ScenarioReport
from kvfast.check.subject import CheckSubject

#: The hooks each operation scenario needs (optional methods of the protocol).
HOOKS: dict[str, tuple[str, ...]] = {
    "rollback": ("crop",), "fork": ("snapshot", "restore"), "reorder": ("prefill_beams", "decode_beams", "reorder"),
    "padded": ("prefill_padded", "decode_padded"),
}  # fmt: skip
#: Decode steps between two rollbacks (the first rollback comes before step 1).
ROLLBACK_EVERY = 4
#: Draft tokens taken before each rollback, in turn.
DRAFTS = (1, 2, 3)
BRANCH = "fork-branch"  # the name of the fork scenario's second branch's report
#: The report of each operation's second branch (the fork's other branch, the reorder's other beam).
BRANCHES = {"fork": BRANCH, "reorder": "reorder-beam", "padded": "padded-row"}
#: Decode steps before which the reorder scenario swaps its two beams (beam index ``[1, 0]``).
REORDER_EVERY = 4


@dataclass(frozen=True)
class OperationRun:
    """One run of an operation's cache path: ``path`` (the judged branch, as a
    :class:`~kvfast.check.cache_path.CachePath`), ``notes`` (what the run did), ``branch`` (the fork's
    second branch, else ``None``). Has CachePath's fields, so the reference's fast path can run it."""

    path: CachePath
    notes: tuple[str, ...]
    branch: CachePath | None = None

    @property
    def prompt_rows(self) -> np.ndarray:
        return self.path.prompt_rows

    @property
    def decoded(self) -> np.ndarray:
        return self.path.decoded

    @property
    def fed(self) -> np.ndarray:
        return self.path.fed

    def logits(self) -> np.ndarray:
        return self.path.logits()


Choose = Callable[[int, np.ndarray], int]


def check_operation(
    subject: CheckSubject, reference: Reference, name: str, fmt: str, judge_scenario: Callable
) -> dict[str, ScenarioReport]:
    """Operation scenario ``name`` (``rollback``, ``fork``) run and judged by ``judge_scenario`` (the
    scenarios' own, :func:`kvfast.check.scenarios.judge_scenario`): ``{report name: report}``. Skipped
    (with a note) when the model lacks a hook or a hook raises ``NotImplementedError``."""
    missing = [h for h in HOOKS[name] if not subject.calls.has(h)]
    if missing:
        hooks = " and ".join(f"{h}()" for h in missing)
        return {name: skipped(name, subject, reference.skipped_tokens, f"the model has no {hooks}")}
    try:
        run = _run(subject, reference, name)
    except Unsupported as exc:
        return {name: skipped(name, subject, reference.skipped_tokens, str(exc))}
    notes, branch = run.notes, run.branch
    rows = reference.rows_for(name, run)
    reports = {name: _judged(subject, name, run, rows, reference.noise, fmt, notes, judge_scenario)}
    if branch is not None:
        # the padded batch's other row has a prompt of its own
        sub_b = replace(subject, prompt=padded_prompt(subject.prompt, subject.vocab)) if name == "padded" else subject
        rows_b = _branch_rows(sub_b, reference, branch)
        noise_b = _pooled_noise_for(reference.noise, rows, rows_b)
        note = (
            f"the second branch: {branch.fed.shape[0]} tokens decoded from the prompt's snapshot, against the "
            "recompute of the prompt plus its own tokens"
            if name == "fork"
            else "the second beam: its own tokens, against the recompute of the prompt plus them"
            if name == "reorder"
            else "the padded batch's other row: its own prompt and tokens, against their unpadded recompute"
        )
        if noise_b is not None:
            note += "; its order noise is the run's pooled relative noise at this branch's magnitudes"
        other = BRANCHES[name]
        reports[other] = _judged(sub_b, other, branch, rows_b, noise_b, fmt, (note,), judge_scenario)
    return reports


def _run(subject: CheckSubject, reference: Reference, name: str) -> OperationRun:
    """``name``'s run: the reference's fast-path run when it was this operation's and fed the shared tokens."""
    if isinstance(reference, SharedReference) and reference.reuse_scenario == name:
        if isinstance(reference.reuse, OperationRun):
            return reference.reuse
    return OPERATION_PATHS[name](subject.calls, subject.prompt, subject.steps, _chooser(reference))


def _judged(subject, name, run, rows, noise, fmt, notes, judge) -> ScenarioReport:
    report = judge(subject, name, run, rows, noise, fmt)
    report = replace(report, notes=report.notes + tuple(notes))
    if subject.options.keep_logits:
        report = replace(report, cache_logits=run.logits(), reference=rows.copy())
    return report


def _chooser(reference: Reference) -> Choose:
    """The tokens fed to ``decode``: the shared ones, or (``follow="cache"``) the cache's own greedy ones."""
    if isinstance(reference, SharedReference):
        tokens = reference.tokens
        return lambda t, out: int(tokens[t])
    return lambda t, out: int(np.argmax(out))


def skipped(name: str, subject: CheckSubject, tokens: np.ndarray, why: str) -> ScenarioReport:
    """Scenario ``name``'s report when it cannot run on this model: ``skipped``, ``why`` as its note."""
    return ScenarioReport(
        name, subject.options.mode, subject.prompt, tokens, np.zeros(0), (), "skipped", None, None, notes=(why,)
    )


def _hook(calls: ModelCalls, name: str, *args):
    """``model.<name>(*args)``; a missing hook or a ``NotImplementedError`` from it becomes :class:`Unsupported`."""
    if not calls.has(name):
        raise Unsupported(f"the model has no {name}()")
    try:
        return getattr(calls.model, name)(*args)
    except ModelUnderTestError as exc:
        if isinstance(exc.error, NotImplementedError):
            raise Unsupported(f"{exc.where} is not supported by this model: {exc.error}") from exc
        raise


def draft_tokens(next_token: int, k: int, vocab: int) -> np.ndarray:
    """``k`` draft tokens that are not the kept text: from ``next_token + 1`` on, modulo ``vocab``."""
    return (next_token + 1 + np.arange(k, dtype=np.int64) * 7) % vocab


def rollback_points(steps: int) -> list[int]:
    """The decode steps before which the rollback scenario drafts and crops."""
    return list(range(1, steps + 1, ROLLBACK_EVERY))


def rollback_path(calls: ModelCalls, prompt: np.ndarray, steps: int, choose: Choose) -> OperationRun:
    """The rollback scenario's cache path (see the module doc)."""
    T = prompt.shape[0]
    first = calls.prefill(prompt, "of the prompt")
    _hook(calls, "crop", T)  # a rollback of nothing: where a model may prepare for rollbacks (HF: generate's way)
    decoded = np.empty((steps, calls.vocab))
    fed = np.empty(steps, dtype=np.int64)
    points = rollback_points(steps)
    last = first[-1]
    for t in range(1, steps + 1):
        tok = int(choose(t - 1, last))
        fed[t - 1] = tok
        if t in points:
            k = DRAFTS[points.index(t) % len(DRAFTS)]
            for i, d in enumerate(draft_tokens(tok, k, calls.vocab)):
                calls.decode(int(d), f"of draft token {i + 1} of {k} before step {t} (rollback)")
            _hook(calls, "crop", T + t - 1)
        last = calls.decode(tok, f"at step {t} (position {T + t - 1})")
        decoded[t - 1] = last
    shown = ", ".join(map(str, points[:6])) + (", ..." if len(points) > 6 else "")
    note = (
        f"{len(points)} rollbacks: before steps {shown} the cache took {min(DRAFTS)}-{max(DRAFTS)} draft tokens "
        "and crop(n) kept the first n positions again; each step equals the recompute of the kept prefix and "
        "the tokens after it"
    )
    return OperationRun(CachePath(first, decoded, fed), (note,))


def fork_paths(calls: ModelCalls, prompt: np.ndarray, steps: int, choose: Choose) -> OperationRun:
    """The fork scenario's two branches (see the module doc): the first (all ``steps``) and the second."""
    T = prompt.shape[0]
    h, m = steps // 2, max(1, min(steps, steps // 2))
    first = calls.prefill(prompt, "of the prompt")
    at_prompt = _hook(calls, "snapshot")
    decoded = np.empty((steps, calls.vocab))
    fed = np.empty(steps, dtype=np.int64)
    last = first[-1]

    def run(t0: int, t1: int) -> None:
        nonlocal last
        for t in range(t0, t1 + 1):
            fed[t - 1] = tok = int(choose(t - 1, last))
            last = decoded[t - 1] = calls.decode(tok, f"at step {t} (position {T + t - 1})")

    run(1, h)
    at_h = _hook(calls, "snapshot")
    _hook(calls, "restore", at_prompt)
    other = draft_tokens(int(choose(0, first[-1])), m, calls.vocab)
    where = [f"at step {i + 1} of the second branch (position {T + i})" for i in range(m)]
    branch = np.stack([calls.decode(int(tok), at) for tok, at in zip(other, where, strict=True)])
    _hook(calls, "restore", at_h)
    run(h + 1, steps)
    note = (
        f"snapshot after the prompt and after step {h}; a second branch of {m} tokens ran from the prompt's "
        f"snapshot, then restore() went back to step {h}: steps {h + 1}-{steps} show whether it changed this branch"
    )
    return OperationRun(CachePath(first, decoded, fed), (note,), CachePath(first, branch, other))


def _branch_rows(subject: CheckSubject, reference: Reference, branch: CachePath) -> np.ndarray:
    """The reference rows of the fork's second branch: one recompute of its sequence (fast or control), else
    one recompute per step (the reference found the recompute not append-invariant in exact mode)."""
    calls, prompt = subject.calls, subject.prompt
    seq = np.concatenate([prompt, branch.fed])
    per_step = subject.options.mode == "exact" and (not subject.options.fast or reference.path == "per-step")
    if not per_step:
        return calls.recompute(seq, "of the fork's second branch")
    T = prompt.shape[0]
    rows = np.empty((seq.shape[0], subject.vocab))
    rows[:T] = calls.recompute(prompt, "of the prompt")
    per_step_rows(calls, prompt, rows, branch.fed.copy(), T, greedy=False)
    return rows


def _pooled_noise_for(
    noise: dict[str, np.ndarray] | None, rows: np.ndarray, rows_b: np.ndarray
) -> dict[str, np.ndarray] | None:
    """Control mode: each noise source's largest relative draw over the run, at the branch's magnitudes."""
    if noise is None:
        return None
    scale = np.abs(rows).max(axis=1)
    safe = np.where(scale > 0, scale, np.inf)
    scale_b = np.abs(rows_b).max(axis=1)
    return {k: float((v / safe).max()) * scale_b for k, v in noise.items()}


def reorder_points(steps: int) -> list[int]:
    """The decode steps before which the reorder scenario swaps its beams (never before step 2: both beams
    hold the prompt alone until then, and a swap would change nothing)."""
    return list(range(2, steps + 1, REORDER_EVERY))


def reorder_path(calls: ModelCalls, prompt: np.ndarray, steps: int, choose: Choose) -> OperationRun:
    """The reorder scenario (beam search): two beams, the first fed the shared tokens, the second others;
    before each of :func:`reorder_points` the cache is reordered by ``[1, 0]`` and the beams swap slots.
    Each beam is judged along its own lineage (its rows, whichever slot computed them)."""
    from kvfast.check.protocol import check_logits

    T, V = prompt.shape[0], calls.vocab
    raw = _hook(calls, "prefill_beams", prompt.copy(), 2)
    first = [check_logits(raw[b], "prefill_beams", T, V, f"beam {b} of the prompt") for b in range(2)]
    rows = np.empty((2, steps, V))
    fed = np.empty((2, steps), dtype=np.int64)
    slot = [0, 1]  # slot[beam]: the batch row holding the beam's cache
    last = first[0][-1]
    points = reorder_points(steps)
    for t in range(1, steps + 1):
        fed[0, t - 1] = int(choose(t - 1, last))
        fed[1, t - 1] = int(draft_tokens(int(fed[0, t - 1]), 1, V)[0])
        if t in points:
            _hook(calls, "reorder", np.array([1, 0], dtype=np.int64))
            slot = [1 - s for s in slot]
        batch = np.empty(2, dtype=np.int64)
        batch[slot[0]], batch[slot[1]] = fed[0, t - 1], fed[1, t - 1]
        out = check_logits(_hook(calls, "decode_beams", batch), "decode_beams", 2, V, f"at step {t}")
        rows[0, t - 1], rows[1, t - 1] = out[slot[0]], out[slot[1]]
        last = rows[0, t - 1]
    shown = ", ".join(map(str, points[:6])) + (", ..." if len(points) > 6 else "")
    note = f"two beams; the cache reordered by [1, 0] (the beams swap slots) before steps {shown}"
    return OperationRun(CachePath(first[0], rows[0], fed[0]), (note,), CachePath(first[1], rows[1], fed[1]))


def padded_prompt(prompt: np.ndarray, vocab: int) -> np.ndarray:
    """The padded scenario's other prompt: two tokens shorter than ``prompt`` (two longer for a prompt of one
    or two tokens), so one of the rows is left-padded."""
    T = prompt.shape[0]
    n = T - 2 if T > 2 else T + 2
    return (prompt[np.arange(n) % T] * 3 + 1 + np.arange(n)) % vocab


def padded_path(calls: ModelCalls, prompt: np.ndarray, steps: int, choose: Choose) -> OperationRun:
    """The padded scenario (batched generation): ``prompt`` and :func:`padded_prompt` as one left-padded batch
    (mask and positions as ``generate`` builds them), then one token per row per step; each row is judged
    against its own unpadded recompute."""
    from kvfast.check.protocol import check_logits

    V = calls.vocab
    other = padded_prompt(prompt, V)
    raw = _hook(calls, "prefill_padded", [prompt.copy(), other.copy()])
    first = [check_logits(raw[i], "prefill_padded", p.shape[0], V, f"row {i}") for i, p in enumerate((prompt, other))]
    rows = np.empty((2, steps, V))
    fed = np.empty((2, steps), dtype=np.int64)
    last = first[0][-1]
    for t in range(1, steps + 1):
        fed[0, t - 1] = int(choose(t - 1, last))
        fed[1, t - 1] = int(draft_tokens(int(fed[0, t - 1]), 1, V)[0])
        out = check_logits(_hook(calls, "decode_padded", fed[:, t - 1].copy()), "decode_padded", 2, V, f"at step {t}")
        rows[:, t - 1] = out
        last = rows[0, t - 1]
    pad = abs(prompt.shape[0] - other.shape[0])
    row = "second" if other.shape[0] < prompt.shape[0] else "first"
    note = (
        f"a left-padded batch of two prompts ({prompt.shape[0]} and {other.shape[0]} tokens; the {row} row has "
        f"{pad} pads), mask and positions as generate builds them"
    )
    return OperationRun(CachePath(first[0], rows[0], fed[0]), (note,), CachePath(first[1], rows[1], fed[1]))


OPERATION_PATHS.update(rollback=rollback_path, fork=fork_paths, reorder=reorder_path, padded=padded_path)
