"""A tiny PyTorch decoder with a KV cache, loading kvfast's ``.npz`` parameters, checked by kvfast.

The architecture is kvfast's (pre-norm RMSNorm, causal multi-head attention,
SiLU MLP, learned positions); the weights come from a file written by
:func:`kvfast.save_params`. :class:`TorchDecoder` is an ordinary
``torch.nn.Module`` whose ``forward(tokens, past)`` returns logits and the
updated per-layer ``(K, V)`` cache, as generation code expects;
:class:`TorchCacheModel` puts it behind kvfast's check protocol.

``batching="matrix"`` (the default) multiplies whole matrices in the batched
forward (masked attention over the full score matrix), while a one-token
decode multiplies one row: the two paths add up in different orders, so an
exact check can report rounding in float32, and ``mode="control"`` judges it.
``batching="rows"`` runs the batched forward one row at a time, so it is the
decode's own arithmetic and an exact check passes.

Run it (needs torch; the CPU build is enough)::

    python examples/torch_model.py

or from the command line, for a model built by a factory::

    KVFAST_NPZ=model.npz kvfast check examples.torch_model:from_env --prompt 1,2,3 --steps 32
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32}


class TorchDecoder(torch.nn.Module):
    """kvfast's architecture in torch. ``bug="posfrozen"`` positions every token after a prefill at the
    prefill's length (a resume bug) - for the demo."""

    def __init__(self, config: dict, params: dict, dtype: str = "float64", batching: str = "matrix", bug=None):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if batching not in ("matrix", "rows"):
            raise ValueError(f"batching: {batching!r} is not allowed; allowed: matrix, rows")
        self.config = config
        self.n_head = int(config["n_head"])
        self.n_layer = int(config["n_layer"])
        self.eps = float(config["eps"])
        self.batching = batching
        self.bug = bug
        tdt = DTYPES[dtype]
        self.w = {name: torch.tensor(np.asarray(arr), dtype=tdt) for name, arr in params.items()}

    @classmethod
    def from_npz(cls, path: str | Path, **kwargs) -> TorchDecoder:
        """Load a file written by :func:`kvfast.save_params`."""
        with np.load(Path(path), allow_pickle=False) as data:
            config = json.loads(str(data["config"]))
            params = {n: data[n] for n in data.files if n != "config"}
        return cls(config, params, **kwargs)

    def _norm(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.eps) * g

    def _mm(self, x: torch.Tensor, w: torch.Tensor, rows: bool) -> torch.Tensor:
        if rows and x.shape[0] > 1:
            return torch.cat([x[t : t + 1] @ w for t in range(x.shape[0])])
        return x @ w

    def _attend(self, q, K, V, past: int, rows: bool) -> torch.Tensor:
        n, d = q.shape
        hd = d // self.n_head
        scale = 1.0 / hd**0.5
        out = torch.empty_like(q)
        for h in range(self.n_head):
            c = slice(h * hd, (h + 1) * hd)
            if rows or n == 1:
                for r in range(n):
                    s = (q[r : r + 1, c] @ K[: past + r + 1, c].T) * scale
                    out[r : r + 1, c] = torch.softmax(s, dim=-1) @ V[: past + r + 1, c]
            else:
                s = (q[:, c] @ K[:, c].T) * scale
                mask = torch.arange(K.shape[0])[None, :] > past + torch.arange(n)[:, None]
                out[:, c] = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ V[:, c]
        return out

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, past: list | None = None, pos0: int | None = None, rows=None):
        """Logits ``(n, V)`` of ``tokens`` after the cache ``past`` (a list of per-layer ``(K, V)``), and the
        new cache. Positions start at ``pos0`` (default: the cache length)."""
        rows = (self.batching == "rows") if rows is None else rows
        w = self.w
        length = 0 if past is None else past[0][0].shape[0]
        pos0 = length if pos0 is None else pos0
        n = tokens.shape[0]
        x = w["wte"][tokens] + w["wpe"][pos0 : pos0 + n]
        new = []
        for i in range(self.n_layer):
            pre = f"h{i}."
            h = self._norm(x, w[pre + "g1"])
            q, k, v = (self._mm(h, w[pre + m], rows) for m in ("wq", "wk", "wv"))
            K = k if past is None else torch.cat([past[i][0], k])
            V = v if past is None else torch.cat([past[i][1], v])
            new.append((K, V))
            x = x + self._mm(self._attend(q, K, V, length, rows), w[pre + "wo"], rows)
            u = self._mm(self._norm(x, w[pre + "g2"]), w[pre + "w1"], rows)
            x = x + self._mm(torch.nn.functional.silu(u), w[pre + "w2"], rows)
        return self._mm(self._norm(x, w["gf"]), w["w_out"], rows), new


class TorchCacheModel:
    """:class:`TorchDecoder` behind kvfast's check protocol (logits returned as torch tensors)."""

    def __init__(self, decoder: TorchDecoder):
        self.decoder = decoder
        self.vocab_size = int(decoder.config["vocab"])
        self.past = None
        self.prefill_len = 0

    def _t(self, tokens) -> torch.Tensor:
        return torch.as_tensor(np.asarray(tokens, dtype=np.int64))

    def recompute(self, tokens):
        return self.decoder(self._t(tokens))[0]

    def recompute_variants(self, tokens):
        """The recompute batched differently: one row at a time (no cache)."""
        return {"one row at a time": self.decoder(self._t(tokens), rows=True)[0]}

    def prefill(self, tokens):
        logits, self.past = self.decoder(self._t(tokens))
        self.prefill_len = len(tokens)
        return logits

    def extend(self, tokens):
        logits, self.past = self.decoder(self._t(tokens), self.past)
        return logits

    def decode(self, token):
        pos = self.prefill_len if self.decoder.bug == "posfrozen" else None
        logits, self.past = self.decoder(self._t([token]), self.past, pos0=pos)
        return logits[0]


def from_env() -> TorchCacheModel:
    """A factory for ``kvfast check``: the ``.npz`` in ``$KVFAST_NPZ``, float32, matrix batching."""
    path = os.environ.get("KVFAST_NPZ")
    if not path:
        raise ValueError("KVFAST_NPZ: not set; allowed: the path of a .npz written by kvfast.save_params")
    return TorchCacheModel(TorchDecoder.from_npz(path, dtype=os.environ.get("KVFAST_DTYPE", "float32")))


def main() -> None:
    import tempfile

    import kvfast

    torch.set_num_threads(1)
    cfg = kvfast.ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.npz"
        kvfast.save_params(path, cfg, kvfast.init_params(cfg, 0))
        for dtype in ("float64", "float32"):
            for mode in ("exact", "control"):
                model = TorchCacheModel(TorchDecoder.from_npz(path, dtype=dtype))
                report = kvfast.check_cache(model, [1, 2, 3, 4, 5], 32, mode=mode)
                print(f"{dtype} {mode}: {report.verdict} (max deviation {report.max_deviation:.3g})")
        bugged = TorchCacheModel(TorchDecoder.from_npz(path, dtype="float32", bug="posfrozen"))
        print(kvfast.check_cache(bugged, [1, 2, 3, 4, 5], 32, mode="control"))


if __name__ == "__main__":
    main()
