"""kvfast against a plain NumPy user's loop on a d_model-32 exactness grid, and against the machine's limit.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/numpy_loop.py [--repeats 5] [--profile]

The grid (216 runs, float64): the built-in exactness grid's axes at d_model 32,

    study = "exactness";  fixed: vocab 32, d_model 32, d_ff 64, order "sequential", preset "f64"
    axes: seed [0, 1, 2] x n_layer [1, 2, 3] x n_head [2, 4] x prompt_len [1, 3, 6, 10] x steps [4, 8, 16]

Three ways to do the same 216 runs, timed on one core (BLAS limited to one thread):

- **NumPy loop** (:func:`numpy_run`): what a competent NumPy user writes for the job. Per run: the
  same model (``kvfast.init_params(..., positions_last=True)``, the exactness study's: the weights are
  identical) and the same prompt; greedy generation of ``steps`` tokens with a KV cache (a prefill,
  then ``steps - 1`` one-token decodes, ``np.matmul`` / BLAS products and a NumPy softmax in
  float64); at every step a full recompute of the sequence so far without the cache, its logits
  compared with the cached ones (worst absolute deviation, first step with a difference, whether the
  greedy tokens agree). No kvfast kernel is used.
- **kvfast, engine**: ``kvfast.sweep.run_sweep`` on the grid (written as a TOML file, loaded with
  ``load_grid``), ``jobs=1``, into a fresh results directory (Parquet) each repeat.
- **kvfast, loop**: the exactness study's run function called in a plain Python loop over the same
  runs: the per-run work without the engine (planning, chunking, rows, Parquet).
- **the engine alone** (:func:`lookup_grid`): the engine on the grid with the study's run replaced by a lookup
  of its rows: the engine's own time per run (printed, not a candidate).
- **the study's models** (:func:`time_study_models`): building the parameter sets and their prepared weights
  from a fresh state, per run (part of every kvfast candidate; printed, not a candidate).
- **kvfast's model calls alone** (:func:`model_calls`): the calls a run's check makes to kvfast's
  model, without the checker (nothing validated or compared): the ceiling the checker's Python works
  under, and ``1 - model / loop`` its share.

The NumPy loop does the same work as kvfast's run (the same model, prompt, cached generation and
comparison with a recompute), but not the same arithmetic: BLAS adds in its own order, so its logits
differ from kvfast's explicit-order f64 kernels in the last bits. ``--check`` (run first, always)
compares them with a relative tolerance of 1e-12 (the deviation relative to the largest logit).
Note that the NumPy loop recomputes the sequence at every step, as a user checking the cache does,
while kvfast's check recomputes only the final sequence (its rows are every step's reference, after
checking that appending a token moves no earlier row): both answer the same question.

Timing: ``--repeats`` rounds, the three candidates interleaved in each round, after one warm-up
round; each kvfast candidate starts from a fresh process's state (the study's kept parameter sets
and prompts and the prepared weights forgotten; compiled kernels kept). Wall time
(``time.perf_counter``) and this process's CPU time (``time.process_time``, less sensitive to other
processes on a shared machine) of the whole grid; medians. Printed for each: runs/s, the ratio
kvfast / NumPy loop (engine and loop, and per round), the engine overhead ``1 - loop / engine``;
then the time of the model building alone (``init_params`` for every run, as the NumPy loop does,
timed in the same rounds; kvfast's study builds one parameter set per seed and shape, shared by every
length, head count, order and preset: the line says how many), the machine limit (:func:`product_rate`:
the grid's own matrix products, every one of every run, timed in compiled loops of the f64 product
bodies, no Python between them; the grid's FLOPs per run, products and attention, :func:`run_products`;
their quotient, the runs/s one core could reach if every FLOP ran at that rate, against the engine's),
and the load average (the machine is shared).
``--numpy-model`` adds kvfast's own NumPy reference model (:class:`kvfast.NumpyModel`, one row at a
time and whole-matrix) through ``check_cache``, timed after the rounds: another NumPy baseline.
``--profile`` adds a cProfile of the kvfast loop (top entries by cumulative and by internal time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GRID_TOML = """\
study = "exactness"
description = "exactness at d_model 32, float64 only (benchmarks/numpy_loop.py)"

[fixed]
vocab = 32
d_model = 32
d_ff = 64
order = "sequential"
preset = "f64"

[axes]
seed = [0, 1, 2]
n_layer = [1, 2, 3]
n_head = [2, 4]
prompt_len = [1, 3, 6, 10]
steps = [4, 8, 16]
"""

EPS = 1e-5  # kvfast.ModelConfig's default RMSNorm epsilon


# --- the NumPy user's model: float64, BLAS products, a KV cache ---------------------------------------


def rmsnorm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """x (T, d) -> x / sqrt(mean(x^2) + eps) * g."""
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)) * g


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int, pos0: int) -> np.ndarray:
    """Causal multi-head attention of q (T, d), queries at positions pos0.., over k, v (S, d)."""
    T, d = q.shape
    S = k.shape[0]
    hd = d // n_head
    qh = q.reshape(T, n_head, hd).transpose(1, 0, 2)  # (H, T, hd)
    kh = k.reshape(S, n_head, hd).transpose(1, 0, 2)  # (H, S, hd)
    vh = v.reshape(S, n_head, hd).transpose(1, 0, 2)  # (H, S, hd)
    scores = np.matmul(qh, kh.transpose(0, 2, 1)) * (1.0 / math.sqrt(hd))  # (H, T, S)
    future = np.arange(S)[None, :] > (pos0 + np.arange(T))[:, None]  # (T, S)
    scores[:, future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.matmul(probs, vh).transpose(1, 0, 2).reshape(T, d)  # (T, d)


def forward(p: dict, n_layer: int, n_head: int, tokens: np.ndarray, cache: list | None = None) -> np.ndarray:
    """Logits (T, vocab) of ``tokens``; with a cache (per layer [K, V, length]) they continue it."""
    pos0 = cache[0][2] if cache else 0
    T = tokens.shape[0]
    x = p["wte"][tokens] + p["wpe"][pos0 : pos0 + T]
    for i in range(n_layer):
        h = rmsnorm(x, p[f"h{i}.g1"])
        q, k, v = h @ p[f"h{i}.wq"], h @ p[f"h{i}.wk"], h @ p[f"h{i}.wv"]
        if cache:
            K, V, n = cache[i]
            K[n : n + T], V[n : n + T] = k, v
            cache[i][2] = n + T
            k, v = K[: n + T], V[: n + T]
        x = x + attention(q, k, v, n_head, pos0) @ p[f"h{i}.wo"]
        u = rmsnorm(x, p[f"h{i}.g2"]) @ p[f"h{i}.w1"]
        x = x + (u / (1.0 + np.exp(-u))) @ p[f"h{i}.w2"]
    return rmsnorm(x, p["gf"]) @ p["w_out"]


def numpy_generate(config: dict, params: dict | None = None) -> dict:
    """One run: cached greedy generation, every step compared with a full recompute.

    Returns the result (``max_abs_dev``, ``first_bad_step``, ``tokens_equal``, ``tokens``, as the
    exactness study's columns) and ``cache_logits`` / ``recompute_logits``: the rows compared, one
    per prompt position then one per decode step.
    """
    from kvfast import ModelConfig, init_params

    n_layer, n_head, d = config["n_layer"], config["n_head"], config["d_model"]
    T0, steps = config["prompt_len"], config["steps"]
    if params is None:
        cfg = ModelConfig(config["vocab"], d, n_head, n_layer, config["d_ff"], T0 + steps)
        params = init_params(cfg, config["seed"], positions_last=True)  # the study's model (exactness.model_for)
    rng = np.random.default_rng([config["seed"], T0, 7])  # the exactness study's prompt
    tokens = list(rng.integers(0, config["vocab"], size=T0))
    cache = [[np.empty((T0 + steps, d)), np.empty((T0 + steps, d)), 0] for _ in range(n_layer)]
    cached = forward(params, n_layer, n_head, np.array(tokens), cache)  # prefill: (T0, vocab)
    full = forward(params, n_layer, n_head, np.array(tokens))
    cache_rows, full_rows = [cached], [full]
    for _ in range(steps - 1):
        tokens.append(int(np.argmax(cached[-1])))
        cached = forward(params, n_layer, n_head, np.array(tokens[-1:]), cache)  # decode: (1, vocab)
        full = forward(params, n_layer, n_head, np.array(tokens))[-1:]  # recompute, last row
        cache_rows.append(cached)
        full_rows.append(full)
    dev = np.array([np.abs(a - b).max() for a, b in zip(cache_rows, full_rows, strict=True)])
    bad = np.nonzero(dev > 0)[0]
    t_cached = [int(np.argmax(r[-1])) for r in cache_rows]
    t_full = [int(np.argmax(r[-1])) for r in full_rows]
    return {
        "max_abs_dev": float(dev.max()),
        "first_bad_step": int(bad[0]) if bad.size else -1,
        "tokens_equal": t_cached == t_full,
        "tokens": ",".join(map(str, t_cached)),
        "cache_logits": np.concatenate(cache_rows),
        "recompute_logits": np.concatenate(full_rows),
    }


def numpy_run(config: dict) -> dict:
    """The NumPy loop's run: :func:`numpy_generate` without the logits."""
    out = numpy_generate(config)
    del out["cache_logits"], out["recompute_logits"]
    return out


def kvfast_logits(config: dict, tokens: list[int]) -> np.ndarray:
    """kvfast's f64 logits (one forward, ``order`` of the config) of ``tokens`` for the config's model."""
    from kvfast import ModelConfig, Numerics, forward, init_params

    cfg = ModelConfig(
        config["vocab"], config["d_model"], config["n_head"], config["n_layer"], config["d_ff"],
        config["prompt_len"] + config["steps"],
    )  # fmt: skip
    params = init_params(cfg, config["seed"], positions_last=True)
    return forward(cfg, params, np.array(tokens), Numerics.preset("f64", config["order"]))


def agreement(config: dict) -> tuple[float, bool]:
    """Relative deviation of the NumPy loop's cached logits from kvfast's f64 forward, and tokens equal.

    Relative: ``max |numpy - kvfast| / max |kvfast|`` over every row the run compares.
    """
    from kvfast.studies import exactness

    mine = numpy_generate(config)
    tokens = [*exactness.prompt_for(config), *map(int, mine["tokens"].split(",")[:-1])]
    ref = kvfast_logits(config, tokens)
    rel = float(np.abs(mine["cache_logits"] - ref).max() / np.abs(ref).max())
    return rel, mine["tokens"] == exactness.run(config)["tokens"]


# --- the benchmark -----------------------------------------------------------------------------------


def load_bench_grid(tmp: str):
    from kvfast.studies import STUDIES
    from kvfast.sweep import load_grid

    path = Path(tmp) / "exactness_d32.toml"
    path.write_text(GRID_TOML)
    return load_grid(str(path), studies=STUDIES)


class Clock:
    """Wall time (``time.perf_counter``) and this process's CPU time (``time.process_time``) of a block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def time_numpy(configs: list[dict]) -> Clock:
    with Clock() as clock:
        for config in configs:
            numpy_run(config)
    return clock


def time_init(configs: list[dict]) -> Clock:
    """The model building alone (``kvfast.init_params``), once per run as the NumPy loop does."""
    from kvfast import ModelConfig, init_params

    with Clock() as clock:
        for c in configs:
            shape = (c["vocab"], c["d_model"], c["n_head"], c["n_layer"], c["d_ff"], c["prompt_len"] + c["steps"])
            init_params(ModelConfig(*shape), c["seed"], positions_last=True)
    return clock


def shared_parameter_sets(configs: list[dict]) -> int:
    """How many parameter sets the exactness study builds for ``configs``."""
    from kvfast.studies import exactness

    fresh_state()
    for c in configs:
        exactness.model_for(c)
    return exactness._params.cache_info().misses


def time_numpy_model(configs: list[dict], batching: str) -> float:
    """kvfast's NumPy reference model (:class:`kvfast.NumpyModel`) through ``check_cache``, per run."""
    from kvfast import NumpyModel, check_cache
    from kvfast.studies import exactness

    fresh_state()
    with Clock() as clock:
        for c in configs:
            cfg, params = exactness.model_for(c)
            model = NumpyModel(cfg, params, batching=batching)
            check_cache(model, exactness.prompt_for(c), max(1, c["steps"] - 1), scenarios="decode", follow="cache")
    return clock.wall


def fresh_state() -> None:
    """What a fresh process starts from: the study's kept parameter sets, draws and prompts and the prepared
    weights forgotten (each kvfast candidate starts from it, as a sweep's process does; compiled kernels stay)."""
    from kvfast.check import adapters
    from kvfast.studies import exactness

    exactness.clear_caches()
    adapters.clear_prepared_weights()


def model_calls(config: dict) -> None:
    """The calls one run's check makes to kvfast's model, without the checker: the recompute of the prompt,
    the prefill, the greedy decode steps (``decode_greedy``), the recomputes of the final sequence and of the
    prefix the append-invariance check takes (one ``recompute_prefixes``; the study's model, prompt and
    numerics; nothing compared)."""
    from kvfast.check import KvfastModel
    from kvfast.check.control import prefix_length
    from kvfast.numerics import Numerics
    from kvfast.studies import exactness

    cfg, params = exactness.model_for(config)
    model = KvfastModel(cfg, params, Numerics.preset(config["preset"], config["order"]))
    prompt = exactness.prompt_for(config)
    steps, T = max(1, config["steps"] - 1), config["prompt_len"]
    model.recompute(prompt)
    first = int(model.prefill(prompt)[-1].argmax())
    rows = model.decode_greedy(first, steps)
    final = np.concatenate([prompt, [first], rows[:-1].argmax(axis=1)])
    q = prefix_length(T + max(1, steps // 4))
    model.recompute_prefixes(final, [final.shape[0], q] if q < final.shape[0] else [final.shape[0]])


def time_study_models(configs: list[dict]) -> tuple[Clock, Clock]:
    """What building the study's models costs in a run from a fresh state: its parameter sets
    (``exactness.model_for`` of every run) and their prepared weights (``prepared_weights``, what each run's
    ``KvfastModel`` does first)."""
    from kvfast.check.adapters import prepared_weights
    from kvfast.numerics import Numerics
    from kvfast.studies import exactness

    fresh_state()
    with Clock() as sets:
        models = [exactness.model_for(c) for c in configs]
    with Clock() as prepared:
        for c, (cfg, params) in zip(configs, models, strict=True):
            prepared_weights(cfg, params, Numerics.preset(c["preset"], c["order"]))
    return sets, prepared


def time_model_calls(configs: list[dict]) -> Clock:
    fresh_state()
    with Clock() as clock:
        for config in configs:
            model_calls(config)
    return clock


def time_kvfast_loop(grid) -> Clock:
    fresh_state()
    with Clock() as clock:
        for run in grid.runs:
            grid.study.run(dict(run.config))
    return clock


def time_engine(grid, tmp: str, i: int | str) -> Clock:
    from kvfast.sweep import run_sweep

    fresh_state()
    with Clock() as clock:
        report = run_sweep(grid, Path(tmp) / f"out{i}", jobs=1, quiet=True)
    assert report.ran == len(grid), report
    return clock


def run_products(config: dict) -> tuple[list[tuple[int, int, int, bool]], int]:
    """The matrix products of one run's model calls (those of :func:`model_calls`: the prompt's recompute, the
    prefill, the decode steps, the final sequence's and the prefix's recomputes), each ``(rows, n, m, large)``
    (``large``: the model's product size class, :func:`kvfast.model.compiled.model_size_class`), and the
    run's FLOPs (2 per multiply-add: the products and attention's score and value sums)."""
    from kvfast.check.control import prefix_length
    from kvfast.kernels.matmul import LARGE_MIN_ROWS, size_class

    d, f, vocab, layers = config["d_model"], config["d_ff"], config["vocab"], config["n_layer"]
    T0, steps = config["prompt_len"], max(1, config["steps"] - 1)
    products, macs = [], 0

    def forward(rows: int, pos0: int) -> None:
        nonlocal macs
        large = size_class(LARGE_MIN_ROWS, d, max(d, f, vocab))  # the model's (model_size_class)
        for _ in range(layers):
            products.extend([(rows, d, d, large)] * 4 + [(rows, d, f, large), (rows, f, d, large)])
        products.append((rows, d, vocab, large))
        keys = sum(pos0 + t + 1 for t in range(rows))  # causal: row t attends pos0 + t + 1 keys
        macs += rows * (layers * (4 * d * d + 2 * d * f) + d * vocab) + layers * 2 * keys * d

    forward(T0, 0)  # recompute of the prompt
    forward(T0, 0)  # prefill
    for i in range(steps):
        forward(1, T0 + i)  # decode step i + 1
    forward(T0 + steps, 0)  # recompute of the final sequence
    q = prefix_length(T0 + max(1, steps // 4))
    if q < T0 + steps:
        forward(q, 0)  # the prefix recompute of the append-invariance check
    return products, 2 * macs


def product_rate(configs: list[dict], repeats: int = 3) -> tuple[float, int]:
    """The compiled f64 product bodies' rate on the grid's own products: every product of every run
    (:func:`run_products`), each shape timed in one compiled loop of ``matmul_with`` (no Python between
    products), best of ``repeats``; ``(FLOP/s, number of products)``."""
    import collections

    import numba as nb

    from kvfast.kernels.matmul import matmul_with, product_bodies

    @nb.njit(cache=False, fastmath=False, error_model="numpy")
    def loop(x, w, y, bodies, n):
        for _ in range(n):
            matmul_with(x, w, 0, 0, 0, y, bodies)  # f64 storage and accumulator, sequential order

    shapes = collections.Counter(p for c in configs for p in run_products(c)[0])
    rng = np.random.default_rng(0)
    seconds = flops = 0.0
    for (rows, n, m, large), count in shapes.items():
        x, w, y = rng.standard_normal((rows, n)), rng.standard_normal((n, m)), np.empty((rows, m))
        bodies = product_bodies(0, large)
        loop(x, w, y, bodies, 1)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            loop(x, w, y, bodies, count)
            best = min(best, time.perf_counter() - start)
        seconds += best
        flops += 2.0 * rows * n * m * count
    return flops / seconds, sum(shapes.values())


def lookup_grid(grid):
    """``grid`` with its study's run replaced by a lookup of the rows it returns (computed here, once): swept, it
    times the engine's own work (planning, each run's guards, the rows, the writer, Parquet parts, the manifest)."""
    import dataclasses

    rows = {tuple(sorted(run.config.items())): grid.study.run(dict(run.config)) for run in grid.runs}

    def lookup(config: dict) -> dict:
        return dict(rows[tuple(sorted(config.items()))])

    return dataclasses.replace(grid, study=dataclasses.replace(grid.study, run=lookup))


def profile_loop(grid, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        time_kvfast_loop(grid)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--profile", action="store_true", help="also cProfile the kvfast loop (3 passes)")
    parser.add_argument(
        "--numpy-model", action="store_true", help="also time kvfast.NumpyModel through check_cache (rows, matrix)"
    )
    parser.add_argument("--top", type=int, default=25, help="profile entries shown")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} is not allowed; allowed: an integer >= 1")
    from threadpoolctl import threadpool_limits

    load0 = os.getloadavg()
    with threadpool_limits(limits=1), tempfile.TemporaryDirectory(prefix="kvfast-numpy-loop-") as tmp:
        grid = load_bench_grid(tmp)
        configs = [dict(run.config) for run in grid.runs]
        checks = [agreement(c) for c in configs]
        worst = max(rel for rel, _ in checks)
        same_tokens = sum(eq for _, eq in checks)
        print(f"grid: {len(configs)} runs (d_model 32, f64); NumPy loop vs kvfast f64 logits: worst relative "
              f"deviation {worst:.2e} (tolerance 1e-12: {'ok' if worst <= 1e-12 else 'EXCEEDED'}); "
              f"token strings equal to kvfast's: {same_tokens}/{len(configs)}")  # fmt: skip
        alone = lookup_grid(grid)
        times: dict[str, list[Clock]] = {
            "numpy": [], "loop": [], "engine": [], "model": [], "init": [], "alone": [], "sets": [], "prepared": []
        }  # fmt: skip
        for i in range(args.repeats + 1):  # round 0 warms up (Numba cache load, lru caches, BLAS)
            clocks = {"numpy": time_numpy(configs), "loop": time_kvfast_loop(grid), "engine": time_engine(grid, tmp, i)}
            clocks["model"] = time_model_calls(configs)
            clocks["init"] = time_init(configs)
            clocks["alone"] = time_engine(alone, tmp, f"alone{i}")
            clocks["sets"], clocks["prepared"] = time_study_models(configs)
            if i:
                for key, clock in clocks.items():
                    times[key].append(clock)
        n = len(configs)
        for kind in ("wall", "cpu"):
            med = {k: statistics.median(getattr(c, kind) for c in v) for k, v in times.items()}
            print(f"\nmedians of {args.repeats} interleaved rounds, {kind} s for the {n} runs, one core:\n")
            print(f"| candidate | {kind} s | runs/s | x NumPy loop |\n|---|---|---|---|")
            for key, label in (("numpy", "NumPy loop"), ("loop", "kvfast, study run in a loop"),
                               ("engine", "kvfast, sweep engine (--jobs 1)"),
                               ("model", "kvfast's model calls alone (no checker)")):  # fmt: skip
                print(f"| {label} | {med[key]:.3f} | {n / med[key]:,.0f} | {med['numpy'] / med[key]:.1f} |")
            for key, label in (("engine", "engine"), ("loop", "study run in a loop"), ("model", "model calls alone")):
                ratios = [getattr(a, kind) / getattr(b, kind) for a, b in zip(times["numpy"], times[key], strict=True)]
                print(f"\nNumPy loop / kvfast {label}, {kind} time, per round (both measured in the same round): "
                      f"{', '.join(f'{r:.1f}' for r in ratios)} (median {statistics.median(ratios):.1f}x; "
                      "target 12x, issue 46)")  # fmt: skip
            print(
                f"engine overhead 1 - loop / engine ({kind}): {1 - med['loop'] / med['engine']:.3f}; "
                f"the checker's share of the loop 1 - model calls / loop: {1 - med['model'] / med['loop']:.3f}"
            )
        med = {k: statistics.median(c.wall for c in v) for k, v in times.items()}
        cpu = {k: statistics.median(c.cpu for c in v) for k, v in times.items()}
        print(f"the engine's own time (the study's run replaced by a lookup of its rows): {med['alone'] / n * 1e6:.0f} "
              f"us wall, {cpu['alone'] / n * 1e6:.0f} us CPU per run, {med['alone'] / med['engine']:.1%} of the "
              f"engine's wall; the checker's own (study run in a loop - model calls alone): "
              f"{(med['loop'] - med['model']) / n * 1e6:.0f} us wall, {(cpu['loop'] - cpu['model']) / n * 1e6:.0f} us "
              "CPU per run")  # fmt: skip
        print(f"the study's models from a fresh state (in the model calls above): parameter sets "
              f"{med['sets'] / n * 1e6:.0f} us wall, their prepared weights {med['prepared'] / n * 1e6:.0f} us wall "
              "per run")  # fmt: skip
        sets = shared_parameter_sets(configs)
        print(f"model building alone (init_params once per run, as the NumPy loop does): {med['init']:.3f} s wall, "
              f"{med['init'] / med['numpy']:.0%} of the NumPy loop's; kvfast's study builds {sets} parameter sets "
              f"for the {n} runs (one per seed and shape)")  # fmt: skip
        rate, n_products = product_rate(configs)
        flops = sum(run_products(c)[1] for c in configs) / n
        limit = rate / flops
        engine = n / med["engine"]
        print(f"machine limit (one core): the grid's {n_products:,} products run at {rate / 1e9:.1f} GFLOP/s in "
              f"compiled loops; a run is {flops / 1e6:.2f} MFLOP (products and attention), so at most {limit:,.0f} "
              f"runs/s; the engine runs {engine:,.0f} runs/s (wall), {engine / limit:.0%} of that")  # fmt: skip
        load1 = os.getloadavg()
        print(f"cpu_count {os.cpu_count()}, load average (1 min) before {load0[0]:.2f}, after {load1[0]:.2f}")
        if args.numpy_model:
            for batching in ("rows", "matrix"):
                wall = statistics.median(time_numpy_model(configs, batching) for _ in range(args.repeats))
                print(f"kvfast.NumpyModel (batching {batching!r}) through check_cache: {n / wall:,.0f} runs/s "
                      f"(median of {args.repeats}, after the rounds above)")  # fmt: skip
        if args.profile:
            print("\n## cProfile of the kvfast loop (3 passes over the grid)\n")
            print(profile_loop(grid, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
