"""A NumPy reference model of kvfast's architecture, written from the architecture, with a KV cache.

It shares no code with :mod:`kvfast.model`: it reads kvfast's ``.npz`` files
itself and computes with NumPy (BLAS) products, in float64 or float32::

    x = wte[token] + wpe[pos]
    per layer l:  h = rmsnorm(x) * g1;  q, k, v = h @ wq, h @ wk, h @ wv
                  x = x + attention(q, k, v) @ wo        (causal, heads of d/H, scale 1/sqrt(d/H))
                  x = x + silu(rmsnorm(x) * g2 @ w1) @ w2
    logits = rmsnorm(x) * gf @ w_out
    rmsnorm(x) = x * (1 / sqrt(mean(x^2) + eps)),  silu(u) = u / (1 + exp(-u))

``batching`` chooses how the batched paths (``recompute``, ``prefill``,
``extend``) multiply:

- ``"rows"`` (default): one row at a time, exactly as ``decode`` does, so the
  cache path and the recompute are the same arithmetic and an exact check
  passes (the cache is not an approximation);
- ``"matrix"``: whole-matrix products (what real stacks do). ``decode`` still
  multiplies one row, so the two paths add up in different orders and an
  exact check reports the order noise; control mode, with the one-row
  recompute offered by ``recompute_variants``, says ``rounding``.

``bug`` injects one of three resume bugs (:data:`RESUME_BUGS`), all invisible to
plain prefill-then-decode and caught by the checker's ``resume`` scenario.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvfast.validation import require_choice

RESUME_BUGS: dict[str, str] = {
    "extend_from_zero": "extend() numbers the new chunk's positions from 0 instead of the cache length",
    "decode_pos_from_prefill": "decode() takes its position as prefill length + tokens decoded, so a chunk "
    "added by extend() is not counted",
    "replay": "extend() first re-appends the last token already in the cache (a double append), shifting "
    "every later position by one",
}
BATCHING = ("rows", "matrix")
DTYPES = {"float64": np.float64, "float32": np.float32}
CONFIG_KEYS = ("vocab", "d_model", "n_head", "n_layer", "d_ff", "max_pos", "eps")


class NumpyModel:
    """The reference model behind the check protocol (see the module docstring).

    ``config``: a mapping (or object) with ``vocab, d_model, n_head, n_layer,
    d_ff, max_pos, eps``; ``params``: arrays named like kvfast's (``wte``,
    ``wpe``, ``h{l}.g1``, ``h{l}.wq`` .. ``h{l}.w2``, ``gf``, ``w_out``), cast to
    ``dtype`` (``"float64"`` or ``"float32"``).
    """

    def __init__(self, config, params: dict, dtype: str = "float64", batching: str = "rows", bug: str | None = None):
        require_choice(dtype, "dtype", DTYPES)
        self.batching = require_choice(batching, "batching", BATCHING)
        self.bug = None if bug is None else require_choice(bug, "bug", RESUME_BUGS)
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
        missing = [k for k in CONFIG_KEYS if get(k) is None]
        if missing:
            raise ValueError(f"config: missing {missing}; allowed: a mapping with {', '.join(CONFIG_KEYS)}")
        self.vocab_size, self.n_head, self.n_layer, self.max_pos = (
            int(get(k)) for k in ("vocab", "n_head", "n_layer", "max_pos")
        )
        self.dt = DTYPES[dtype]
        self.eps = self.dt(get("eps"))
        self.p = {}
        for name in ["wte", "wpe", "gf", "w_out"] + [
            f"h{i}.{n}" for i in range(self.n_layer) for n in ("g1", "wq", "wk", "wv", "wo", "g2", "w1", "w2")
        ]:
            if name not in params:
                raise ValueError(f"params: {name!r} is missing; allowed: kvfast's parameter names")
            self.p[name] = np.ascontiguousarray(params[name], dtype=self.dt)
        self.k: np.ndarray | None = None
        self.v: np.ndarray | None = None
        self.length = self.prefill_len = self.decoded = 0
        self.last_token = np.zeros(0, dtype=np.int64)

    @classmethod
    def from_npz(cls, path: str | Path, **kwargs) -> NumpyModel:
        """Load a ``.npz`` written by :func:`kvfast.save_params` (``config`` JSON plus one array per name)."""
        with np.load(Path(path), allow_pickle=False) as data:
            if "config" not in data.files:
                raise ValueError(f"path: {path} has no 'config' entry; allowed: a file written by kvfast.save_params")
            config = json.loads(str(data["config"]))
            params = {n: data[n] for n in data.files if n != "config"}
        return cls(config, params, **kwargs)

    # --- the protocol -------------------------------------------------------------------------

    def recompute(self, tokens) -> np.ndarray:
        """Logits (T, V) of ``tokens`` at positions 0..T-1, no cache (``batching`` products)."""
        tokens = self._tokens(tokens, 0)
        logits, _, _ = self._forward(tokens, 0, None, None, self.batching == "rows")
        return logits

    def recompute_variants(self, tokens) -> dict[str, np.ndarray]:
        """With ``batching="matrix"``: the recompute one row at a time (``{"one row at a time": ...}``)."""
        if self.batching == "rows":
            return {}
        tokens = self._tokens(tokens, 0)
        logits, _, _ = self._forward(tokens, 0, None, None, True)
        return {"one row at a time": logits}

    def prefill(self, tokens) -> np.ndarray:
        """A fresh cache holding ``tokens``; their logits (T, V)."""
        tokens = self._tokens(tokens, 0)
        logits, self.k, self.v = self._forward(tokens, 0, None, None, self.batching == "rows")
        self.length = self.prefill_len = tokens.shape[0]
        self.decoded = 0
        self.last_token = tokens[-1:]
        return logits

    def extend(self, tokens) -> np.ndarray:
        """``tokens`` continuing the cache; their logits (n, V)."""
        self._need_cache()
        tokens = self._tokens(tokens, self.length)
        pos0 = 0 if self.bug == "extend_from_zero" else self.length
        if self.bug == "replay":
            tokens = np.concatenate([self.last_token, tokens])  # double append of the last cached token
        logits, self.k, self.v = self._forward(tokens, pos0, self.k, self.v, self.batching == "rows")
        self.length += tokens.shape[0]
        self.last_token = tokens[-1:]
        if self.bug == "replay":
            logits = logits[1:]
        return logits

    def decode(self, token) -> np.ndarray:
        """One token at the cache's next position, one-row products; logits (V,)."""
        self._need_cache()
        tok = self._tokens([token], self.length)
        pos = self.prefill_len + self.decoded if self.bug == "decode_pos_from_prefill" else self.length
        logits, self.k, self.v = self._forward(tok, pos, self.k, self.v, True)
        self.length += 1
        self.decoded += 1
        self.last_token = tok
        return logits[0]

    # --- the architecture -----------------------------------------------------------------------

    def _forward(self, tokens, pos0, kc, vc, rows):
        p = self.p
        n = tokens.shape[0]
        x = p["wte"][tokens] + p["wpe"][pos0 : pos0 + n]
        new_k, new_v = [], []
        for i in range(self.n_layer):
            pre = f"h{i}."
            h = self._rmsnorm(x) * p[pre + "g1"]
            q, k, v = (self._mm(h, p[pre + w], rows) for w in ("wq", "wk", "wv"))
            K = k if kc is None else np.concatenate([kc[i], k])
            V = v if vc is None else np.concatenate([vc[i], v])
            new_k.append(K)
            new_v.append(V)
            past = K.shape[0] - n  # rows of the cache before this chunk
            y = self._attention(q, K, V, past, rows)
            x = x + self._mm(y, p[pre + "wo"], rows)
            h2 = self._rmsnorm(x) * p[pre + "g2"]
            u = self._mm(h2, p[pre + "w1"], rows)
            x = x + self._mm(u / (1 + np.exp(-u)), p[pre + "w2"], rows)
        logits = self._mm(self._rmsnorm(x) * p["gf"], p["w_out"], rows)
        return logits, np.stack(new_k), np.stack(new_v)

    def _rmsnorm(self, x):
        return x * (self.dt(1) / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + self.eps))

    @staticmethod
    def _mm(x, w, rows: bool):
        if rows and x.shape[0] > 1:
            return np.concatenate([x[i : i + 1] @ w for i in range(x.shape[0])])
        return x @ w

    def _attention(self, q, K, V, past, rows):
        """Row r of ``q`` sees cache rows ``0 .. past + r`` (causal)."""
        n, d = q.shape
        hd = d // self.n_head
        scale = self.dt(1 / np.sqrt(hd))
        y = np.empty_like(q)
        for h in range(self.n_head):
            c = slice(h * hd, (h + 1) * hd)
            if rows or n == 1:
                for r in range(n):
                    hi = past + r + 1
                    s = (q[r : r + 1, c] @ K[:hi, c].T) * scale
                    e = np.exp(s - s.max(axis=1, keepdims=True))
                    y[r : r + 1, c] = (e / e.sum(axis=1, keepdims=True)) @ V[:hi, c]
            else:
                s = (q[:, c] @ K[:, c].T) * scale
                s[np.arange(K.shape[0])[None, :] > past + np.arange(n)[:, None]] = -np.inf
                e = np.exp(s - s.max(axis=1, keepdims=True))
                y[:, c] = (e / e.sum(axis=1, keepdims=True)) @ V[:, c]
        return y

    def _tokens(self, tokens, start: int) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
            raise ValueError(f"tokens: {tokens!r} is not allowed; allowed: a non-empty 1-D sequence of token ids")
        if ((arr < 0) | (arr >= self.vocab_size)).any():
            raise ValueError(f"tokens: {arr.tolist()} hold an id out of range; allowed: [0, {self.vocab_size})")
        if start + arr.size > self.max_pos:
            raise ValueError(f"tokens: {arr.size} from position {start} pass max_pos={self.max_pos}")
        return arr.astype(np.int64)

    def _need_cache(self) -> None:
        if self.k is None:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")
