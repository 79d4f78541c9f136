"""A hand-written 2-layer PyTorch decoder as a user writes one: RoPE, its KV cache as lists of tensors, a batched
prefill (one matrix product for the whole prompt, so prefill and decode add in different orders), and two bugs a
user ships: ``frozen`` (after a resume, ``extend`` stores the chunk but leaves the position counter at the prefill's
length) and ``window`` (the cache silently keeps only its last :data:`WINDOW` positions).

Factories for ``kvfast check ropedecoder:NAME`` (the tests' folder on ``sys.path``): ``clean``, ``frozen``,
``window`` (float32); ``clean64`` (float64).
"""

from __future__ import annotations

import torch

WINDOW = 8
VOCAB = 48


class RopeDecoder:
    """The model under test: ``recompute``, ``prefill``, ``extend``, ``decode`` (kvfast's protocol)."""

    def __init__(self, dtype: str = "float32", bug: str | None = None, seed: int = 0, d: int = 32, n_head: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.bug, self.n_head, self.dh = getattr(torch, dtype), bug, n_head, d // n_head

        def weight(*shape):
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[0] ** 0.5).to(self.dtype)

        self.embed = weight(VOCAB, d) * VOCAB**0.5
        self.layers = [{k: weight(d, d) for k in ("wq", "wk", "wv", "wo")} | {"w1": weight(d, 2 * d),
                        "w2": weight(2 * d, d)} for _ in range(2)]  # fmt: skip
        self.unembed = weight(d, VOCAB)
        self.cache: list[list[torch.Tensor]] = []
        self.pos = 0

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.dh // 2
        freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
        angle = (pos[:, None].double() * freq[None, :]).to(self.dtype)
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def _forward(self, tokens, past: list | None) -> tuple[torch.Tensor, list]:
        """Logits ``(T, V)`` of ``tokens`` after ``past`` (per layer ``[K, V]``, or ``None``), and the new cache."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        T = ids.shape[0]  # noqa: N806
        start = self.pos if past is not None else 0
        pos = torch.arange(start, start + T)
        x = self.embed[ids]
        new = []
        for i, w in enumerate(self.layers):
            h = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
            q, k, v = ((h @ w[n]).reshape(T, self.n_head, self.dh).transpose(0, 1) for n in ("wq", "wk", "wv"))
            q, k = self._rope(q, pos), self._rope(k, pos)
            if past is not None:
                k, v = torch.cat([past[i][0], k], dim=1), torch.cat([past[i][1], v], dim=1)
            n = k.shape[1]
            scores = q @ k.transpose(1, 2) / self.dh**0.5
            mask = torch.ones(T, n, dtype=torch.bool).tril(n - T)
            att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
            x = x + att.transpose(0, 1).reshape(T, -1) @ w["wo"]
            h = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
            x = x + torch.nn.functional.silu(h @ w["w1"]) @ w["w2"]
            keep = WINDOW if self.bug == "window" else n
            new.append([k[:, -keep:], v[:, -keep:]])
        return x @ self.unembed, new

    def recompute(self, tokens):
        return self._forward(tokens, None)[0]

    def prefill(self, tokens):
        logits, self.cache = self._forward(tokens, None)
        self.pos = len(tokens)
        return logits

    def extend(self, tokens):
        logits, self.cache = self._forward(tokens, self.cache)
        if self.bug != "frozen":
            self.pos += len(tokens)
        return logits

    def decode(self, token):
        logits, self.cache = self._forward([token], self.cache)
        self.pos += 1
        return logits[0]


def clean() -> RopeDecoder:
    return RopeDecoder("float32")


def clean64() -> RopeDecoder:
    return RopeDecoder("float64")


def frozen() -> RopeDecoder:
    return RopeDecoder("float32", "frozen")


def window() -> RopeDecoder:
    return RopeDecoder("float32", "window")
