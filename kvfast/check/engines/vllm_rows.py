"""vLLM's CPU GEMMs and their row count, for the vLLM adapter (:mod:`kvfast.check.engines.vllm`).

vLLM's CPU GEMMs choose their kernel by row count: in bfloat16 on a CPU with AMX, a linear layer whose weight is
under 1 MiB runs sgl-kernel's ``weight_packed_linear``, an AVX-512 kernel for up to 4 rows and an AMX one above,
which add up in another order. :func:`row_count_effect` measures that on an engine (the same rows through every
linear layer alone and among :data:`PROBE_ROWS`); :func:`gemm_rows` runs every GEMM on ``n`` rows at a time (the
rows are independent: the same products, each with the kernel a step of ``n`` tokens runs). Both work through
each layer's ``cpu_linear`` (vLLM's CPU GEMM dispatch), an instance attribute set for the duration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import numpy as np

#: The row-count probe: the same rows through every linear layer alone and among this many.
PROBE_ROWS = 8
#: The probe's input: the activations each linear layer sees in a prefill of this many tokens.
PROBE_TOKENS = 2 * PROBE_ROWS


def linear_layers(model) -> list:
    """``model``'s linear layers that run vLLM's CPU GEMM dispatch (``cpu_linear``)."""
    layers = [m for m in model.modules() if callable(getattr(m, "cpu_linear", None))]
    if not layers:
        raise NotImplementedError("no linear layer of the model runs vLLM's CPU GEMM dispatch (cpu_linear)")
    return layers


@contextlib.contextmanager
def _each_linear(layers: list, wrap):
    """Every one of ``layers``' ``cpu_linear`` replaced by ``wrap(k, its own)`` for the duration (``k``: the
    layer's index); yields the layers' own."""
    saved = [layer.cpu_linear for layer in layers]
    with contextlib.ExitStack() as stack:
        for k, (layer, linear) in enumerate(zip(layers, saved, strict=True)):
            stack.enter_context(mock.patch.object(layer, "cpu_linear", wrap(k, linear)))
        yield saved


def gemm_rows(layers: list, n: int):
    """Every one of ``layers`` runs its GEMM on ``n`` rows at a time for the duration (a context manager)."""
    import torch

    def blocked(k, linear):
        def run(x, weight, bias):
            flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0] <= n:
                return linear(x, weight, bias)
            out = torch.cat([linear(flat[i : i + n], weight, bias) for i in range(0, flat.shape[0], n)])
            return out.reshape(*x.shape[:-1], out.shape[-1])

        return run

    return _each_linear(layers, blocked)


def row_count_effect(layers: list, prefill: Callable[[list[int]], object], vocab_size: int) -> float:
    """How far ``layers``' GEMMs change with their row count: the activations each sees in ``prefill`` (a
    callable running the engine over the tokens it is given, its GEMMs as vLLM runs them) of
    :data:`PROBE_TOKENS` tokens, run through it :data:`PROBE_ROWS` rows at a time and one row at a time; the
    largest difference of an output in units in its last place (in the output's own format). ``0.0``: the row
    count changes nothing here."""
    import torch

    from kvfast.check.formats import ulp

    seen: dict[int, tuple] = {}

    def capture(k, linear):
        def run(x, weight, bias):
            seen.setdefault(k, (x.reshape(-1, x.shape[-1]).clone(), weight, bias))
            return linear(x, weight, bias)

        return run

    with _each_linear(layers, capture) as saved:
        prefill([(3 + 7 * i) % vocab_size for i in range(PROBE_TOKENS)])
    worst = 0.0
    with torch.no_grad():
        for k, (x, weight, bias) in seen.items():
            for start in range(0, x.shape[0] - PROBE_ROWS + 1, PROBE_ROWS):
                rows = x[start : start + PROBE_ROWS]
                together = saved[k](rows, weight, bias)
                alone = torch.cat([saved[k](rows[i : i + 1], weight, bias) for i in range(PROBE_ROWS)])
                fmt = str(together.dtype).removeprefix("torch.")
                a, b = together.float().numpy(), alone.float().numpy()
                units = np.abs(a - b) / ulp(fmt, np.maximum(np.abs(a), np.abs(b)))
                worst = max(worst, float(units.max()))
    return worst
