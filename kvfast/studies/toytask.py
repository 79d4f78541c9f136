"""The toy task and a hand-written Adam: small models trained by kvfast itself, deterministic from a seed.

The bug study's trained models learn the *cycle* task: sequences whose first
``prefix`` tokens are uniformly random and which then repeat them,
``s[t] = s[t % prefix]`` (any ``length > prefix``).

The model reads ``s[:-1]`` and is trained to predict ``s[1:]``; only the
positions whose target is determined by the prefix (``t >= prefix - 1``) enter
the loss (:attr:`CycleTask.loss_from`). Training uses the model's hand-written
float64 backward (:func:`kvfast.model.transformer.loss_and_grads_prepared`) and the
Adam below; every random draw derives from the ``seed`` argument, so the same
arguments give the same parameters bit for bit. :func:`train` is memoised
in-process, so a sweep worker trains each model once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvfast.model import layers as L
from kvfast.model.config import ModelConfig, init_params
from kvfast.model.transformer import Weights, forward_prepared, loss_and_grads_prepared
from kvfast.numerics import Numerics
from kvfast.validation import require_int


@dataclass(frozen=True)
class CycleTask:
    """The cycle task (see the module docstring).

    ``vocab``: token ids drawn from ``[0, vocab)``; ``length``: tokens per
    sequence (the model reads ``length - 1`` of them, so it needs
    ``max_pos >= length - 1``); ``prefix``: how many leading tokens are free.
    """

    vocab: int
    length: int
    prefix: int

    def __post_init__(self) -> None:
        for name, minimum in (("vocab", 2), ("length", 1), ("prefix", 1)):
            object.__setattr__(self, name, require_int(getattr(self, name), name, minimum))
        if self.length <= self.prefix:
            raise ValueError(f"length: {self.length} is not allowed; allowed: an integer > prefix={self.prefix}")

    @property
    def loss_from(self) -> int:
        """The first input position whose target is determined by the prefix."""
        return self.prefix - 1

    def complete(self, prefix_tokens: np.ndarray, length: int | None = None) -> np.ndarray:
        """The task's sequence of ``length`` (default ``self.length``) tokens that starts with ``prefix_tokens``."""
        head = np.asarray(prefix_tokens, dtype=np.int64)
        if head.shape != (self.prefix,):
            raise ValueError(f"prefix_tokens: shape {head.shape} is not allowed; allowed: ({self.prefix},)")
        n = self.length if length is None else int(length)
        return head[np.arange(n) % self.prefix]


def make_batch(task: CycleTask, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` fresh sequences of ``task``: ``(inputs, targets)``, both ``(batch, length - 1)`` int64."""
    batch = require_int(batch, "batch", 1)
    heads = rng.integers(0, task.vocab, size=(batch, task.prefix))
    seqs = np.stack([task.complete(h) for h in heads])
    return seqs[:, :-1].copy(), seqs[:, 1:].copy()


@dataclass
class AdamState:
    """Adam's moment estimates (by parameter name) and its step count."""

    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    t: int = 0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @classmethod
    def zeros(cls, params: dict[str, np.ndarray]) -> AdamState:
        """Zero moments shaped like ``params``."""
        return cls({k: np.zeros_like(a) for k, a in params.items()}, {k: np.zeros_like(a) for k, a in params.items()})


def adam_step(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], state: AdamState, lr: float) -> None:
    """One Adam update of ``params`` in place (bias-corrected moments, no weight decay).

    ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
    ``p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``, in float64 NumPy.
    """
    state.t += 1
    b1, b2 = state.beta1, state.beta2
    c1 = 1.0 - b1**state.t
    c2 = 1.0 - b2**state.t
    for name, g in grads.items():
        m = state.m[name]
        v = state.v[name]
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * (g * g)
        params[name] -= lr * (m / c1) / (np.sqrt(v / c2) + state.eps)


def batch_loss_and_grads(
    config: ModelConfig,
    params: dict[str, np.ndarray],
    inputs: np.ndarray,
    targets: np.ndarray,
    loss_from: int,
    numerics: Numerics,
    detach_kv_before: int = 0,
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss and gradients over a batch (the mean of per-sequence losses and gradients)."""
    w = Weights.prepare(config, params, numerics)
    total = 0.0
    acc = {k: np.zeros_like(a) for k, a in params.items()}
    for x, y in zip(inputs, targets, strict=True):
        loss, grads = loss_and_grads_prepared(
            config, w, x, y, numerics, loss_from=loss_from, detach_kv_before=detach_kv_before
        )
        total += loss
        for k, g in grads.items():
            acc[k] += g
    n = inputs.shape[0]
    return total / n, {k: g / n for k, g in acc.items()}


@functools.lru_cache(maxsize=64)
def _train_cached(
    config: ModelConfig, task: CycleTask, seed: int, steps: int, lr: float, batch: int
) -> tuple[tuple[str, np.ndarray], ...]:
    params = init_params(config, seed)
    state = AdamState.zeros(params)
    rng = np.random.default_rng([seed, 0x7A5C])
    numerics = Numerics()
    for _ in range(steps):
        inputs, targets = make_batch(task, rng, batch)
        _, grads = batch_loss_and_grads(config, params, inputs, targets, task.loss_from, numerics)
        adam_step(params, grads, state, lr)
    for arr in params.values():
        arr.setflags(write=False)
    return tuple(params.items())


def train(
    config: ModelConfig, task: CycleTask, seed: int, steps: int, lr: float, batch: int = 8
) -> dict[str, np.ndarray]:
    """Parameters of ``config`` trained on ``task`` for ``steps`` Adam steps of ``batch`` sequences.

    Initialisation is :func:`kvfast.init_params` with ``seed``; batches come
    from a generator seeded by ``seed``; the forward runs in float64 and the
    backward is the model's hand-written one. Memoised per argument tuple: the returned arrays are read-only
    and shared, the dict is fresh (copy an array before changing it).
    """
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config: {type(config).__name__} is not allowed; allowed: a ModelConfig")
    if not isinstance(task, CycleTask):
        raise ValueError(f"task: {type(task).__name__} is not allowed; allowed: a CycleTask")
    if task.vocab != config.vocab:
        raise ValueError(f"task.vocab: {task.vocab} is not allowed; allowed: config.vocab = {config.vocab}")
    if task.length - 1 > config.max_pos:
        raise ValueError(
            f"task.length: {task.length} is not allowed; allowed: at most max_pos + 1 = {config.max_pos + 1}"
        )
    for name, value, minimum in (("seed", seed, 0), ("steps", steps, 0), ("batch", batch, 1)):
        require_int(value, name, minimum)
    if isinstance(lr, bool) or not isinstance(lr, float | int) or not lr > 0:
        raise ValueError(f"lr: {lr!r} is not allowed; allowed: a positive float")
    return dict(_train_cached(config, task, int(seed), int(steps), float(lr), int(batch)))


def heldout(
    config: ModelConfig, params: dict[str, np.ndarray], inputs: np.ndarray, targets: np.ndarray, first: int
) -> tuple[float, float]:
    """Teacher-forced mean cross-entropy and accuracy (argmax == target) over positions ``first..`` of every
    sequence of ``inputs`` (float64)."""
    numerics = Numerics()
    w = Weights.prepare(config, params, numerics)
    losses, hits = [], 0
    for x, y in zip(inputs, targets, strict=True):
        logits = forward_prepared(config, w, x, numerics)[first:]
        loss, _ = L.cross_entropy_forward(logits, y[first:])
        losses.append(loss)
        hits += int((logits.argmax(axis=1) == y[first:]).sum())
    return float(np.mean(losses)), hits / (inputs.shape[0] * (inputs.shape[1] - first))


def evaluate(
    config: ModelConfig, params: dict[str, np.ndarray], task: CycleTask, seed: int, n: int = 64
) -> dict[str, float]:
    """Teacher-forced held-out ``loss`` and ``accuracy`` (argmax == target) over the determined positions
    (:func:`heldout`).

    ``n`` fresh sequences are drawn from a generator seeded by ``seed`` (use a
    seed other than the training one for held-out data).
    """
    inputs, targets = make_batch(task, np.random.default_rng([seed, 0xE7A1]), n)
    loss, accuracy = heldout(config, params, inputs, targets, task.loss_from)
    return {"loss": loss, "accuracy": accuracy}
