"""A correct model whose prefill is batched and whose decode is row by row, under the plain protocol.

The shape of most real stacks: ``recompute``, ``prefill`` and ``extend`` multiply whole matrices
(``x @ W`` over every row, one 3-D product for every head's attention scores), while ``decode``
multiplies one row (a matrix-vector product per weight, one per head against the cached keys). The
two paths add up in different orders, so an exact check flags rounding; the model is correct, so
control mode must say ``rounding``. It offers nothing but the plain protocol: ``recompute``,
``prefill``, ``decode``, ``extend``, ``vocab_size`` and ``max_positions`` (no ``recompute_variants``,
no ``promote``), so control mode has only what it can measure itself.

``dtype``:

- ``"float32"``: NumPy float32 throughout (BLAS ``sgemm`` against ``sgemv``-like one-row products);
  float32 logits.
- ``"bfloat16"``: bfloat16 weights, activations, KV cache and logits, each product accumulated in
  float32 and rounded to bfloat16 (ties to even, through ``ml_dtypes``), softmax and norms computed in
  float32 and rounded: what a bfloat16 GEMM with a float32 accumulator does. The logits come back as
  an ``ml_dtypes.bfloat16`` array, so kvfast knows their format.

The architecture (pre-norm decoder, learned positions, rotary-free)::

    x = wte[token] + wpe[pos]
    per layer:  h = rmsnorm(x) * g1;  q, k, v = h @ wq, h @ wk, h @ wv
                x = x + softmax(q k^T / sqrt(d/H), causal) v @ wo
                x = x + silu(rmsnorm(x) * g2 @ w1) @ w2
    logits = rmsnorm(x) * gf @ w_out

``bug`` injects one of three cache bugs (:data:`BUGS`) into the cache path only.

``python examples/batched_prefill_model.py`` checks it in control mode over a grid of seeds and
prompts, in both formats and both scenarios, and prints one report and the verdict counts.
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "bfloat16")
#: Cache bugs the model can carry (``bug=``), each with the step where it first acts per scenario.
BUGS: dict[str, str] = {
    "posoff": "decode() adds the position embedding of the position before its own (acts at step 1)",
    "freeze": "the cache stops growing after the first decode: each later decode replaces the newest key and "
    "value (acts at step 2)",
    "extend_from_zero": "extend() numbers its chunk's positions from 0 (acts at the resume scenario's step 0)",
}


def _bf16(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to the nearest bfloat16, ties to even, kept in float32 (exact)."""
    import ml_dtypes

    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class BatchedPrefillModel:
    """The model under test described in the module doc; ``seed`` draws its weights.

    Bad arguments raise ``ValueError`` naming the field; tokens out of ``[0, vocab)`` or past
    ``max_positions`` raise ``ValueError`` too.
    """

    def __init__(
        self,
        seed: int = 0,
        dtype: str = "float32",
        vocab: int = 64,
        d_model: int = 64,
        n_head: int = 4,
        n_layer: int = 2,
        d_ff: int = 128,
        max_positions: int = 128,
        bug: str | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug: {bug!r} is not allowed; allowed: None, {', '.join(BUGS)}")
        self.bug, self.decoded = bug, 0
        if d_model % n_head:
            raise ValueError(f"n_head: {n_head} is not allowed; allowed: a divisor of d_model={d_model}")
        self.dtype, self.vocab_size, self.max_positions = dtype, int(vocab), int(max_positions)
        self.H, self.hd = n_head, d_model // n_head
        self.round = _bf16 if dtype == "bfloat16" else (lambda a: np.asarray(a, dtype=np.float32))
        rng = np.random.default_rng(seed)

        def w(*shape, scale=1.0):
            return self.round(rng.standard_normal(shape) * (scale / np.sqrt(shape[0])))

        self.wte, self.wpe = (
            w(vocab, d_model, scale=np.sqrt(vocab)),
            w(max_positions, d_model, scale=0.5 * np.sqrt(max_positions)),
        )
        self.layers = [
            {
                "g1": self.round(1 + 0.1 * rng.standard_normal(d_model)),
                "wq": w(d_model, d_model),
                "wk": w(d_model, d_model),
                "wv": w(d_model, d_model),
                "wo": w(d_model, d_model),
                "g2": self.round(1 + 0.1 * rng.standard_normal(d_model)),
                "w1": w(d_model, d_ff),
                "w2": w(d_ff, d_model),
            }  # fmt: skip
            for _ in range(n_layer)
        ]
        self.gf, self.w_out = self.round(1 + 0.1 * rng.standard_normal(d_model)), w(d_model, vocab, scale=3.0)
        self.K: list[np.ndarray] | None = None
        self.V: list[np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"BatchedPrefillModel({self.dtype}, bug={self.bug!r})"

    # --- the protocol -------------------------------------------------------------------------

    def recompute(self, tokens) -> np.ndarray:
        """Logits ``(T, V)`` of ``tokens`` at positions ``0..T-1``, whole-matrix products, no cache."""
        return self._out(self._batched(self._tokens(tokens, 0), None)[0])

    def prefill(self, tokens) -> np.ndarray:
        """A fresh cache holding ``tokens`` (whole-matrix products); their logits ``(T, V)``."""
        logits, self.K, self.V = self._batched(self._tokens(tokens, 0), None)
        self.decoded = 0
        return self._out(logits)

    def extend(self, tokens) -> np.ndarray:
        """``tokens`` continuing the cache (whole-matrix products over the chunk); their logits ``(n, V)``."""
        cache = self._cache()
        past = cache[0][0].shape[0]
        pos0 = 0 if self.bug == "extend_from_zero" else past
        logits, self.K, self.V = self._batched(self._tokens(tokens, past), cache, pos0)
        return self._out(logits)

    def decode(self, token) -> np.ndarray:
        """One token at the cache's next position, one row at a time; logits ``(V,)``."""
        K, V = self._cache()
        if self.bug == "freeze" and self.decoded >= 1:
            K, V = [k[:-1] for k in K], [v[:-1] for v in V]
        pos = K[0].shape[0]
        tok = int(self._tokens([token], pos)[0])
        r = self.round
        x = r(self.wte[tok] + self.wpe[pos - 1 if self.bug == "posoff" else pos])  # (d,)
        self.decoded += 1
        for i, L in enumerate(self.layers):
            h = r(self._norm(x) * L["g1"])
            q, k, v = r(h @ L["wq"]), r(h @ L["wk"]), r(h @ L["wv"])  # matrix-vector products
            K[i], V[i] = np.concatenate([K[i], k[None]]), np.concatenate([V[i], v[None]])
            y = np.empty_like(q)
            for hh in range(self.H):
                c = slice(hh * self.hd, (hh + 1) * self.hd)
                s = (K[i][:, c] @ q[c]) / np.float32(np.sqrt(self.hd))  # one score per cached key
                e = np.exp(s - s.max())
                y[c] = r(e / e.sum()) @ V[i][:, c]
            x = r(x + r(r(y) @ L["wo"]))
            u = r(r(self._norm(x) * L["g2"]) @ L["w1"])
            x = r(x + r(r(u / (1 + np.exp(-u))) @ L["w2"]))
        self.K, self.V = K, V
        return self._out(r(r(self._norm(x) * self.gf) @ self.w_out))

    # --- the batched path ---------------------------------------------------------------------

    def _batched(
        self, tokens: np.ndarray, cache, pos0: int | None = None
    ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        r = self.round
        past = 0 if cache is None else cache[0][0].shape[0]
        n = tokens.shape[0]
        pos0 = past if pos0 is None else pos0
        x = r(self.wte[tokens] + self.wpe[pos0 : pos0 + n])  # (n, d)
        Ks, Vs = [], []
        for i, L in enumerate(self.layers):
            h = r(self._norm(x) * L["g1"])
            q, k, v = r(h @ L["wq"]), r(h @ L["wk"]), r(h @ L["wv"])  # whole-matrix products
            K = k if cache is None else np.concatenate([cache[0][i], k])
            V = v if cache is None else np.concatenate([cache[1][i], v])
            Ks.append(K)
            Vs.append(V)
            qh = q.reshape(n, self.H, self.hd).transpose(1, 0, 2)
            kh = K.reshape(-1, self.H, self.hd).transpose(1, 0, 2)
            vh = V.reshape(-1, self.H, self.hd).transpose(1, 0, 2)
            s = (qh @ kh.transpose(0, 2, 1)) / np.float32(np.sqrt(self.hd))  # every head's scores at once
            s[:, np.arange(K.shape[0])[None, :] > past + np.arange(n)[:, None]] = -np.inf  # causal
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            y = (r(e / e.sum(axis=-1, keepdims=True)) @ vh).transpose(1, 0, 2).reshape(n, -1)
            x = r(x + r(r(y) @ L["wo"]))
            u = r(r(self._norm(x) * L["g2"]) @ L["w1"])
            x = r(x + r(r(u / (1 + np.exp(-u))) @ L["w2"]))
        return r(r(self._norm(x) * self.gf) @ self.w_out), Ks, Vs

    # --- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(1e-5))

    def _out(self, logits: np.ndarray) -> np.ndarray:
        if self.dtype == "bfloat16":
            import ml_dtypes

            return logits.astype(ml_dtypes.bfloat16)  # exact: already bfloat16 values
        return logits

    def _tokens(self, tokens, start: int) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise ValueError(f"tokens: {tokens!r} is not allowed; allowed: a non-empty 1-D sequence of token ids")
        if ((arr < 0) | (arr >= self.vocab_size)).any():
            raise ValueError(f"tokens: {arr.tolist()} hold an id out of range; allowed: [0, {self.vocab_size})")
        if start + arr.size > self.max_positions:
            raise ValueError(
                f"tokens: {arr.size} from position {start} are not allowed; allowed: at most "
                f"{self.max_positions} positions in all"
            )
        return arr.astype(np.int64)

    def _cache(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self.K is None or self.V is None:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")
        return list(self.K), list(self.V)


# --- the grid the example, its tests and benchmarks/control_margin.py check --------------------------

#: Decode steps drawn per run: multiples of 8 as well as others, so that some runs have every prefix length
#: the checker used to recompute aligned to the BLAS kernels' row blocks (a prompt of 8 or 16 tokens).
STEPS = (24, 32, 48, 64)
PROMPTS_PER_SEED = 4


def grid(runs: int, vocab: int = 64):
    """``runs`` cases ``(seed, prompt, continuation)``: seed ``i // 4`` (the model's weights), and per run a
    prompt of 3 to 16 tokens and a continuation of one of :data:`STEPS` tokens, drawn from
    ``default_rng([seed, i % 4])``."""
    for i in range(runs):
        seed = i // PROMPTS_PER_SEED
        rng = np.random.default_rng([seed, i % PROMPTS_PER_SEED])
        prompt = rng.integers(0, vocab, int(rng.integers(3, 17)))
        yield seed, prompt, rng.integers(0, vocab, int(rng.choice(STEPS)))


def main(runs: int = 200) -> None:
    """Check the model in control mode over ``runs`` seeds x prompts, in both formats and both scenarios;
    print the first run's report and the verdict counts."""
    from collections import Counter

    from kvfast.check import check_cache

    for dtype in DTYPES:
        counts: Counter = Counter()
        worst = 0.0
        for i, (seed, prompt, continuation) in enumerate(grid(runs)):
            report = check_cache(BatchedPrefillModel(seed, dtype), prompt, continuation=continuation, mode="control")
            if i == 0:
                print(report, end="\n\n")
            counts.update(f"{name}: {s.verdict}" for name, s in report.scenarios.items())
            worst = max(worst, report.max_ratio)
        listed = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(f"{dtype}: {runs} runs, {listed}; largest ratio {worst:.3g}", end="\n\n")


if __name__ == "__main__":
    main()
