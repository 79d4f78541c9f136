"""A causal toy model with a cache (and factories) shared by the kvfast.check tests.

The plugin tests copy this file into pytester sessions and CLI runs, so it imports
nothing from the test suite.
"""

from __future__ import annotations

import numpy as np


class Toy:
    """A causal toy with a cache: logits(p) = tanh(running sum of embeddings) + P[p]."""

    vocab_size = 7

    def __init__(self, bug=None):
        rng = np.random.default_rng(5)
        self.E = rng.standard_normal((7, 7))
        self.P = rng.standard_normal((64, 7))
        self.bug = bug

    def recompute(self, tokens):
        s, out = np.zeros(7), []
        for p, t in enumerate(tokens):
            s = s + self.E[t]
            out.append(np.tanh(s) + self.P[p])
        return np.array(out)

    def prefill(self, tokens):
        out = Toy.recompute(self, tokens)
        self.s = np.zeros(7)
        for t in tokens:
            self.s = self.s + self.E[t]
        self.n = self.prefill_len = len(tokens)
        return out

    def decode(self, token):
        self.s = self.s + self.E[token]
        pos = self.prefill_len if self.bug == "posfrozen" else self.n
        self.n += 1
        return np.tanh(self.s) + self.P[pos]


def clean():
    return Toy()


def posfrozen():
    return Toy("posfrozen")


def wrong_shape():
    class Bad(Toy):
        def decode(self, token):
            return super().decode(token)[:3]

    return Bad()


def not_a_model():
    return object()


class LowFormatToy:
    """A one-layer attention model in float32 under the plain protocol whose cache path rounds in a lower format
    inside, as real engines do, and says so (``internal_formats``):

    - ``kind="kv16"``: the KV cache stores keys and values in float16 (llama.cpp's default); the recompute keeps
      them in float32, so a correct cache differs from it by float16 rounding;
    - ``kind="int8"``: activations (the attention's output) quantized to int8 per row (symmetric, scale
      ``max|row| / 127``) in both paths; prefill and recompute use whole-matrix products, decode row by row, so a
      float32 difference in the order of a sum can move an activation across an int8 step.

    ``declare=False`` hides the declaration (the check then assumes float32 inside). ``bug="posoff"``: decode
    reads the position embedding one behind (a cache logic bug)."""

    def __init__(self, kind="kv16", seed=0, bug=None, declare=True, vocab=32, d=16):
        rng = np.random.default_rng(seed)
        f = np.float32
        self.E = rng.standard_normal((vocab, d)).astype(f)
        self.P = rng.standard_normal((64, d)).astype(f)
        self.Wq, self.Wk, self.Wv, self.Wo = ((rng.standard_normal((d, d)) / np.sqrt(d)).astype(f) for _ in range(4))
        self.U = (rng.standard_normal((d, vocab)) / np.sqrt(d)).astype(f)
        self.kind, self.bug, self.vocab_size, self.d = kind, bug, vocab, d
        if declare:
            self.internal_formats = {"kv cache": "float16"} if kind == "kv16" else {"activations": "int8"}

    def _x(self, tokens, start):
        return self.E[np.asarray(tokens)] + self.P[start : start + len(tokens)]

    def _act(self, a):
        if self.kind != "int8":
            return a
        step = np.maximum(np.abs(a).max(axis=-1, keepdims=True), np.float32(1e-30)) / np.float32(127)
        return (np.round(a / step) * step).astype(np.float32)

    def _attend(self, q, k, v, causal_from):
        s = (q @ k.T) / np.float32(np.sqrt(self.d))
        n = q.shape[0]
        mask = np.arange(k.shape[0])[None, :] > (causal_from + np.arange(n))[:, None]
        s = np.where(mask, -np.inf, s)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)) @ v

    def _out(self, x, a):
        return (x + self._act(a) @ self.Wo) @ self.U

    def recompute(self, tokens):
        x = self._x(tokens, 0)
        return self._out(x, self._attend(x @ self.Wq, x @ self.Wk, x @ self.Wv, 0))

    def _store(self, k, v):
        if self.kind == "kv16":
            k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        self.K = np.concatenate([self.K, k])
        self.V = np.concatenate([self.V, v])

    def prefill(self, tokens):
        self.K = self.V = np.zeros((0, self.d), np.float32)
        x = self._x(tokens, 0)
        k, v = x @ self.Wk, x @ self.Wv
        out = self._out(x, self._attend(x @ self.Wq, k, v, 0))  # the prompt attends its fresh keys
        self._store(k, v)
        return out

    def decode(self, token):
        n = self.K.shape[0]
        x = self._x([token], n - 1 if self.bug == "posoff" else n)[0]
        q = np.array([np.dot(x, self.Wq[:, j]) for j in range(self.d)], np.float32)  # one row: another order
        k = np.array([np.dot(x, self.Wk[:, j]) for j in range(self.d)], np.float32)
        v = np.array([np.dot(x, self.Wv[:, j]) for j in range(self.d)], np.float32)
        self._store(k[None], v[None])
        a = self._attend(q[None], self.K, self.V, n)[0]
        return self._out(x, a)


class ToyOps(Toy):
    """The protocol's toy with the operation hooks: its cache is the running sum at every position."""

    def prefill(self, tokens):
        out = super().prefill(tokens)
        self.sums = list(np.cumsum(self.E[np.asarray(tokens)], axis=0))
        return out

    def decode(self, token):
        self.s = self.sums[-1] + self.E[token]
        self.sums.append(self.s)
        self.n = len(self.sums)
        return np.tanh(self.s) + self.P[self.n - 1]

    def crop(self, n):
        del self.sums[n:]

    def snapshot(self):
        return list(self.sums)

    def restore(self, state):
        self.sums = list(state)
