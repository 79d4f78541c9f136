"""One finding as data: :class:`ReproCase` (the tiny model, the scenario, the tokens, how the model is called, the
injected bug if any, and what kvfast measured), made from a Hugging Face model by :func:`find_case` and
checked again by :func:`check_case`.

A case names everything a standalone script needs to rebuild the finding without kvfast: the model's class and
its config as a dict (``AutoConfig.for_model(**config)``), the weight seed (or, where the weights are not those
of ``torch.manual_seed(seed)`` followed by ``_from_config``, their state dict beside the script), the dtype and
attention implementation, the scenario's tokens (the prompt, the token fed at each decode step, the resume
split, the rollback's drafts) and the way the model's own ``generate`` calls it, as kvfast's adapter measured it
on the release that found it (:class:`~kvfast.check.hf.HFModel`: which cache argument, whether an attention mask
and ``position_ids`` are passed, whether the model builds its own cache). kvfast's per-step deviations and the
bound each step was judged against (the bug threshold: ``decisive`` times the step's bound in control mode,
exact equality in exact mode) come with it, so the script and its issue text state what kvfast found.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kvfast.validation import not_allowed, require_choice

#: The reports a standalone script replays: every scenario's, and the second branch of fork, reorder and padded
#: (``fork-branch``, ``reorder-beam``, ``padded-row``: the script runs their scenario and judges that sequence).
SCRIPT_SCENARIOS = ("decode", "resume", "rollback", "fork", "fork-branch", "reorder", "reorder-beam", "padded",
                    "padded-row")  # fmt: skip
#: The cache classes a script builds itself (else a fresh ``DynamicCache``, or none where the model builds its own).
SCRIPT_CACHES = ("StaticCache",)
#: Config keys a rebuild must not carry (the release that wrote them, the dtype the model is cast to, and
#: transformers' private bookkeeping).
DROPPED_KEYS = ("transformers_version", "dtype", "torch_dtype")


@dataclass(frozen=True)
class ReproCase:
    """A finding of kvfast on a Hugging Face causal LM, as data (see the module doc).

    - ``model_class``, ``config`` (``to_dict()`` of the model's config, JSON-able), ``seed`` (``None``: the
      weights are ``weights`` and travel in a file beside the script), ``dtype``, ``attention``.
    - ``scenario`` (:data:`SCRIPT_SCENARIOS`: the report judged), ``prompt``, ``tokens`` (fed at decode steps
      1..n), ``split`` (resume), ``drafts`` (rollback: ``{step: draft tokens}`` taken before the step and cropped
      away); ``branch_prompt`` and ``branch_tokens``: the second sequence of fork, reorder and padded (run in every
      case of them; judged in ``fork-branch``, ``reorder-beam``, ``padded-row``).
    - ``calls``: how ``generate`` calls the model (``cache_arg``, ``own_cache``, ``mask`` per call kind
      ``prefill``/``chunk``/``decode``, ``positions``, ``cache_position``, ``takes_mask``,
      ``takes_position_ids``; ``prefill_positions`` where a ``cache_params`` model's ``generate`` numbers its
      prefill otherwise (:meth:`~kvfast.check.hf.HFModel.cache_positions`); ``cache_class`` and ``max_cache_len``
      where the model is given a :data:`SCRIPT_CACHES` cache).
    - ``bug``: ``(catalogue, name)`` of an injected catalogue bug (the script then carries it), ``None`` for a
      finding about the library itself.
    - ``promote``: ``"float64"`` for a finding kvfast's logic check shows (a bfloat16 model, its weights rounded
      to bfloat16, run in float64: where a cache logic bug stands far above rounding) and ``dtype`` does not;
      the measurement below is then the logic check's.
    - kvfast's measurement: ``verdict``, ``first_bug_step``, ``deviation`` (per step), ``threshold`` (the per-step
      bug threshold), ``threshold_origin`` (what it is, in words), ``versions``, ``command`` (how it was found).
    """

    model_class: str
    config: dict
    seed: int | None
    dtype: str
    attention: str
    scenario: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    calls: dict
    split: int | None = None
    drafts: dict = field(default_factory=dict)
    bug: tuple[str, str] | None = None
    verdict: str = ""
    first_bug_step: int | None = None
    deviation: tuple[float, ...] = ()
    threshold: tuple[float, ...] = ()
    threshold_origin: str = ""
    versions: dict = field(default_factory=dict)
    command: str = ""
    weights: dict | None = field(default=None, repr=False, compare=False)
    library: str = "transformers"
    branch_prompt: tuple[int, ...] = ()
    branch_tokens: tuple[int, ...] = ()
    promote: str | None = None

    @property
    def architecture(self) -> str:
        return str(self.config.get("model_type", self.model_class))

    @property
    def run_scenario(self) -> str:
        """The scenario the cached path runs (``padded`` for ``padded-row``)."""
        return base_scenario(self.scenario)

    @property
    def judged(self) -> str:
        """``"branch"`` where the report judged is a scenario's second sequence, else ``"main"``."""
        return "main" if self.scenario == self.run_scenario else "branch"

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def to_json(self) -> str:
        """The case as JSON (the weights left out: they travel as a file)."""
        data = asdict(self)
        data.pop("weights")
        data["drafts"] = {str(k): v for k, v in self.drafts.items()}
        return json.dumps(data, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ReproCase:
        data = json.loads(text)
        data["drafts"] = {int(k): list(v) for k, v in data["drafts"].items()}
        for key in ("prompt", "tokens", "deviation", "threshold", "branch_prompt", "branch_tokens"):
            data[key] = tuple(data.get(key, ()))
        data["bug"] = None if data["bug"] is None else tuple(data["bug"])
        return ReproCase(**data)


def base_scenario(report: str) -> str:
    """The scenario whose run gives ``report`` (a second branch's report name -> its scenario's)."""
    from kvfast.check.scenarios import branches

    return branches().get(report, report)


def torch_threads() -> int:
    """torch's intra-op thread count in this process (1 without torch): a script and a shrinking child use it."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 1


def versions() -> dict[str, str]:
    """The versions a finding names: python, torch, transformers."""
    import platform

    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def config_dict(config) -> dict:
    """``config.to_dict()`` without :data:`DROPPED_KEYS`, JSON-able (a round trip through JSON)."""
    d = {k: v for k, v in config.to_dict().items() if k not in DROPPED_KEYS and not k.startswith("_")}
    return json.loads(json.dumps(d, default=str))


def build_model(case: ReproCase):
    """The case's model, built as its script builds it (:func:`kvfast.check.hf_path.model_from_config`, the source the
    script carries): ``torch.manual_seed(seed)``, the class's ``_from_config(AutoConfig.for_model(**config))`` (or
    the case's weights loaded), eval mode, cast to the dtype."""
    from kvfast.check.hf_path import model_from_config

    return model_from_config(
        case.model_class, case.config, case.seed, case.attention, case.dtype, case.promote, case.weights
    )


def _same_weights(a, b) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def _calls(adapter) -> dict:
    """How ``generate`` calls the model, as ``adapter`` measured it (its answers after a check)."""

    mask = {"prefill": True, "chunk": True, "decode": True}
    for (first, n, _cache_type), passes in adapter._mask_as_generate.items():
        mask["prefill" if first else "decode" if n == 1 else "chunk"] = bool(passes)
    made = None if adapter.new_cache is None else adapter.new_cache()
    out = {
        "cache_arg": adapter.cache_arg,
        "own_cache": adapter.new_cache is not None and made is None,
        "mask": mask if adapter.takes_mask else {k: False for k in mask},
        "positions": bool(adapter._generate_positions()),
        "cache_position": bool(adapter.takes_cache_position),
        "takes_mask": bool(adapter.takes_mask),
        "takes_position_ids": bool(adapter.takes_position_ids),
    }
    if adapter._generate_prefill_positions:  # asked of a cache_params model's generate (cache_positions)
        out["prefill_positions"] = adapter._generate_prefill_positions
    if type(made).__name__ == "StaticCache":
        out.update(cache_class="StaticCache", max_cache_len=int(made.layers[0].max_cache_len))
    return out


def _drafts(scenario: str, tokens, vocab: int) -> dict[int, list[int]]:
    if scenario != "rollback":
        return {}
    from kvfast.check.scenarios.base import draft_tokens
    from kvfast.check.scenarios.rollback import DRAFTS, rollback_points

    points = rollback_points(len(tokens))
    return {
        t: [int(d) for d in draft_tokens(int(tokens[t - 1]), DRAFTS[i % len(DRAFTS)], vocab)]
        for i, t in enumerate(points)
    }


def adapter_for(model, *, own_cache: bool | None = None, calls: dict | None = None):
    """An :class:`~kvfast.check.hf.HFModel` over ``model`` (a transformers model, or an adapter returned as it
    is); ``own_cache``: give the model no cache object (it builds its own, as ``generate`` lets hybrid models);
    ``calls`` (a case's): the cache class it names (a ``StaticCache`` of ``max_cache_len``) made fresh per prefill."""
    from kvfast.check.hf import HFModel

    if isinstance(model, HFModel):
        return model
    if calls and calls.get("cache_class") == "StaticCache":
        import transformers

        length = int(calls["max_cache_len"])
        return HFModel(model, new_cache=lambda: transformers.StaticCache(config=model.config, max_cache_len=length))
    return HFModel(model, new_cache=(lambda: None) if own_cache else None)


def case_adapter(case: ReproCase):
    """The adapter of ``case``: its model rebuilt (:func:`build_model`), its cache as the case names it, its
    injected bug injected again."""
    return inject(adapter_for(build_model(case), own_cache=case.calls.get("own_cache"), calls=case.calls), case.bug)


def check_case(case: ReproCase, adapter=None):
    """kvfast's control-mode check of ``case`` (its model rebuilt, its bug injected again, unless ``adapter`` is that
    already): the report."""
    from kvfast.check.checker import check_cache

    prompt, tokens = (np.asarray(t, dtype=np.int64) for t in (case.prompt, case.tokens))
    adapter = case_adapter(case) if adapter is None else adapter
    scenarios = (case.run_scenario,)
    return check_cache(adapter, prompt, mode="control", scenarios=scenarios, continuation=tokens, split=case.split)


def inject(adapter, bug: tuple[str, str] | None):
    """``adapter`` with catalogue bug ``bug`` (``(catalogue, name)``; ``None``: unchanged)."""
    if bug is None:
        return adapter
    from kvfast.bugs import CATALOGUES

    catalogue, name = bug
    return CATALOGUES[catalogue][name].inject(adapter)


def find_case(
    model,
    prompt,
    scenario: str,
    *,
    continuation=None,
    steps: int | None = None,
    seed: int | None = 0,
    own_cache: bool | None = None,
    command: str = "",
    report=None,
    promote: str | None = None,
) -> ReproCase:
    """The :class:`ReproCase` of ``model`` (a transformers causal LM, or an :class:`~kvfast.check.hf.HFModel` over one,
    with an injected catalogue bug or none) on ``prompt`` in ``scenario``: kvfast's control check is run (or
    ``report``, a check already run on this adapter, is read), and the case keeps its tokens, its per-step
    deviations and thresholds. ``seed``: the weight seed to try first; where ``torch.manual_seed(seed)`` and
    ``_from_config`` do not give the model's weights, the case carries them (``weights``). ``promote``
    (``"float64"``): the case of kvfast's logic check (the model promoted, :meth:`~kvfast.check.hf.HFModel.promote`,
    and checked), for a finding the model's own dtype cannot resolve."""
    from kvfast.check.scenarios import branches
    from kvfast.repro.patches import bug_of_adapter

    require_choice(scenario, "scenario", SCRIPT_SCENARIOS)
    adapter = adapter_for(model, own_cache=own_cache)
    made = None if adapter.new_cache is None else adapter.new_cache()
    if made is not None and type(made).__name__ not in ("DynamicCache", *SCRIPT_CACHES):  # what a script builds
        raise not_allowed(
            "model", f"an HFModel with new_cache of {type(made).__name__}",
            f"a DynamicCache, {', '.join(SCRIPT_CACHES)} or the model's own cache",
        )  # fmt: skip
    base = base_scenario(scenario)
    dtype = adapter.dtype
    if promote is not None:
        require_choice(promote, "promote", ("float64",))
        adapter = adapter.promote(promote)
    if report is None:
        from kvfast.check.checker import check_cache

        report = check_cache(adapter, prompt, steps, mode="control", scenarios=(base,), continuation=continuation)
    if scenario not in report.scenarios:
        raise not_allowed("scenario", scenario, f"a scenario the report holds ({', '.join(report.scenarios)})")
    s, main = report.scenarios[scenario], report.scenarios[base]
    branch = next((report.scenarios[b] for b, op in branches().items() if op == base and b in report.scenarios), None)
    hf = adapter.model
    threshold, origin = s.detail.threshold(s.steps)
    case = ReproCase(
        model_class=type(hf).__name__,
        config=config_dict(hf.config),
        seed=seed,
        dtype=dtype,
        attention=adapter.attention,
        scenario=scenario,
        prompt=tuple(int(t) for t in main.prompt),
        tokens=tuple(int(t) for t in main.tokens),
        calls=_calls(adapter),
        split=main.split if base == "resume" else None,
        drafts=_drafts(base, main.tokens, adapter.vocab_size),
        bug=bug_of_adapter(adapter),
        verdict=s.verdict,
        first_bug_step=s.first_bug_step,  # (a report judged bit for bit has none: its verdict is exact)
        deviation=tuple(float(d) for d in s.deviation),
        threshold=threshold,
        threshold_origin=origin,
        versions=versions(),
        command=command,
        branch_prompt=() if branch is None else tuple(int(t) for t in branch.prompt),
        branch_tokens=() if branch is None else tuple(int(t) for t in branch.tokens),
        promote=promote,
    )
    try:
        rebuilt = build_model(case)
        same = _same_weights(rebuilt, hf)
    except Exception:  # noqa: BLE001 - a config that does not rebuild from its dict: the weights travel instead
        same = False
    if not same:
        case = replace(case, seed=None, weights={k: v.detach().cpu().clone() for k, v in hf.state_dict().items()})
    return case
