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
