"""vLLM models as models under test: ``VLLMModel(path | LLM)`` (extra ``kvfast[vllm]``, its own venv: docs/engines.md).

A vLLM engine (a model directory vLLM can load, or a ``vllm.LLM`` built with ``logprobs_mode="raw_logits"`` and
``max_logprobs=-1``) behind the check protocol (:mod:`kvfast.check.protocol`)::

    report = kvfast.check_cache(VLLMModel("path/to/model"), prompt=[1, 2, 3], steps=32, mode="control")

vLLM has no cache-free forward: every row it hands back was computed through its paged KV cache. What the
adapter asks of it (one in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; every row over the full
vocabulary as raw logits: ``prompt_logprobs=-1`` for a prompt's rows, ``logprobs=-1`` for each decoded row):

- ``recompute(tokens)``: one request over ``tokens`` that reads no prefix cache (vLLM's own prefill of the
  whole sequence, the reference), under a prefix-cache salt of its own (``cache_salt``), so the cached path
  never hits its blocks (and no reset of the prefix cache is needed).
- ``prefill(tokens)``: a request over ``tokens`` under a new salt (a fresh history: no block of an earlier
  request to hit) that may decode greedily ``speculate`` tokens, stepped through its prefill only. The first
  ``decode(token)`` steps it to its end (its decoded rows kept) and hands back the next kept row while
  ``token`` is the one vLLM decoded (the checker's greedy tokens are vLLM's own), so a whole check's decode
  path is ONE request, vLLM's real decode. A token vLLM did not choose starts a new request over the
  sequence and that token, reading the prefix cache (the rows from there are a resume).
- ``extend(tokens)``: a new request over the sequence and ``tokens`` (the history's salt) that reads the
  prefix cache: the resumed chunk is computed over a real prefix-cache hit (the full blocks of the earlier
  request; a first chunk shorter than a block, :data:`BLOCK` tokens, leaves none: the whole sequence is then
  prefilled).
- ``recompute_variants`` (control mode's order noise, each from vLLM itself, never the cached path's requests):
  ``"stepwise"`` (the sequence's last :data:`DECODE_ROWS` positions computed one token a scheduler step over the
  cached keys of the rest: the attention a decode step runs, split-KV and the thread count as the engine runs them),
  ``"chunk"`` (the sequence recomputed as a chunked prefill of :data:`CHUNKS` chunks: other shapes, attention over
  cached keys) and ``"rows"`` (the recompute with every linear layer run on :data:`ROWS` row at a time: the GEMM
  kernel a decode step runs, the prefill's attention). vLLM's CPU GEMMs depend on their row count: in bfloat16 on a
  CPU with AMX, a linear layer whose weight is under 1 MiB runs sgl-kernel's ``weight_packed_linear``, an AVX-512
  kernel for up to 4 rows and an AMX one above, which add up in another order; measured on the tiny test model, a
  decode row then differs from vLLM's own prefill of the same tokens by up to 1 bfloat16 unit of the logits (control
  mode: ``rounding``, the ``"rows"`` variant measuring that noise). Exact mode judges the cache, like with like:
  :meth:`VLLMModel.prepare_check` probes the engine once (:meth:`VLLMModel.row_count_effect`: the same rows through
  every linear layer alone and among :data:`~.vllm_rows.PROBE_ROWS`) and, where the row count changes the GEMMs'
  arithmetic, runs every GEMM one row at a time on both paths for an exact check (``gemm_rows="auto"``, the
  default), saying so in the report with the size measured; control mode keeps vLLM's own arithmetic.
- How vLLM runs: as it serves, its own thread count and attention kernels (split-KV decode attention, vLLM's
  default). Exact mode then compares a split decode with an unsplit prefill and says so in a note
  (:meth:`VLLMModel.prepare_check`); control and auto modes measure that order with the ``"stepwise"`` variant. One
  thread (``threads=1``) or ``VLLM_CPU_ATTN_SPLIT_KV=0`` (vLLM's, in the environment) are the user's to ask for.
- ``internal_formats``: the model's dtype for the KV cache and the compute (``{"kv cache": "bfloat16",
  "compute": "bfloat16"}``); no ``promote``: vLLM's CPU backend has no float64.

Where no public way exists the adapter hooks vLLM's engine (:mod:`kvfast.check.engines.vllm_patches`: each hook,
the release it was written for); the GEMM row pinning lives in :mod:`kvfast.check.engines.vllm_rows`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
import weakref
from pathlib import Path
from unittest import mock

import numpy as np

from kvfast.check.engines import choose_variants, run_variants, vllm_patches, vllm_rows
from kvfast.validation import import_extra, not_allowed, require_choice, require_int

#: How vLLM is run: the engine core in this process (the adapter reads its rows and hooks its attention) and a
#: 1 GiB KV cache, set before vLLM is imported, each unless the environment already sets it. Nothing else: the
#: thread count and the attention kernels are vLLM's own (split-KV decode attention as vLLM defaults it), as it
#: serves; ``threads`` (an adapter option) and ``VLLM_CPU_ATTN_SPLIT_KV=0`` (vLLM's, in the environment) are the
#: user's to set.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
#: The vllm-cpu releases the adapter is tested on (``python3 dev.py test-vllm``, and the same tests in a venv of each
#: other release: docs/engines.md): its hooks reach into vLLM's engine (:data:`~.vllm_patches.HOOKS`); outside
#: them :func:`check_release` warns. (0.27.x computes wrong decode logits for hybrid models with the hybrid KV
#: cache manager disabled, a bug of vLLM's that the adapter finds: docs/engines.md.)
RELEASES = ("0.27", "0.28", "0.29", "0.30", "0.31", "0.32")
DTYPES = ("float32", "bfloat16")
VARIANTS = ("stepwise", "chunk", "rows")
#: The ``decode`` variant's positions computed one token a step (the decode steps of a check of 32 steps): vLLM's
#: CPU attention splits the keys of a one-token query into partitions summed apart (split-KV, its default, on
#: more than one thread), which a prefill, and a chunk of 4 tokens, never does. Measured on the tiny test model
#: (float32, prompt 70, 2 threads): the decode rows differ from the prefill's by up to 5.6e-7 relative on 5 of 32
#: steps, and this variant's rows equal the decode's bit for bit (chunks of 2 tokens: 1 row differs; of 4: none).
DECODE_ROWS = 32
#: The ``stepwise`` variant is admitted as order noise only within this many times what one unit in the last place
#: of every attention output does to the logits (:meth:`VLLMModel._split_beyond_rounding`). Measured on a tiny
#: Gemma-3-style model (a window of 128 in one layer of two, prompt 200, 2 threads): a correct vLLM (0.28) at 1.04x
#: (float32) and 0.31x (bfloat16); vLLM 0.27, whose split decode attention drops the keys before the window in the
#: full-attention layers, at 2.3e5x and 11x.
SPLIT_MARGIN = 4
#: The chunks of the ``chunk`` variant's prefill (the sequence's first half, then the rest over its cached keys).
#: Measured (``benchmarks/engines_vllm.py --only variants``): on a prompt of 70 tokens it measures no noise (16
#: tokens a chunk neither), yet on 3,500 tokens it is the one source of the resumed chunk's noise (up to 9.8e-7
#: relative; without it a correct engine is ``inconclusive``), at 0.57 s a variant there against 1.44 s for 16
#: tokens a chunk.
CHUNKS = 2
#: The rows per GEMM call of the ``rows`` variant: one, as in a decode step of one request.
ROWS = 1
#: ``gemm_rows``' default: exact mode pins the GEMMs to one row where the row count changes them (the probe).
AUTO = "auto"
GEMM_ROWS = "'auto', None (vLLM's GEMMs as they run) or an integer >= 1 (rows per GEMM call)"
#: vLLM's CPU attention: block sizes a multiple of 32, head size at least 32.
BLOCK = 32
MODEL = "a model directory vLLM can load (config.json and weights) or a vllm.LLM"

#: The ids of the adapters' own requests: integers, as ``LLM.generate``'s (it sorts its outputs by them), far
#: above them, one sequence for every adapter in the process.
_REQUEST_IDS = itertools.count(10**15)
_SALTS = itertools.count()


def _salt() -> str:
    """A prefix-cache salt used once: vLLM hashes it into a request's blocks, so only requests given the same
    salt share blocks (the cached path's own history; never the reference's). No reset of the cache needed."""
    return f"kvfast-{os.getpid()}-{next(_SALTS)}"


def _prompt(tokens: list[int], salt: str | None = None):
    """vLLM's prompt of ``tokens`` under prefix-cache salt ``salt`` (``None``: one of its own, :func:`_salt`)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=tokens, cache_salt=salt or _salt())


#: Each engine's row-count effect once probed (:meth:`VLLMModel.row_count_effect`): ``{vllm.LLM: units}``.
_ROW_EFFECTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Each engine's linear layers once found (:meth:`VLLMModel._linear_layers`): ``{vllm.LLM: [layer, ...]}``.
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vllm():
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vllm = import_extra("vllm", "a vLLM model", "vllm")  # first: without torch, the missing extra, in one line
    _keep_set_threads()  # (vLLM's engine replaces torch's set_num_threads when it starts, not when imported)
    check_release(vllm.__version__)
    vllm_patches.install()
    return vllm


def check_release(version: str) -> bool:
    """Whether ``version`` (vLLM's) is one of :data:`RELEASES`; a one-line warning (once) where it is not."""
    supported = version.startswith(tuple(f"{r}." for r in RELEASES))
    if not supported and version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(
            f"kvfast's vLLM adapter supports vllm-cpu {RELEASES[0]}.x to {RELEASES[-1]}.x; this is vLLM {version}: "
            "the adapter's hooks into vLLM may not fit it (a hook that no longer finds its place fails, naming it)",
            RuntimeWarning,
            stacklevel=3,
        )
    return supported


_WARNED: set[str] = set()


def split_kv() -> bool:
    """Whether this process's vLLM splits the keys of a decode step's attention (``VLLM_CPU_ATTN_SPLIT_KV``, read
    by vLLM once per process; on by default)."""
    from vllm import envs

    return bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


#: torch's own ``set_num_threads``, kept before vLLM's CPU worker replaces it with one that refuses (``threads``).
_SET_THREADS = None


def _keep_set_threads() -> None:
    global _SET_THREADS
    import torch

    if _SET_THREADS is None and getattr(torch.set_num_threads, "__module__", "") == "torch":
        _SET_THREADS = torch.set_num_threads


def _threads(n: int | None) -> contextlib.ExitStack:
    """torch's intra-op threads (vLLM's CPU kernels run on them) set to ``n`` now, and back when the context this
    returns exits (``None``: as they are)."""
    import torch

    saved, restore = torch.get_num_threads(), contextlib.ExitStack()
    if n is not None and n != saved:
        _SET_THREADS(n)
        restore.callback(_SET_THREADS, saved)
    return restore


#: What the adapter needs of an engine: every row's raw logits over the full vocabulary.
REQUIRED_ARGS = {"logprobs_mode": "raw_logits", "max_logprobs": -1}
#: What :func:`vllm_engine` builds unless told otherwise: eager (no compile step; the tiny test model builds in
#: seconds) and no tokenizer (the adapter feeds token ids).
DEFAULT_ARGS = {"enforce_eager": True, "skip_tokenizer_init": True}


def vllm_engine(model, **engine_args):
    """A ``vllm.LLM`` over ``model`` (a model directory) built as :class:`VLLMModel` needs it, the public way to
    build one's own engine for the adapter: its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    set here before the engine is built), :data:`REQUIRED_ARGS`, :data:`DEFAULT_ARGS` unless given, and any other
    of vLLM's engine arguments (``vllm.EngineArgs``' fields) as given. ``ValueError`` naming the argument for one
    that is not an engine argument, or that changes :data:`REQUIRED_ARGS`."""
    import dataclasses

    vllm = _vllm()
    allowed = {f.name for f in dataclasses.fields(vllm.EngineArgs)} - {"model"}
    for key, value in engine_args.items():
        if key not in allowed:
            raise not_allowed(key, value, "one of vLLM's engine arguments (the fields of vllm.EngineArgs but model)")
        if key in REQUIRED_ARGS and value != REQUIRED_ARGS[key]:
            raise not_allowed(key, value, f"{REQUIRED_ARGS[key]!r} (the adapter reads every row's raw logits)")
    return vllm.LLM(model=str(model), **{**DEFAULT_ARGS, **engine_args, **REQUIRED_ARGS})


def is_vllm_llm(model: object) -> bool:
    """Whether ``model`` is a ``vllm.LLM`` (imports nothing)."""
    return type(model).__name__ == "LLM" and type(model).__module__.startswith("vllm")


def _built_engine(path, own: dict, engine_args: dict):
    """The ``vllm.LLM`` a :class:`VLLMModel` builds from a model directory: the adapter's ``own`` options
    validated and named as vLLM names them, then any other engine argument as it is."""
    if not isinstance(path, str | os.PathLike) or not (Path(path) / "config.json").is_file():
        raise not_allowed("path", path, MODEL)
    require_choice(own["dtype"], "dtype", DTYPES)
    block_size = require_int(own["block_size"], "block_size", BLOCK)
    if block_size % BLOCK:
        raise not_allowed("block_size", block_size, f"a multiple of {BLOCK} (vLLM's CPU attention)")
    kwargs = dict(
        dtype=own["dtype"], enable_prefix_caching=bool(own["prefix_caching"]), block_size=block_size,
        seed=require_int(own["seed"], "seed", 0),
    )  # fmt: skip
    if own["max_model_len"] is not None:
        kwargs["max_model_len"] = require_int(own["max_model_len"], "max_model_len", 1)
    if own["kv_blocks"] is not None:
        kwargs["num_gpu_blocks_override"] = require_int(own["kv_blocks"], "kv_blocks", 1)
    for key in engine_args:
        if key in kwargs or key in ("enable_prefix_caching", "num_gpu_blocks_override"):
            mine = "the adapter's own option (dtype, prefix_caching, block_size, max_model_len, seed, kv_blocks)"
            raise not_allowed(key, engine_args[key], mine)
    return vllm_engine(Path(path), **kwargs, **engine_args)


class VLLMModel:
    """A vLLM engine behind the check protocol (see the module doc).

    - ``path``: a model directory (a fresh engine is built: ``dtype``, ``prefix_caching``, ``block_size``,
      ``max_model_len``, ``seed`` apply) or a ``vllm.LLM`` built in this process with
      ``logprobs_mode="raw_logits"`` and ``max_logprobs=-1``.
    - ``speculate``: decode steps run ahead in each request (the checker's first ``speculate`` decodes after a
      ``prefill`` or ``extend`` are served from them; a later one resumes in a new request).
    - ``variants``: a subset of :data:`VARIANTS` (control mode's order noise).
    - ``gemm_rows``: ``n``: every linear layer, on the cached path and in the recompute alike, runs its GEMM on
      ``n`` rows at a time (``1``: the kernel of a one-request decode step everywhere); ``None``: vLLM's GEMMs as
      they run; ``"auto"`` (the default): ``1`` in an exact check where :meth:`row_count_effect` finds that the
      row count changes the GEMMs (bfloat16 on AMX CPUs: module doc), else as they run (control mode always).
      The cache's logic is unchanged; what no longer differs is the GEMM kernel chosen by row count, so exact
      mode judges the cache alone. :meth:`prepare_check` resolves it for each check (:attr:`rows_pinned`, which
      stays so after the check) and says so in the report.
    - ``prefill_chunk``: the cached path's prefills chunked to ``n`` tokens a scheduler step (vLLM's chunked
      prefill); the recompute stays unchunked, an independent reference.
    - ``companions``: other requests (prompts of the same length, their own prefix-cache salts) decoding in the
      same steps as each cached-path request: requests in flight together (batch invariance).
    - ``kv_blocks``: the KV cache's blocks (a model directory only; vLLM's ``num_gpu_blocks_override``): a small
      budget with ``companions`` forces preemptions (:attr:`preemptions` counts those of the cached path's).
    - ``threads``: every engine call of the adapter runs on ``n`` threads (torch's intra-op threads, which vLLM's
      CPU kernels run on); ``None`` (the default): the engine's own, as it serves.
    - ``**engine_args``: any other of vLLM's engine arguments (``vllm.EngineArgs``' fields, e.g.
      ``disable_hybrid_kv_cache_manager=True``), passed to ``vllm.LLM`` (a model directory only:
      :func:`vllm_engine`).
    """

    def __init__(
        self,
        path,
        *,
        dtype: str = "float32",
        prefix_caching: bool = True,
        block_size: int = BLOCK,
        max_model_len: int | None = None,
        speculate: int = 32,
        variants=VARIANTS,
        seed: int = 0,
        gemm_rows: int | str | None = AUTO,
        prefill_chunk: int | None = None,
        companions: int = 0,
        kv_blocks: int | None = None,
        threads: int | None = None,
        **engine_args,
    ) -> None:
        _vllm()
        if gemm_rows is not None and gemm_rows != AUTO:
            try:
                gemm_rows = require_int(gemm_rows, "gemm_rows", 1)
            except ValueError:
                raise not_allowed("gemm_rows", gemm_rows, GEMM_ROWS) from None
        self.gemm_rows = gemm_rows
        #: the rows per GEMM call now (``None``: as vLLM runs them): ``gemm_rows`` resolved for the check
        self.rows_pinned: int | None = gemm_rows if isinstance(gemm_rows, int) else None
        self.prefill_chunk = None if prefill_chunk is None else require_int(prefill_chunk, "prefill_chunk", 1)
        self.companions = require_int(companions, "companions", 0)
        self.variants = choose_variants(variants, VARIANTS)
        self.speculate = require_int(speculate, "speculate", 1)
        self.threads = None if threads is None else require_int(threads, "threads", 1)
        if self.threads is not None and _SET_THREADS is None:
            raise not_allowed(
                "threads", threads, "None here: vLLM's CPU worker was built before kvfast's adapter was imported, "
                "and it refuses torch.set_num_threads (set OMP_NUM_THREADS in the environment instead)"
            )  # fmt: skip
        if is_vllm_llm(path):
            if engine_args:
                key = sorted(engine_args)[0]
                raise not_allowed(key, engine_args[key], "no engine argument with a vllm.LLM (it is built)")
            self.llm, self.path = path, None
        else:
            self.path = Path(path) if isinstance(path, str | os.PathLike) else path
            own = dict(dtype=dtype, prefix_caching=prefix_caching, block_size=block_size, max_model_len=max_model_len,
                       seed=seed, kv_blocks=kv_blocks)  # fmt: skip
            with _threads(self.threads):
                self.llm = _built_engine(path, own, engine_args)
        if self._core() is None:
            raise not_allowed(
                "path", "a vllm.LLM whose engine core runs in another process",
                "one built in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0 set before (vllm_engine() sets it)",
            )  # fmt: skip
        config = self.llm.llm_engine.vllm_config
        if str(config.model_config.logprobs_mode) not in ("raw_logits", "LogprobsMode.RAW_LOGITS"):
            raise not_allowed("model.logprobs_mode", config.model_config.logprobs_mode, "raw_logits")
        if config.model_config.max_logprobs != -1:
            raise not_allowed("model.max_logprobs", config.model_config.max_logprobs, "-1 (the full vocabulary)")
        self.vocab_size = int(config.model_config.get_vocab_size())
        # a request's tokens leave vLLM room for the one it generates (a row of the last position is such a request)
        self.max_positions = int(config.model_config.max_model_len) - 1
        self.block_size = int(config.cache_config.block_size)
        fmt = str(config.model_config.dtype).removeprefix("torch.")
        self.internal_formats = {"kv cache": fmt, "compute": fmt}
        self.skipped_variants: dict[str, str] = {}
        self.tokens: list[int] | None = None
        self._history = _salt()  # the prefix-cache salt of the cached path's requests since the last prefill
        self._live: str | None = None  # the cached-path request running in the engine
        self._others: list[str] = []  # the companions running with it
        self.preemptions = 0  # times the scheduler preempted a cached-path request
        self._sampled = -1  # the token the live request chose last (fed by the next decode)
        self._captured: dict[str, np.ndarray] = {}  # each tracked request's last raw logits row (_patch_sampling)
        self._row: np.ndarray | None = None  # the row that chose _sampled
        self._ahead: list[tuple[int, np.ndarray]] = []  # decoded (token fed, its row) kept when it stopped
        self.requests = 0  # requests sent to the engine
        self.last_hit = 0  # prefix-cache tokens the last cached-path request read
        if self.rows_pinned:
            self._warm_up()

    def __repr__(self) -> str:
        rows = "" if self.gemm_rows == AUTO else f", gemm_rows={self.gemm_rows}"
        threads = "" if self.threads is None else f", threads={self.threads}"
        return f"VLLMModel({str(self.path) if self.path else 'LLM'!r}{rows}{threads})"

    # --- requests ---------------------------------------------------------------------------------------------

    def _params(self, max_tokens: int, prompt_rows: bool, read_cache: bool, decoded_rows: bool = True):
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=-1 if decoded_rows else None,
            prompt_logprobs=-1 if prompt_rows else None,
            detokenize=False, skip_reading_prefix_cache=not read_cache, ignore_eos=True, flat_logprobs=True,
        )  # fmt: skip

    @contextlib.contextmanager
    def _engine(self, cached_path: bool):
        """What every engine call of the adapter runs under: the bug hook live on the cached path only, the
        GEMMs split into rows (``gemm_rows``), ``threads``, vLLM's flat logprobs appended fast."""
        pinned = self.rows_pinned
        rows = vllm_rows.gemm_rows(self._linear_layers(), pinned) if pinned else contextlib.nullcontext()
        with vllm_patches.cached_path(self if cached_path else None), rows, _threads(self.threads):
            with vllm_patches.flat_appends():
                yield

    def _check_length(self, tokens: list[int]) -> None:
        if len(tokens) > self.max_positions:
            raise not_allowed("positions", len(tokens), f"at most {self.max_positions} (max_model_len)")

    def _new_requests(self, prompts: list[list[int]]) -> None:
        """Before requests over ``prompts`` that are not the cached path's: their lengths checked, the live
        cached-path request stepped to its end (its rows kept for :meth:`decode`), the requests counted."""
        for p in prompts:
            self._check_length(p)
        self._run_to_end()
        self.requests += len(prompts)

    def _generate(self, prompts: list[list[int]], params: list, cached_path: bool) -> list:
        """One ``LLM.generate`` of ``prompts`` (the live cached-path request stepped to its end first, its rows
        kept for :meth:`decode`), each under a salt
        of its own: no later request hits a block of theirs."""
        self._new_requests(prompts)  # LLM.generate would run the live request to its end too, with its rows
        with self._engine(cached_path):
            return self.llm.generate([_prompt(p) for p in prompts], params, use_tqdm=False)

    def _flat_rows(self, flat, indices) -> np.ndarray:
        """Rows ``indices`` of vLLM's ``FlatLogprobs`` ``flat`` (every position's full vocabulary, flat lists:
        no dict per row) as ``(len(indices), V)`` float32."""
        ids = np.asarray(flat.token_ids, np.int64)
        values = np.asarray(flat.logprobs, np.float32)  # float32 logits read back as Python floats: exact
        rows = np.empty((len(indices), self.vocab_size), np.float32)
        for k, i in enumerate(indices):
            span = slice(flat.start_indices[i], flat.end_indices[i])
            given = np.count_nonzero(np.bincount(ids[span], minlength=self.vocab_size))  # distinct token ids
            if given < self.vocab_size:
                raise RuntimeError(f"vLLM returned {given} of {self.vocab_size} logits for a row")
            rows[k, ids[span]] = values[span]
        return rows

    def _rows_of(self, output, first: int, last: np.ndarray | None = None) -> np.ndarray:
        """The rows of prompt positions ``first`` .. end of ``output`` (prompt logprobs, then the prompt's last
        position's: ``last``, else the first decoded row's logprobs)."""
        n = len(output.prompt_token_ids)
        prompt = output.prompt_logprobs
        if prompt is None or len(prompt) < n:
            raise RuntimeError(f"vLLM returned no prompt logprobs for some of the {n} positions")
        # prompt logprobs entry p + 1 is the row of position p (entry 0, the first token's, is empty)
        rows = self._flat_rows(prompt, range(first + 1, n)) if first + 1 < n else np.empty((0, self.vocab_size))
        last = self._flat_rows(output.outputs[0].logprobs, [0])[0] if last is None else last
        return np.concatenate([rows, last[None]]).astype(np.float32)

    def _start(self, tokens: list[int], first: int, read_cache: bool) -> np.ndarray:
        """A cached-path request over ``tokens`` decoding up to ``speculate`` tokens, stepped only through its
        prefill: its rows from ``first`` (the last chose the token a decode is fed next). The first
        :meth:`decode` (or another request) steps it to its end; a prefill or extend before that ends it (no
        decode step is spent on a sequence no decode continues)."""
        from vllm.sampling_params import RequestOutputKind

        self._check_length(tokens)
        self._stop()
        self._ahead = []
        if not read_cache:  # a new history: no block of an earlier request to hit
            self._history = _salt()
        # each decoded row is the sampler's, handed over by _patch_sampling's hook (no decoded_rows)
        steps = max(1, min(self.speculate + 1, self.max_positions - len(tokens)))
        params = self._params(steps, True, read_cache, decoded_rows=False)
        params.output_kind = RequestOutputKind.DELTA
        self._live = str(next(_REQUEST_IDS))
        self.requests += 1
        # other requests in the same steps (their rows are not read), sent first: under a block budget the
        # scheduler preempts the latest request, the cached path's
        for k in range(self.companions):
            other = [(t * (k + 2) + k + 1) % self.vocab_size for t in tokens]
            self._others.append(str(next(_REQUEST_IDS)))
            quiet = self._params(params.max_tokens, False, False, decoded_rows=False)
            self.llm.llm_engine.add_request(self._others[-1], _prompt(other), quiet)
        self.llm.llm_engine.add_request(self._live, _prompt(tokens, self._history), params)
        out = self._step()
        self.last_hit = int(out.num_cached_tokens or 0)
        self.tokens = list(tokens)
        return self._rows_of(out, first, self._row)

    def _step(self):
        """Step the engine until the live request outputs its next token: that output (``DELTA``: the new
        token, and after the prefill the prompt's rows); the row that chose the token in :attr:`_row`."""
        engine = self.llm.llm_engine
        budget = self._token_budget(self.prefill_chunk) if self.prefill_chunk else contextlib.nullcontext()
        self._captured = {}
        with self._engine(cached_path=True), budget:
            while engine.has_unfinished_requests():
                found = None
                for out in engine.step():
                    if out.request_id == self._live and out.outputs and out.outputs[0].token_ids:
                        found = out
                if found is not None:
                    self._row, self._sampled = self._captured.pop(self._live, None), int(found.outputs[0].token_ids[-1])
                    if self._row is None:
                        raise RuntimeError("vLLM sampled a token of the cached path without handing its logits")
                    if found.finished:
                        self._live = None
                        self._stop()  # its companions
                    return found
        raise RuntimeError("vLLM finished the request without a token")

    def _run_to_end(self) -> None:
        """Step the live request to its end, keeping each (token fed, its row) for :meth:`decode`."""
        while self._live is not None:
            token = self._sampled
            self._step()
            self._ahead.append((token, self._row))
        self._stop()

    def _stop(self) -> None:
        """End the live request (not yet decoded: nothing of it is kept) and its companions before another
        request runs."""
        running = [r for r in (self._live, *self._others) if r is not None]
        if running:
            self.llm.llm_engine.abort_request(running)
        self._live, self._others = None, []

    def _warm_up(self) -> None:
        """One request with vLLM's GEMMs as they are, before any is split into rows: measured here, a first
        forward whose GEMMs all take the few-row kernel dies of SIGILL in the CPU attention's AMX kernel (the
        AMX tile state is set up by the many-row GEMM kernel)."""
        prompt = _prompt([i % self.vocab_size for i in range(2 * BLOCK)])
        self.llm.generate([prompt], self._params(1, False, False), use_tqdm=False)

    # --- the check's set-up -----------------------------------------------------------------------------------

    def prepare_check(self, plan) -> list[str]:
        """The checker's hook before a check (``plan``: its :class:`~kvfast.check.protocol.CheckPlan`):
        ``gemm_rows`` resolved for how it judges (:attr:`rows_pinned`), and notes saying how the GEMMs ran when
        the row count changes them on this CPU (:meth:`row_count_effect`) or ``gemm_rows`` is the user's."""
        exact = not plan.measures_noise  # bit for bit; else vLLM's own arithmetic, the variants its noise
        notes = self._split_note() if exact else []
        if isinstance(self.gemm_rows, int):
            self.rows_pinned = n = self.gemm_rows
            return [f"every GEMM of vLLM ran {n} row{'s' if n > 1 else ''} at a time on both paths (gemm_rows={n})"]
        self.rows_pinned = None
        if not exact:
            return []
        units = self.row_count_effect()
        if units == 0:
            return notes
        fmt = self.internal_formats["compute"]
        effect = (
            f"vLLM's {fmt} GEMMs on this CPU change with the row count by up to {units:g} {fmt} "
            f"unit{'' if units == 1 else 's'} in the last place (the same rows through every linear layer alone "
            f"and among {vllm_rows.PROBE_ROWS})"
        )
        if self.gemm_rows is None:
            return notes + [
                f"{effect}; exact mode ran them as vLLM does (gemm_rows=None), so a decode step (one row) can differ "
                "from the prefill of the same tokens by that much whatever the cache does; the default "
                "(gemm_rows='auto') runs them one row at a time on both paths, and control mode judges vLLM's "
                "default arithmetic"
            ]
        self.rows_pinned = 1
        return notes + [
            f"{effect}; exact mode ran them one row at a time on both paths (gemm_rows=1); control mode checks "
            "vLLM's default arithmetic"
        ]

    def _split_note(self) -> list[str]:
        """Exact mode's note where vLLM splits a decode step's attention (:func:`split_kv`)."""
        import torch

        if not split_kv():
            return []
        n = self.threads or torch.get_num_threads()
        return [
            f"vLLM's decode attention splits the keys into partitions summed apart (split-KV, vLLM's default; {n} "
            f"thread{'s' if n > 1 else ''}), its prefill does not: exact mode compares the two orders, so a decode "
            "step can differ from the prefill of the same tokens by rounding whatever the cache does; control and "
            "auto modes measure that order (the 'stepwise' variant); threads=1 or VLLM_CPU_ATTN_SPLIT_KV=0 check "
            "another configuration than vLLM serves with"
        ]

    def row_count_effect(self) -> float:
        """How far vLLM's GEMMs on this CPU change with their row count (:func:`.vllm_rows.row_count_effect`: units
        in the last place), probed once per engine with its GEMMs as vLLM runs them. ``0.0``: not at all."""
        if self.llm not in _ROW_EFFECTS:
            with mock.patch.object(self, "rows_pinned", None):
                layers = self._linear_layers()
                _ROW_EFFECTS[self.llm] = vllm_rows.row_count_effect(layers, self.recompute, self.vocab_size)
        return _ROW_EFFECTS[self.llm]

    # --- the protocol -----------------------------------------------------------------------------------------

    def recompute(self, tokens):
        """vLLM's own prefill of ``tokens``, reading no prefix cache: ``(T, V)``."""
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        out = self._generate([tokens], [self._params(1, True, False)], cached_path=False)[0]
        return self._rows_of(out, 0)

    def prefill(self, tokens):
        """A fresh request over ``tokens`` (no prefix cache read); ``(T, V)``; decodes continue it."""
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        return self._start(tokens, 0, read_cache=False)

    def extend(self, tokens):
        """A new request over the sequence and ``tokens``, reading the prefix cache: ``(n, V)``."""
        self._require()
        first = len(self.tokens)
        tokens = self.tokens + [int(t) for t in np.asarray(tokens).reshape(-1)]
        return self._start(tokens, first, True)

    def decode(self, token):
        """The row after ``token``: from the running request while ``token`` is the one vLLM decoded, else a
        new request over the sequence and ``token``, reading the prefix cache."""
        self._require()
        token = require_int(token, "token", 0, self.vocab_size - 1)
        self._run_to_end()
        if self._ahead and self._ahead[0][0] == token:
            self.tokens.append(token)
            return self._ahead.pop(0)[1]
        return self._start(self.tokens + [token], len(self.tokens), read_cache=True)[0]

    def _require(self) -> None:
        if self.tokens is None:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")

    # --- order noise ------------------------------------------------------------------------------------------

    def recompute_variants(self, tokens) -> dict:
        """Recomputes of ``tokens`` by vLLM that differ from :meth:`recompute` only in how they add up; a variant
        that cannot run is left out and named in :attr:`skipped_variants`, and so is ``rows`` where the row count
        changes no GEMM (:meth:`row_count_effect` is 0: it would measure nothing, at half a plain generation)."""
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if "rows" in self.variants and "rows" not in self.skipped_variants and self.row_count_effect() == 0:
            self.skipped_variants["rows"] = (
                "vLLM's GEMMs on this CPU do not change with the row count (the same rows through every linear "
                f"layer alone and among {vllm_rows.PROBE_ROWS} agree bit for bit): the variant would equal the "
                "recompute"
            )
        if "stepwise" in self.variants and "stepwise" not in self.skipped_variants and not split_kv():
            self.skipped_variants["stepwise"] = (
                "vLLM's split-KV attention is off (VLLM_CPU_ATTN_SPLIT_KV=0): a decode step's attention adds up "
                "as the prefill's, and the variant would equal the recompute"
            )
        compute = {"stepwise": self._stepwise, "chunk": self._chunked, "rows": self._rows}
        out = run_variants(self, self.variants, lambda name: compute[name](tokens))
        refused = self._split_beyond_rounding(tokens, out["stepwise"]) if "stepwise" in out else None
        if refused:
            self.skipped_variants["stepwise"] = refused
            del out["stepwise"]
        return out

    def _split_beyond_rounding(self, tokens: list[int], stepwise: np.ndarray) -> str | None:
        """Why the ``stepwise`` variant's rows are not order noise, else ``None``. The variant runs vLLM's split
        decode attention itself, so whatever that path computes wrong it shares with the cached path; it is
        admitted only within :data:`SPLIT_MARGIN` times what one unit in the last place of every attention output
        does to the same rows (:meth:`recompute` with every attention layer's output moved one unit in its last
        place, up and down in turn: :func:`.vllm_patches.attention_outputs_moved`; vLLM's prefill attention, never a
        decode step's): split-KV adds the same terms in float32 in another order, so it can move an attention output
        by about one unit."""
        n = min(DECODE_ROWS, len(tokens) - 1)
        reference = self.recompute(tokens)[-n:]
        split = float(np.abs(stepwise[-n:] - reference).max())
        with vllm_patches.attention_outputs_moved(self._model()):
            unit = float(np.abs(self.recompute(tokens)[-n:] - reference).max())
        if split <= SPLIT_MARGIN * unit:
            return None
        ratio = split / unit if unit else float("inf")
        return (
            f"vLLM's split decode attention (one token a step over cached keys) moved the logits by {split:.3g}, "
            f"{ratio:.3g}x what one unit in the last place of every attention output moves them ({unit:.3g}), "
            f"more than the {SPLIT_MARGIN}x that adding the same terms in another order can explain: its decode "
            "attention differs from its prefill's in logic, not order, and the variant measures no order noise"
        )

    def _stepwise(self, tokens: list[int]) -> np.ndarray:
        self._new_requests([tokens])
        request, engine, found = str(next(_REQUEST_IDS)), self.llm.llm_engine, None
        with self._engine(cached_path=False), self._token_budget(len(tokens) - min(DECODE_ROWS, len(tokens) - 1)):
            engine.add_request(request, _prompt(tokens), self._params(1, True, False))
            scheduler = self._scheduler()
            while engine.has_unfinished_requests():
                found = next((o for o in engine.step() if o.request_id == request and o.finished), found)
                scheduler.max_num_scheduled_tokens = 1  # the rest one token a step (the budget is restored after)
        return self._rows_of(found, 0)

    def _chunked(self, tokens: list[int]) -> np.ndarray:
        with self._token_budget(-(-len(tokens) // CHUNKS)):
            return self.recompute(tokens)

    def _rows(self, tokens: list[int]) -> np.ndarray:
        with vllm_rows.gemm_rows(self._linear_layers(), ROWS):
            return self.recompute(tokens)

    def _core(self):
        """The engine core, where it runs in this process (else ``None``)."""
        return getattr(self.llm.llm_engine.engine_core, "engine_core", None)

    def _model(self):
        """The engine's model (a torch module) in this process, else ``NotImplementedError``."""
        executor = getattr(self._core(), "model_executor", None)
        worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
        model = getattr(getattr(worker, "model_runner", None), "model", None)
        if model is None:
            raise NotImplementedError("the engine's model is not in this process")
        return model

    def _linear_layers(self) -> list:
        """The model's linear layers that run vLLM's CPU GEMM dispatch, found once per engine (a pinned check
        asks at every step)."""
        if self.llm not in _LAYERS:
            _LAYERS[self.llm] = vllm_rows.linear_layers(self._model())
        return _LAYERS[self.llm]

    def _scheduler(self):
        scheduler = getattr(self._core(), "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "max_num_scheduled_tokens"):
            raise NotImplementedError("the engine's scheduler is not in this process")
        return scheduler

    def _token_budget(self, n: int):
        """The scheduler's tokens per step set to ``n`` for the duration (a context manager: a chunked prefill)."""
        return mock.patch.object(self._scheduler(), "max_num_scheduled_tokens", n)
