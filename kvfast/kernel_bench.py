"""``kvfast bench kernels``: kernel speed against BLAS and NumPy, how cost grows, compile cost.

Sections, printed as Markdown tables:

1. **matmul**: GFLOP/s of the explicit-order product ``(T x d) @ (d x d)``
   (:func:`kvfast.kernels.matmul.matmul_into`) for d in {16, 64, 256}, T in
   {1, 16, 256}, sequential order with f64, f32 and bf16 accumulators and
   pairwise order with f64, next to ``np.matmul`` on the same shapes (BLAS,
   limited to one thread through threadpoolctl when it is installed) and the
   ratio kernel / BLAS. Inputs are on the accumulator's grid and the result is
   stored in the same format. Then the bf16 kernel against
   :func:`numpy_bf16_matmul`, a NumPy loop over k with the same semantics
   (rounding by ml_dtypes after every product and add), with a check that
   the two results are equal bit for bit.
2. **attention**: causal attention of T rows over T keys (one head of dim 64,
   T in {128, 512}) in the standard and online orders and each format
   (:func:`kvfast.kernels.attention.attention_into`), against
   :func:`numpy_attention` (float64, BLAS); cells are ms and NumPy time / kernel time.
3. **decode**: one decode step at position L-1 over a cache of L-1 positions
   against a full forward of L tokens, through the compiled entry points
   (``decode_prepared`` / ``forward_prepared`` on prepared ``Weights``, no
   validation, one compiled call each), through the public ones
   (``decode_step`` / ``forward``: validation and the cached prepared weights,
   ``Weights.cached``), and the forward layer by layer from Python
   (``forward_layers``, one call per kernel per layer), with the ratios
   public / compiled (issue 13's target: at most 1.5) and layers / compiled.
4. **growth**: a decode step against the cache length and a forward against
   T, at four sizes, with the exponent p of time ~ size^p fitted by least
   squares on log-log (:func:`growth_exponent`).
5. **compile**: a cold start (a fresh interpreter with an empty
   ``NUMBA_CACHE_DIR`` in a temporary directory: import kvfast, run one
   ``generate`` in f64, which compiles the f64 entries of the forward and the
   decode step, and the kernels they call) and a warm start (the same in
   another fresh interpreter using that now filled cache), and what Numba's
   BLAS probe (importing ``scipy.linalg``), which kvfast avoids, would add.

Timing: every figure is a median over ``repeats`` samples. In sections 1 to 4
the candidates of one row are timed in interleaved rounds (one sample of each
per round), so a load spike on the shared machine hits them alike, and each
sample repeats its call until it has run for about 20 ms of CPU time. Figures
are CPU time of this process (``time.process_time``: every thread of the
process, so a multi-threaded BLAS is charged in full), which other processes on
the machine disturb far less than wall time; the ratio columns compare figures
measured in the same run. Section 5 reports the child's own CPU and wall time
from just before ``import kvfast`` to the end of the generate; the cold start
runs once (compiling is a one-off and takes half a minute or more), the warm start
``repeats`` times.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvfast.validation import require_choice, require_int

MATMUL_DS = (16, 64, 256)
MATMUL_TS = (1, 16, 256)
FORMATS = ("f64", "f32", "bf16")
# (label, accumulator/storage format, order) of the explicit-order kernels timed per shape
MATMUL_VARIANTS = (*((f"{fmt} seq", fmt, "sequential") for fmt in FORMATS), ("f64 pair", "f64", "pairwise"))
SAMPLE_CPU_S = 0.02  # each timed sample repeats its call for about this much CPU time
DECODE_CONFIG = {"vocab": 256, "d_model": 64, "n_head": 4, "n_layer": 2, "d_ff": 256, "max_pos": 256}
DECODE_LENGTHS = (16, 128)
DECODE_PRESETS = ("f64", "f32", "bf16")
SECTIONS = ("matmul", "attention", "decode", "growth", "compile")
BF16_LOOP_SHAPES = ((16, 64), (256, 256))  # (T, d) where the NumPy + ml_dtypes loop is timed
ATTENTION_TS = (128, 512)
ATTENTION_HEAD_DIM = 64
ATTENTION_BLOCK = 64  # keys per block of the online order
# (label, storage = accumulator format, attention order)
ATTENTION_VARIANTS = tuple((f"{fmt} {mode}", fmt, mode) for fmt in FORMATS for mode in ("standard", "online"))
GROWTH_LENGTHS = (128, 256, 512, 1024)  # cache lengths (decode) and T (forward) for the growth fits

COMPILE_CHILD = r"""
import json, time
t0, c0 = time.perf_counter(), time.process_time()
import kvfast
cfg = kvfast.ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=32)
params = kvfast.init_params(cfg, 0)
tokens, _ = kvfast.generate(cfg, params, [1, 2, 3], 4, kvfast.Numerics.preset("f64"))
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}))
"""
#: The CPU seconds a fresh interpreter spends importing ``scipy.linalg.cython_blas`` after numpy.
BLAS_PROBE_CHILD = (
    "import time, numpy\nc = time.process_time()\nimport scipy.linalg.cython_blas\nprint(time.process_time() - c)"
)


def _calls_per_sample(timer: timeit.Timer) -> int:
    """How many calls of ``timer``'s function make one sample of about ``SAMPLE_CPU_S`` CPU seconds."""
    calls = 1
    while (spent := timer.timeit(calls)) < SAMPLE_CPU_S and calls < 1 << 20:
        calls = max(calls * 2, int(calls * SAMPLE_CPU_S / max(spent, 1e-6)) + 1)
    return calls


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median CPU seconds (of this process) per call of each function, timed in ``repeats`` interleaved rounds.

    Each function is called once first (to compile or load its kernels), then
    sized so one sample takes about ``SAMPLE_CPU_S`` of CPU time; every round
    takes one sample of each function in turn (a :class:`timeit.Timer` on
    ``time.process_time``, so the garbage collector is off during a sample).
    """
    for fn in fns.values():
        fn()
    timers = {name: timeit.Timer(fn, timer=time.process_time) for name, fn in fns.items()}
    calls = {name: _calls_per_sample(timer) for name, timer in timers.items()}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, timer in timers.items():
            cpu[name].append(timer.timeit(calls[name]) / calls[name])
    return {name: statistics.median(cpu[name]) for name in fns}


def _blas_single_thread():
    """A context that limits BLAS to one thread (threadpoolctl), and a line describing the BLAS."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return contextlib.nullcontext(), "BLAS: threadpoolctl is not installed, thread count not limited"
    info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    desc = ", ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')} kernels)" for i in info)
    return threadpool_limits(limits=1, user_api="blas"), f"BLAS: {desc or 'none found'}, limited to 1 thread"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        if found := re.search(r"^model name\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE):
            return found.group(1).strip()
    return platform.processor() or platform.machine()


def _row(*cells: object) -> None:
    """One row of a Markdown table, printed at once (a long section shows its progress)."""
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def _header(*columns: str) -> None:
    """A Markdown table's header row and its separator."""
    _row(*columns)
    print("|" + "---|" * len(columns))


def print_machine() -> None:
    """One paragraph on the machine and the software versions."""
    import numba

    print(f"Machine: {_cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}")
    print(f"Python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "NUMBA_CPU_NAME"):
        if var in os.environ:
            print(f"Note: {var}={os.environ[var]} is set (it changes what the BLAS or Numba compiles for)")


def bench_matmul(repeats: int) -> None:
    """GFLOP/s of each explicit-order variant and of ``np.matmul`` per (T, d); prints a table."""
    from kvfast.kernels.matmul import matmul_into
    from kvfast.kernels.precision import FORMAT_CODES, round_array
    from kvfast.kernels.reduce import ORDER_CODES

    limit, blas_line = _blas_single_thread()
    print(blas_line)
    print()
    labels = [v[0] for v in MATMUL_VARIANTS]
    _header("T", "d", "BLAS GFLOP/s", *(f"{lb} GFLOP/s (x BLAS)" for lb in labels))
    rng = np.random.default_rng(0)
    with limit:
        for d, T in itertools.product(MATMUL_DS, MATMUL_TS):
            x64 = rng.standard_normal((T, d))
            w64 = rng.standard_normal((d, d))
            yb = np.empty((T, d))
            fns: dict[str, Callable[[], object]] = {"blas": lambda x=x64, w=w64, y=yb: np.matmul(x, w, out=y)}
            for label, fmt, order in MATMUL_VARIANTS:
                code = FORMAT_CODES[fmt]
                x, w, y = round_array(x64, code), round_array(w64, code), np.empty((T, d))
                fns[label] = lambda x=x, w=w, y=y, c=code, o=ORDER_CODES[order]: matmul_into(x, w, c, c, o, y)
            times = time_interleaved(fns, repeats)
            flops = 2.0 * T * d * d
            gf = {name: flops / t / 1e9 for name, t in times.items()}
            cells = [f"{gf[lb]:.2f} ({gf[lb] / gf['blas']:.2f})" for lb in labels]
            _row(T, d, f"{gf['blas']:.2f}", *cells)


def numpy_bf16_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The bf16-accumulator sequential product as a NumPy loop over k, rounding with ml_dtypes.

    ``y = -0.0``; for each k: ``y = bf16(y + bf16(x[:, k] * w[k]))``, products and sums computed in
    float32 and rounded to bfloat16 by ml_dtypes. For inputs on the bfloat16 grid this is the
    kernel's definition (each operation in float64, rounded once to bfloat16): the product of two
    bfloat16s is exact in float32 where the rounding can tell, and rounding the sum of two
    bfloat16s through float32 never creates a tie; the benchmark checks the bits are equal.
    """
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    y = np.full((x.shape[0], w.shape[1]), -0.0, dtype=np.float32)
    for k in range(x.shape[1]):
        term = np.multiply.outer(x32[:, k], w32[k]).astype(bf16).astype(np.float32)
        y = (y + term).astype(bf16).astype(np.float32)
    return y.astype(np.float64)


def bench_bf16_loop(repeats: int) -> None:
    """The bf16 matmul kernel against :func:`numpy_bf16_matmul` (same semantics); prints a table."""
    from kvfast.kernels.matmul import matmul_into
    from kvfast.kernels.precision import BF16, round_array
    from kvfast.kernels.reduce import SEQUENTIAL

    _header("T", "d", "NumPy + ml_dtypes loop GFLOP/s", "bf16 kernel GFLOP/s", "kernel / loop", "bits equal")
    rng = np.random.default_rng(2)
    for T, d in BF16_LOOP_SHAPES:
        x = round_array(rng.standard_normal((T, d)), BF16)
        w = round_array(rng.standard_normal((d, d)), BF16)
        y = np.empty((T, d))
        times = time_interleaved(
            {
                "loop": lambda x=x, w=w: numpy_bf16_matmul(x, w),
                "kernel": lambda x=x, w=w, y=y: matmul_into(x, w, BF16, BF16, SEQUENTIAL, y),
            },
            repeats,
        )
        equal = bool(np.array_equal(numpy_bf16_matmul(x, w).view(np.uint64), y.view(np.uint64)))
        flops = 2.0 * T * d * d
        loop, kern = flops / times["loop"] / 1e9, flops / times["kernel"] / 1e9
        _row(T, d, f"{loop:.2f}", f"{kern:.2f}", f"{kern / loop:.1f}", "yes" if equal else "NO")


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal one-head attention in float64 with BLAS: scores, masked softmax, weighted sum."""
    s = (q @ k.T) * scale
    s[np.triu_indices(s.shape[0], 1)] = -np.inf
    s -= s.max(axis=1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(axis=1, keepdims=True)) @ v


def bench_attention(repeats: int) -> None:
    """Causal attention (one head of ``ATTENTION_HEAD_DIM``) of T rows over T keys: the kernel in
    each format and order against :func:`numpy_attention`; prints a table."""
    from kvfast.kernels.attention import ATTENTION_CODES, attention_into
    from kvfast.kernels.precision import FORMAT_CODES, round_array
    from kvfast.kernels.reduce import SEQUENTIAL

    limit, _ = _blas_single_thread()
    labels = [v[0] for v in ATTENTION_VARIANTS]
    print(
        f"Causal, one head of dim {ATTENTION_HEAD_DIM}, sequential sums; online order in blocks of"
        f" {ATTENTION_BLOCK} keys. Cells: ms per call (NumPy time / kernel time)."
    )
    print()
    _header("T", "NumPy f64 (BLAS) ms", *labels)
    rng = np.random.default_rng(3)
    hd = ATTENTION_HEAD_DIM
    scale = 1.0 / np.sqrt(hd)
    no_probs = np.empty((0, 0, 0))
    with limit:
        for T in ATTENTION_TS:
            q, k, v = (rng.standard_normal((T, hd)) for _ in range(3))
            fns: dict[str, Callable[[], object]] = {"numpy": lambda q=q, k=k, v=v: numpy_attention(q, k, v, scale)}
            for label, fmt, mode in ATTENTION_VARIANTS:
                c = FORMAT_CODES[fmt]
                qr, kr, vr = round_array(q, c), round_array(k, c), round_array(v, c)
                out = np.empty((T, hd))
                param = ATTENTION_BLOCK if mode != "standard" else 0
                args = (qr, kr, vr, 0, T, True, 1, scale, c, c, SEQUENTIAL, out, no_probs, ATTENTION_CODES[mode], param)
                fns[label] = lambda args=args: attention_into(*args)
            times = time_interleaved(fns, repeats)
            base = times["numpy"]
            cells = [f"{times[lb] * 1e3:.2f} ({base / times[lb]:.2f})" for lb in labels]
            _row(T, f"{base * 1e3:.2f}", *cells)


def growth_exponent(sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """The least-squares slope of log(seconds) against log(size): time ~ size ** slope."""
    slope, _ = np.polyfit(np.log(np.asarray(sizes, dtype=float)), np.log(np.asarray(seconds, dtype=float)), 1)
    return float(slope)


def bench_growth(repeats: int) -> None:
    """How a decode step's time grows with the cache length and a forward's with T (f64 preset,
    internal entry points); prints the times and the fitted exponents."""
    from kvfast import ModelConfig, Numerics, init_params
    from kvfast.model.cache import KVCache
    from kvfast.model.generation import decode_prepared
    from kvfast.model.transformer import Weights, forward_prepared

    config = ModelConfig(**dict(DECODE_CONFIG, max_pos=max(GROWTH_LENGTHS) + 1))
    params = init_params(config, 0)
    nx = Numerics.preset("f64")
    w = Weights.prepare(config, params, nx)
    rng = np.random.default_rng(4)
    fns: dict[str, Callable[[], object]] = {}
    for L in GROWTH_LENGTHS:
        tokens = rng.integers(0, config.vocab, L + 1).astype(np.int64)
        cache = KVCache.empty(config, nx, L + 1)
        forward_prepared(config, w, tokens[:L], nx, cache)

        def decode(cache=cache, last=int(tokens[L]), L=L):
            cache.truncate(L)
            return decode_prepared(config, w, cache, last, nx)

        fns[f"decode {L}"] = decode
        fns[f"forward {L}"] = lambda t=tokens[:L]: forward_prepared(config, w, t, nx)
    times = time_interleaved(fns, repeats)
    dec = [times[f"decode {L}"] for L in GROWTH_LENGTHS]
    fwd = [times[f"forward {L}"] for L in GROWTH_LENGTHS]
    _header("L (cache length / forward T)", "decode ms", "forward ms")
    for L, a, b in zip(GROWTH_LENGTHS, dec, fwd, strict=True):
        _row(L, f"{a * 1e3:.3f}", f"{b * 1e3:.3f}")
    print(
        f"\nFitted exponent (time ~ L^p, least squares on log-log, {len(GROWTH_LENGTHS)} sizes):"
        f" decode step p = {growth_exponent(GROWTH_LENGTHS, dec):.2f},"
        f" forward p = {growth_exponent(GROWTH_LENGTHS, fwd):.2f}",
        flush=True,
    )


def bench_decode(repeats: int) -> None:
    """One decode step against a full forward of the same length, each through its compiled entry
    and through the public function, and the forward layer by layer from Python; prints a table."""
    from kvfast import ModelConfig, Numerics, decode_step, forward, init_params
    from kvfast.model.cache import KVCache
    from kvfast.model.generation import decode_prepared
    from kvfast.model.transformer import Weights, forward_layers, forward_prepared

    config = ModelConfig(**DECODE_CONFIG)
    params = init_params(config, 0)
    rng = np.random.default_rng(1)
    shape = ", ".join(f"{k} {v}" for k, v in DECODE_CONFIG.items() if k != "max_pos")
    print(f"Model: {shape}. Decode: one step at position L-1 over a cache of L-1; forward: all L positions.")
    print("compiled: decode_prepared / forward_prepared on prepared Weights (one compiled call each);")
    print("public: decode_step / forward (validation, the cached prepared weights); layers: forward_layers")
    print("(the layer-by-layer forward from Python, one call per kernel per layer, as before issue 13).")
    print()
    _header(
        "preset", "L", "decode compiled ms", "decode public ms", "public / compiled", "forward compiled ms",
        "forward public ms", "forward layers ms", "layers / compiled", "forward / decode (compiled)",
    )  # fmt: skip
    for preset in DECODE_PRESETS:
        nx = Numerics.preset(preset)
        w = Weights.prepare(config, params, nx)
        for L in DECODE_LENGTHS:
            tokens = rng.integers(0, config.vocab, L).astype(np.int64)
            cache = KVCache.empty(config, nx, L)
            forward_prepared(config, w, tokens[: L - 1], nx, cache)
            last = int(tokens[-1])

            def compiled_decode(cache=cache, w=w, nx=nx, last=last, L=L):
                cache.truncate(L - 1)
                return decode_prepared(config, w, cache, last, nx)

            def public_decode(cache=cache, nx=nx, last=last, L=L):
                cache.truncate(L - 1)
                return decode_step(config, params, cache, last, L - 1, nx)

            fns = {
                "decode compiled": compiled_decode,
                "decode public": public_decode,
                "forward compiled": lambda w=w, t=tokens, nx=nx: forward_prepared(config, w, t, nx),
                "forward public": lambda t=tokens, nx=nx: forward(config, params, t, nx),
                "forward layers": lambda w=w, t=tokens, nx=nx: forward_layers(config, w, t, nx),
            }
            times = time_interleaved(fns, repeats)
            dc, dp = times["decode compiled"], times["decode public"]
            fc, fp, fl = times["forward compiled"], times["forward public"], times["forward layers"]
            ms = [f"{t * 1e3:.3f}" for t in (dc, dp, fc, fp, fl)]
            _row(preset, L, *ms[:2], f"{dp / dc:.2f}", *ms[2:], f"{fl / fc:.2f}", f"{fc / dc:.1f}")


def _child(code: str, **env: str) -> tuple[object, float]:
    """What a fresh interpreter running ``code`` (``env`` added to the environment) prints last, read as JSON, and
    the wall seconds of the whole process."""
    w0 = time.perf_counter()
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - w0


def bench_compile(repeats: int) -> None:
    """Cold compile (empty Numba cache) and warm start (filled cache) of import + one generate."""
    print("Fresh interpreter: import kvfast, one generate (2 layers, 3-token prompt, 4 steps, f64).")
    print()
    with tempfile.TemporaryDirectory(prefix="kvfast-numba-") as cache_dir:
        # the first start compiles into the empty cache; the others read it
        runs = [_child(COMPILE_CHILD, NUMBA_CACHE_DIR=cache_dir) for _ in range(repeats + 1)]
    cold, *warm = ({**result, "process_wall": wall} for result, wall in runs)
    med = {k: statistics.median(r[k] for r in warm) for k in ("cpu", "wall", "process_wall")}
    _header("start", "runs", "CPU s", "wall s", "wall s incl. interpreter start")
    for start, count, figures in (("cold (empty cache)", 1, cold), ("warm (cached)", repeats, med)):
        _row(start, count, *(f"{figures[k]:.2f}" for k in ("cpu", "wall", "process_wall")))
    print(f"\ncold / warm (CPU): {cold['cpu'] / med['cpu']:.0f}x", flush=True)
    probe = statistics.median(_child(BLAS_PROBE_CHILD)[0] for _ in range(repeats))
    print(
        f"Numba's BLAS probe as Numba runs it (importing scipy.linalg.cython_blas when its CPU target starts,"
        f" numpy already imported), which kvfast.model.compiled answers without that import: {probe:.2f} s CPU"
        f" saved per warm start (median of {repeats} fresh interpreters).",
        flush=True,
    )


def main(repeats: int = 5, sections: Sequence[str] = SECTIONS) -> int:
    """Run the kernel benchmarks and print their tables; returns the exit code (0).

    ``repeats`` (>= 1): samples per figure, the median is printed. ``sections``:
    any of ``matmul``, ``attention``, ``decode``, ``growth``, ``compile``, in that order.
    """
    require_int(repeats, "repeats", minimum=1)
    for section in sections:
        require_choice(section, "sections", SECTIONS)
    print("# kvfast bench kernels")
    print()
    print_machine()
    print(f"Medians of {repeats} samples; CPU time of this process (time.process_time).")
    headings = {  # each section's heading and what prints it
        "matmul": ("matmul (T x d) @ (d x d), one thread", _matmul_section),
        "attention": ("attention against NumPy float64 (BLAS), one thread", bench_attention),
        "decode": ("decode_step against forward", bench_decode),
        "growth": ("how cost grows: decode step against cache length, forward against T", bench_growth),
        "compile": ("compile: cold against warm start", bench_compile),
    }
    for section in SECTIONS:
        if section in sections:
            heading, bench = headings[section]
            print(f"\n## {heading}\n")
            bench(repeats)
    return 0


def _matmul_section(repeats: int) -> None:
    """The matmul section: the kernels against BLAS, its wall time, then the bf16 accumulator's loop."""
    c0 = time.perf_counter()
    bench_matmul(repeats)
    print(f"\n(section wall time {time.perf_counter() - c0:.0f} s, including any first-call compile)")
    print("\n### bf16 accumulator: kernel against a NumPy + ml_dtypes loop of the same semantics\n")
    bench_bf16_loop(repeats)
