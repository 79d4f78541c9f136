"""vLLM's cache bug catalogue scored against the checks people write (vLLM's own venv: extra ``kvfast[vllm]``).

    .venv-vllm/bin/python -m kvfast.studies.vllm_score [--steps 32] [--dtypes float32,bfloat16]

Not a registered study (like :mod:`kvfast.studies.op_score`, a command that prints a table): its cases need an
in-process vLLM engine, which lives in its own venv, and ``kvfast.studies`` imports this module in every venv, so
vLLM is imported only when a case runs.

Cases (:class:`VLLMCase`): the tiny random Llama (:func:`~kvfast.testing.tiny_vllm_model`, seed 1)
in vLLM, per dtype (``float32``, ``bfloat16``), per prompt (:data:`PROMPT_LENGTHS`: 40 tokens, where ``evict``
first acts at step 25 and ``hitpos`` never acts on a resume; 70 tokens, where each first acts at step 0 or 1),
per scenario (:data:`SCENARIOS`, how the cached path runs) and per bug of
:data:`kvfast.bugs.engine_bugs.VLLM_BUGS` or none (a clean control):

- ``decode``: one request: vLLM's prefill of the prompt, then its decode;
- ``resume``: the prompt's first half, then a new request over the whole prompt that reads the first half's full
  blocks from the prefix cache (a real prefix-cache hit), then decode;
- ``chunked``: the prefill chunked to :data:`CHUNK` tokens a scheduler step (vLLM's chunked prefill), then decode;
- ``preemption``: other requests (:func:`companions_for`) decoding in the same steps on an engine of
  :data:`KV_BLOCKS` KV blocks: the requests fit at their prefill, not to their end, and the scheduler preempts the
  cached path's request (the latest), which it later recomputes over its blocks still in the prefix cache.

**First acting step**, measured (:func:`acting_step`): the first step at which the case's cached rows differ from
the clean engine's in the same scenario (greedy: up to that step both fed the same tokens). For ``decode`` and
``resume`` it equals :func:`kvfast.bugs.engine_bugs.first_acting_step` (``tests/studies/test_vllm_score.py``). A
bugged case whose bug does not act within its steps is left out of the scores (it is a clean run) and shown as not
acting.

Detectors (:data:`DETECTORS`), each given the case's cached path:

- ``three_token_allclose``: three greedy tokens with the cache; decode step 1's logits against vLLM's own
  recompute of the same tokens, ``allclose(atol=rtol=1e-5)`` (kvfast's other tables' three-token check,
  :func:`kvfast.bugs.score.one_step_allclose`);
- ``vllm_logprobs``: vLLM's own test criterion (``check_logprobs_close`` in vLLM's ``tests/models/utils.py``; with
  one greedy logprob it fails where the same file's ``check_outputs_equal`` fails, which vLLM's prefix-caching
  tests run between a run with the cache and one without) with one logprob per step: ``steps + 1`` greedy tokens of
  the cached path against an uncached run (one plain ``LLM.generate`` of the prompt, ``logprobs=1``, reading no
  prefix cache, unchunked, alone in the engine); :func:`logprobs_close`. The uncached run here is clean: the bugs
  act on the cached path only, where in vLLM a decode bug would act in both runs, so this is the criterion at its
  most favourable;
- ``kvfast_exact``: :func:`kvfast.check_cache`, exact mode, the case's scenario (``decode`` or ``resume``; chunked
  prefill and preemption are the engine's setup); in ``bfloat16`` with ``gemm_rows=1`` (vLLM's CPU GEMMs choose
  their kernel by row count: docs/engines.md);
- ``kvfast_control``: control mode, vLLM as it runs; flags ``bug``; score: the largest ratio.

Prints the per-case table (the step each detector found each bug at, against its first acting step), then the
scores per dtype (:func:`kvfast.bugs.score.score_rows`: recall, median steps to detection, ROC AUC, FPR), pasted
into docs/engines.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvfast.bugs.engine_bugs import VLLM_BUGS, inject_vllm_bug
from kvfast.bugs.score import ONE_STEP_ATOL, ONE_STEP_RTOL, Detection, markdown, run_detector, score_rows, side_by_side
from kvfast.check.checker import check_cache
from kvfast.check.engines.vllm import BLOCK, DTYPES, VLLMModel
from kvfast.studies.common import tabled
from kvfast.validation import require_choice, require_int

SCENARIOS = ("decode", "resume", "chunked", "preemption")
PROMPT_LENGTHS = (40, 70)
#: Tokens per scheduler step of the ``chunked`` scenario's prefill.
CHUNK = 16
#: The ``preemption`` scenario's KV cache, in blocks of :data:`~kvfast.check.engines.vllm.BLOCK` tokens.
KV_BLOCKS = 13
STEPS = 32
_SALTS = itertools.count()


def prompt_of(length: int) -> list[int]:
    """The scored prompt of ``length`` tokens (token ids 3 .. 252, no special token)."""
    return [3 + i % 250 for i in range(length)]


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def companions_for(prompt_len: int, steps: int) -> int:
    """The other requests of the ``preemption`` scenario: the fewest that, with the cached path's, still fit in
    :data:`KV_BLOCKS` at their prefill but not ``steps + 1`` tokens later (each request is as long as the prompt);
    ``ValueError`` where no number does."""
    start, end = _blocks(prompt_len), _blocks(prompt_len + steps + 1)
    for others in range(1, KV_BLOCKS):
        if (others + 1) * start > KV_BLOCKS:
            break
        if (others + 1) * end > KV_BLOCKS:
            return others
    raise ValueError(
        f"steps: {steps} with a prompt of {prompt_len} is not allowed; allowed: a length whose requests fit in "
        f"{KV_BLOCKS} blocks at their prefill and outgrow them by their end"
    )


class Engines:
    """The vLLM engines the cases share (built on first use): one ``vllm.LLM`` per dtype, and one with
    :data:`KV_BLOCKS` blocks per dtype for the ``preemption`` scenario, over one tiny model directory."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self._built: dict[tuple[str, bool], VLLMModel] = {}

    def llm(self, dtype: str, small: bool = False):
        """The shared ``vllm.LLM`` of ``dtype`` (``small``: :data:`KV_BLOCKS` blocks)."""
        key = (require_choice(dtype, "dtype", DTYPES), bool(small))
        if key not in self._built:
            budget = {"kv_blocks": KV_BLOCKS} if small else {}
            self._built[key] = VLLMModel(self.model_dir, dtype=dtype, **budget)
        return self._built[key].llm


@dataclass(frozen=True, eq=False)
class VLLMCase:
    """One scored case (:class:`kvfast.bugs.score.Case`): ``config`` (``dtype``, ``scenario``, ``prompt_len``,
    ``steps``), a bug of :data:`VLLM_BUGS` (``None``: clean) and the shared engines."""

    config: dict
    bug: str | None
    engines: Engines = field(repr=False)

    @property
    def steps(self) -> int:
        return int(self.config["steps"])

    @property
    def prompt(self) -> np.ndarray:
        return np.asarray(prompt_of(int(self.config["prompt_len"])), dtype=np.int64)

    @property
    def scenario(self) -> str:
        return self.config["scenario"]

    @property
    def checker_scenario(self) -> str:
        """The checker's scenario (``resume`` or ``decode``; chunked prefill and preemption are engine setups)."""
        return "resume" if self.scenario == "resume" else "decode"

    def model(self, bug: str | None | bool = True, **options) -> VLLMModel:
        """A fresh adapter over the shared engine in the case's scenario, with the case's bug (``bug=None``:
        clean; a name: that bug) and further :class:`VLLMModel` ``options``."""
        c = self.config
        small = self.scenario == "preemption"
        if self.scenario == "chunked":
            options["prefill_chunk"] = CHUNK
        if small:
            options["companions"] = companions_for(int(c["prompt_len"]), self.steps)
        options.setdefault("speculate", self.steps + 1)  # the whole generation is one request of vLLM's
        adapter = VLLMModel(self.engines.llm(c["dtype"], small), **options)
        return inject_vllm_bug(adapter, self.bug if bug is True else bug)


def cases(engines: Engines, dtypes=DTYPES, steps: int = STEPS) -> list[VLLMCase]:
    """Every dtype x scenario (:data:`SCENARIOS`) x prompt (:data:`PROMPT_LENGTHS`) x (clean and each bug of
    :data:`VLLM_BUGS`)."""
    steps = require_int(steps, "steps", 1)
    out = []
    for dtype, scenario, length in itertools.product(dtypes, SCENARIOS, PROMPT_LENGTHS):
        config = {"dtype": require_choice(dtype, "dtypes", DTYPES), "scenario": scenario, "prompt_len": length,
                  "steps": steps}  # fmt: skip
        out += [VLLMCase(config, bug, engines) for bug in (None, *VLLM_BUGS)]
    return out


# --- the cached path ------------------------------------------------------------------------------------------


def cached_rows(model: VLLMModel, case: VLLMCase, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """The case's cached path, greedy, ``steps`` decode steps: (tokens chosen, rows per step). Step 0's rows are
    the prompt's (``resume``: the resumed chunk's), step ``t`` the one row of decode step ``t``; token ``t`` is
    chosen from step ``t``'s last row."""
    prompt = case.prompt
    if case.scenario == "resume":
        split = len(prompt) // 2  # the checker's default split
        model.prefill(prompt[:split])
        rows = [np.asarray(model.extend(prompt[split:]))]
    else:
        rows = [np.asarray(model.prefill(prompt))]
    tokens = [int(np.argmax(rows[0][-1]))]
    for _ in range(steps):
        rows.append(np.asarray(model.decode(tokens[-1])).reshape(1, -1))
        tokens.append(int(np.argmax(rows[-1][-1])))
    return tokens, rows


def acting_step(case: VLLMCase) -> tuple[int | None, int]:
    """The first step at which the case's bug changes its cached rows (against the clean engine's, same scenario;
    ``None``: not within ``case.steps``), and the preemptions of the clean cached path's requests."""
    clean = case.model(bug=None)
    _, reference = cached_rows(clean, case, case.steps)
    if case.bug is None:
        return None, clean.preemptions
    _, rows = cached_rows(case.model(), case, case.steps)
    for step, (a, b) in enumerate(zip(rows, reference, strict=True)):
        if not np.array_equal(a, b):
            return step, clean.preemptions
    return None, clean.preemptions


# --- the detectors --------------------------------------------------------------------------------------------


def three_token_allclose(model: VLLMModel, case: VLLMCase) -> Detection:
    """Three greedy tokens of the cached path; decode step 1's logits against vLLM's recompute of the same
    tokens, ``allclose(atol=rtol=1e-5)``; score: the largest deviation at step 1."""
    tokens, rows = cached_rows(model, case, 2)
    reference = np.asarray(model.recompute(np.append(case.prompt, tokens[0])))[-1]
    close = np.allclose(rows[1][-1], reference, atol=ONE_STEP_ATOL, rtol=ONE_STEP_RTOL)
    return Detection(not close, float(np.abs(rows[1][-1] - reference).max()), None if close else 1)


def logprobs_close(tokens_0, top_0, tokens_1, top_1) -> int | None:
    """vLLM's ``check_logprobs_close`` (its ``tests/models/utils.py``), sample logprobs, as a step: the two
    generations agree up to their first differing token; there, each must have chosen a token among the other's
    top logprobs, and the comparison stops (the sequences diverge from there). Returns the first step that fails
    (``None``: it passes). ``top_i[t]``: the token ids of generation ``i``'s logprobs at step ``t`` (vLLM returns
    the top ``logprobs`` and the sampled token)."""
    for step, (a, b) in enumerate(zip(tokens_0, tokens_1, strict=False)):
        if a != b:
            return None if a in top_1[step] and b in top_0[step] else step
    return None


def uncached_run(model: VLLMModel, case: VLLMCase, n: int) -> tuple[list[int], list[set[int]]]:
    """vLLM's plain greedy generation of ``n`` tokens from the case's prompt with ``logprobs=1``, reading no
    prefix cache, unchunked, alone in the engine (the cached path's bug hook does not act in it): (tokens, the
    token ids of each step's logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True,
                            skip_reading_prefix_cache=True)  # fmt: skip
    prompt = TokensPrompt(prompt_token_ids=case.prompt.tolist(), cache_salt=f"kvfast-uncached-{next(_SALTS)}")
    out = model.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [set(step) for step in out.logprobs]


def vllm_logprobs(model: VLLMModel, case: VLLMCase) -> Detection:
    """vLLM's test criterion (:func:`logprobs_close`) with one logprob per step: ``steps + 1`` greedy tokens of
    the cached path against an uncached run; flags the first failing step; score: 1 if it fails, else 0."""
    n = case.steps + 1
    plain, plain_top = uncached_run(model, case, n)  # first: no request of the cached path is in the engine
    tokens, _ = cached_rows(model, case, n - 1)
    step = logprobs_close(tokens, [{t} for t in tokens], plain, plain_top)  # greedy: top-1 is the token chosen
    return Detection(step is not None, float(step is not None), step)


def kvfast_exact(model: VLLMModel, case: VLLMCase) -> Detection:
    """:func:`kvfast.check_cache`, exact mode, the case's scenario, on one thread (``threads=1``: vLLM's split-KV
    decode attention, on more threads, sums in another order than its prefill; exact mode judges the cache) and in
    ``bfloat16`` with ``gemm_rows=1``; score: the largest deviation."""
    model = case.model(threads=1, **({"gemm_rows": 1} if case.config["dtype"] == "bfloat16" else {}))
    report = check_cache(model, case.prompt, case.steps, mode="exact", scenarios=(case.checker_scenario,))
    return Detection(not report.passed, report.max_deviation, report.first_divergent_step)


def kvfast_control(model: VLLMModel, case: VLLMCase) -> Detection:
    """Control mode, the case's scenario; flags a ``bug`` verdict; score: the largest ratio."""
    report = check_cache(model, case.prompt, case.steps, mode="control", scenarios=(case.checker_scenario,))
    return Detection(report.verdict == "bug", float(report.max_ratio or 0.0), report.first_bug_step)


DETECTORS: dict[str, Callable] = {  # each under its function's name
    fn.__name__: fn for fn in (three_token_allclose, vllm_logprobs, kvfast_exact, kvfast_control)
}


# --- the tables -----------------------------------------------------------------------------------------------

KEYS = ["dtype", "scenario", "prompt_len", "bug"]


def detections(all_cases: list[VLLMCase], detectors: dict[str, Callable] | None = None) -> pd.DataFrame:
    """One row per case: its config, ``bug`` (``"none"``: clean), ``acts`` (:func:`acting_step`; ``None``: not
    within its steps), ``preemptions`` (the clean cached path's), and per detector ``<name>.flag``, ``.score``
    and ``.step``."""
    detectors = DETECTORS if detectors is None else detectors
    rows = []
    for case in all_cases:
        acts, preempted = acting_step(case)
        rows.append({**case.config, "bug": case.bug or "none", "acts": acts, "preemptions": preempted})
    table = pd.DataFrame(rows)
    for name, detector in detectors.items():
        found = run_detector(detector, all_cases, tuple(VLLM_BUGS))
        for col in ("flag", "score", "step"):
            table[f"{name}.{col}"] = found[col].to_numpy()
    return table


def _names(table: pd.DataFrame) -> list[str]:
    return [c[: -len(".flag")] for c in table.columns if c.endswith(".flag")]


def _detections(runs: pd.DataFrame, name: str) -> pd.DataFrame:
    """Detector ``name``'s columns of ``runs`` as :func:`~kvfast.bugs.score.score_rows` takes them."""
    return runs.rename(columns={f"{name}.{c}": c for c in ("flag", "score", "step")})[["bug", "flag", "score", "step"]]


@tabled()
def scores(table: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """Per dtype, :func:`~kvfast.bugs.score.score_rows` of each detector over the cases whose bug acts and the
    clean controls, side by side (:func:`~kvfast.bugs.score.side_by_side`), with a ``dtype`` column first."""
    for dtype, group in table.groupby("dtype", sort=False):
        scored = group[(group["bug"] == "none") | group["acts"].notna()]
        joined = side_by_side({name: score_rows(_detections(scored, name), tuple(VLLM_BUGS)) for name in _names(table)})
        joined.insert(1, "dtype", dtype)
        yield joined


@tabled()
def on_time(table: pd.DataFrame) -> Iterator[dict]:
    """Per dtype and detector: the acting cases, those found, and those found at their first acting step."""
    for dtype, group in table.groupby("dtype", sort=False):
        acting = group[(group["bug"] != "none") & group["acts"].notna()]
        for name in _names(table):
            found = acting[acting[f"{name}.flag"].astype(bool)]
            timely = found[found[f"{name}.step"].astype(float) == found["acts"].astype(float)]
            yield {"dtype": dtype, "detector": name, "acting cases": len(acting), "found": len(found),
                   "at the first acting step": len(timely)}  # fmt: skip


def _step(flag, step) -> str:
    if not flag:
        return "-"
    return "found" if step is None or pd.isna(step) else str(int(step))


def _cell(rows: list[pd.Series], value: Callable[[pd.Series], str]) -> str:
    """``value`` of each dtype's row: one value where they agree, else each, joined by `` / ``."""
    values = [value(r) for r in rows]
    return values[0] if len(set(values)) == 1 else " / ".join(values)


def case_markdown(table: pd.DataFrame) -> str:
    """The per-case table, one row per scenario, prompt and bug: each detector's step (``-``: not flagged)
    against the bug's first acting step (``-``: it does not act within the steps); a cell where the dtypes differ
    gives each (``float32 / bfloat16``). Clean controls are left out (their flags are the scores' FPR)."""
    names = _names(table)
    dtypes = list(dict.fromkeys(table["dtype"]))
    bugged = table[table["bug"] != "none"]
    head = "| scenario | prompt | bug | first acting step | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    for (scenario, length, bug), group in bugged.groupby(["scenario", "prompt_len", "bug"], sort=False):
        by_dtype = group.set_index("dtype")
        cell = functools.partial(_cell, [by_dtype.loc[d] for d in dtypes if d in by_dtype.index])
        if scenario == "preemption":
            scenario += f" ({cell(lambda r: str(int(r['preemptions'])))} preempted)"
        cells = [scenario, str(length), bug, cell(lambda r: "-" if pd.isna(r["acts"]) else str(int(r["acts"])))]
        cells += [cell(lambda r, n=n: _step(r[f"{n}.flag"], r[f"{n}.step"])) for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def on_time_markdown(table: pd.DataFrame) -> str:
    lines = ["| dtype | detector | acting cases | found | found at the first acting step |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in on_time(table).itertuples(index=False)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: float32, bfloat16")
    args = ap.parse_args(argv)
    dtypes = [require_choice(d.strip(), "dtypes", DTYPES) for d in args.dtypes.split(",")]
    from kvfast.testing import tiny_vllm_model

    with tempfile.TemporaryDirectory() as out:
        engines = Engines(tiny_vllm_model(out, seed=1))
        table = detections(cases(engines, dtypes, args.steps))
    print(f"vLLM bugs, tiny Llama (seed 1), prompts {', '.join(map(str, PROMPT_LENGTHS))}, {args.steps} steps")
    print()
    print(f"Per case (a cell that differs between dtypes: {' / '.join(dtypes)}):")
    print()
    print(case_markdown(table))
    print()
    print(markdown(scores(table)))
    print()
    print(on_time_markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
