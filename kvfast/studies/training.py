"""The cached-prefix training study: in training, a reused prefix cache DOES change the answer.

The task ("successor copy"). A sequence has 12 tokens ``x[0..11]`` over the
content tokens ``1 .. vocab-1`` (token 0 is BOS): the prefix ``x[0..5]`` is
uniformly random and the suffix is its successor, ``x[6+i] = succ(x[i])`` with
``succ(t) = t % (vocab-1) + 1``. The model reads ``[BOS, x0, .., x10]`` (12
positions) and position ``t`` predicts ``x[t]``, so predicting a suffix token
needs attention from position ``6+i`` back to position ``i+1``; the prefix
predictions are irreducible (``log(vocab-1)`` each).

Training with a prefix of ``P`` positions (``prefix_len``, 0..11), for the same
budget (same initialisation, same batches, same Adam steps and learning rate):

- ``full``: the loss is the mean cross-entropy over positions ``P..11`` and the
  gradient flows everywhere;
- ``cached``: the same loss, but the keys and values of positions ``< P`` are
  constants (a cached prefix reused in fine-tuning; implemented with
  ``loss_and_grads_prepared(..., detach_kv_before=P)``). Its loss as a function of
  the parameters is :func:`cached_prefix_loss` (the prefix's K/V come from a
  frozen copy of the parameters through a real :class:`~kvfast.KVCache`), and
  its gradient is checked against central differences of that loss in the tests.

Reported per run: the cosine between the two gradients at initialisation on a
fixed batch (``grad_cosine``), and after training each variant the held-out
loss over the trained positions ``P..11`` (``loss_*``) and over the learnable
suffix positions ``max(P, 6)..11`` (``suffix_loss_*``). Every number depends only
on the config (seeds derive from ``seed``). Gradients use the model's
hand-written float64 backward; the optimiser is the hand-written Adam of
:mod:`kvfast.studies.toytask`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.model import layers as L
from kvfast.model.cache import KVCache
from kvfast.model.config import ModelConfig, init_params
from kvfast.model.transformer import Weights, forward_prepared
from kvfast.numerics import Numerics
from kvfast.studies.base import Claim, Study
from kvfast.studies.common import MODEL_SHAPE_FIELDS, model_config, ok_rows, require_model_shape
from kvfast.studies.criteria import DIRECTION, judged
from kvfast.studies.toytask import AdamState, adam_step, batch_loss_and_grads
from kvfast.validation import not_allowed, require_int

VERSION = "1"

SEQ_LEN = 12
TASK_PREFIX = 6
BOS = 0
F64 = Numerics()

CONFIG_FIELDS = {
    "seed": pa.int64(),
    "prefix_len": pa.int64(),
    **MODEL_SHAPE_FIELDS,
    "train_steps": pa.int64(),
    "batch": pa.int64(),
    "lr": pa.float64(),
    "grad_batch": pa.int64(),
    "eval_size": pa.int64(),
}
RESULT_FIELDS = {
    "grad_cosine": pa.float64(),
    "init_loss": pa.float64(),
    "loss_full": pa.float64(),
    "loss_cached": pa.float64(),
    "suffix_loss_full": pa.float64(),
    "suffix_loss_cached": pa.float64(),
    "suffix_acc_full": pa.float64(),
    "suffix_acc_cached": pa.float64(),
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_model_shape(config, min_vocab=3)
    require_int(config.get("prefix_len"), "prefix_len", 0, SEQ_LEN - 1)
    for name in ("batch", "grad_batch", "eval_size"):
        require_int(config.get(name), name, 1, 4096)
    require_int(config.get("train_steps"), "train_steps", 0, 10**6)
    lr = config.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, float | int) or not 0 < lr < 1:
        raise not_allowed("lr", lr, "a float in (0, 1)")


def successor_batch(rng: np.random.Generator, n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` task sequences as ``(inputs, targets)``, both ``(n, 12)`` int64 (module docstring)."""
    head = rng.integers(1, vocab, size=(n, TASK_PREFIX))
    tail = head % (vocab - 1) + 1
    seqs = np.concatenate([head, tail], axis=1).astype(np.int64)
    inputs = np.concatenate([np.full((n, 1), BOS, dtype=np.int64), seqs[:, :-1]], axis=1)
    return inputs, seqs


def _flat(grads: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([grads[k].ravel() for k in sorted(grads)])


def gradients(
    cfg: ModelConfig, params: dict, inputs: np.ndarray, targets: np.ndarray, prefix_len: int, cached: bool
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean loss over positions ``prefix_len..11`` and its gradient, full or with the prefix's K/V detached."""
    detach = prefix_len if cached else 0
    return batch_loss_and_grads(cfg, params, inputs, targets, prefix_len, F64, detach_kv_before=detach)


def cached_prefix_loss(
    cfg: ModelConfig, params: dict, frozen: dict, tokens: np.ndarray, targets: np.ndarray, prefix_len: int
) -> float:
    """The cached-prefix loss of one sequence: prefix K/V from ``frozen`` (via a KVCache), the rest from ``params``.

    Mean cross-entropy over positions ``prefix_len..11``. At ``params == frozen``
    it equals the ordinary loss bit for bit (the cache is exact); its gradient
    in ``params`` at that point is the cached-prefix gradient.
    """
    cache = KVCache.empty(cfg, F64, tokens.shape[0])
    if prefix_len > 0:
        forward_prepared(cfg, Weights.prepare(cfg, frozen, F64), tokens[:prefix_len], F64, cache)
    logits = forward_prepared(cfg, Weights.prepare(cfg, params, F64), tokens[prefix_len:], F64, cache)
    loss, _ = L.cross_entropy_forward(logits, targets[prefix_len:])
    return loss


def heldout(cfg: ModelConfig, params: dict, inputs: np.ndarray, targets: np.ndarray, first: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (argmax == target) over positions ``first..11`` of every sequence."""
    w = Weights.prepare(cfg, params, F64)
    losses, hits = [], 0
    for x, y in zip(inputs, targets, strict=True):
        logits = forward_prepared(cfg, w, x, F64)[first:]
        loss, _ = L.cross_entropy_forward(logits, y[first:])
        losses.append(loss)
        hits += int((logits.argmax(axis=1) == y[first:]).sum())
    return float(np.mean(losses)), hits / (inputs.shape[0] * (SEQ_LEN - first))


def train(config: dict, cached: bool) -> dict[str, np.ndarray]:
    """Parameters after ``train_steps`` Adam steps on fresh batches, full or cached-prefix (module docstring)."""
    cfg = model_config(config, SEQ_LEN)
    params = init_params(cfg, config["seed"])
    state = AdamState.zeros(params)
    rng = np.random.default_rng([config["seed"], 0x7124])
    for _ in range(config["train_steps"]):
        inputs, targets = successor_batch(rng, config["batch"], config["vocab"])
        _, grads = gradients(cfg, params, inputs, targets, config["prefix_len"], cached)
        adam_step(params, grads, state, float(config["lr"]))
    return params


def run(config: dict) -> dict:
    """One run: gradient cosine at initialisation, then both variants trained and evaluated."""
    validate_config(config)
    cfg = model_config(config, SEQ_LEN)
    p = config["prefix_len"]
    params0 = init_params(cfg, config["seed"])
    gx, gy = successor_batch(np.random.default_rng([config["seed"], 0x6AD]), config["grad_batch"], config["vocab"])
    init_loss, g_full = gradients(cfg, params0, gx, gy, p, cached=False)
    _, g_cached = gradients(cfg, params0, gx, gy, p, cached=True)
    a, b = _flat(g_full), _flat(g_cached)
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    ex, ey = successor_batch(np.random.default_rng([config["seed"], 0xE7A1]), config["eval_size"], config["vocab"])
    out = {"grad_cosine": cosine, "init_loss": float(init_loss)}
    trained_full = train(config, cached=False)
    trained_cached = trained_full if p == 0 else train(config, cached=True)
    for name, params in (("full", trained_full), ("cached", trained_cached)):
        out[f"loss_{name}"], _ = heldout(cfg, params, ex, ey, p)
        out[f"suffix_loss_{name}"], out[f"suffix_acc_{name}"] = heldout(cfg, params, ex, ey, max(p, TASK_PREFIX))
    return out


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per training budget and prefix length: means over seeds of the gradient cosine and held-out losses."""
    ok = ok_rows(df)
    if not len(ok):
        return pd.DataFrame()
    return (
        ok.groupby(["d_model", "train_steps", "prefix_len"])
        .agg(
            seeds=("seed", "nunique"),
            grad_cosine=("grad_cosine", "mean"),
            grad_cosine_min=("grad_cosine", "min"),
            loss_full=("loss_full", "mean"),
            loss_cached=("loss_cached", "mean"),
            suffix_loss_full=("suffix_loss_full", "mean"),
            suffix_loss_cached=("suffix_loss_cached", "mean"),
            suffix_acc_full=("suffix_acc_full", "mean"),
            suffix_acc_cached=("suffix_acc_cached", "mean"),
        )
        .reset_index()
    )


def claims(df: pd.DataFrame) -> list[Claim]:
    """The seed's training claims at a prefix of 6 of 12 (means over seeds, per training budget).

    Both check a direction only (cosine below 1; cached loss above full), and are labelled so."""
    ok = ok_rows(df)
    ok = ok[ok["prefix_len"] == TASK_PREFIX]
    if not len(ok):
        return []
    cos = ok["grad_cosine"]
    budgets, worse = [], []
    for (d, steps), g in ok.groupby(["d_model", "train_steps"]):
        lf, lc = float(g["suffix_loss_full"].mean()), float(g["suffix_loss_cached"].mean())
        budgets.append(f"d_model {d}, {steps} steps: {lc:.3f} vs {lf:.3f} ({len(g)} seeds)")
        worse.append((f"{steps} steps: mean cached suffix loss > mean full", lc > lf))
    return [
        judged(
            "cached-prefix training: gradient cosine with the full gradient at prefix 6 of 12 is below 1",
            "0.857",
            f"{float(cos.mean()):.3f} (mean of {len(ok)} runs; range {cos.min():.3f}..{cos.max():.3f})",
            DIRECTION,
            [("cosine < 1 in every run", bool((cos < 1.0).all()))],
        ),
        judged(
            "cached-prefix training: held-out suffix loss after the same budget is worse than full training",
            "1.346 vs 0.059",
            "cached vs full: " + "; ".join(budgets),
            DIRECTION,
            worse,
        ),
    ]


STUDY = Study(
    name="training",
    version=VERSION,
    description="cached-prefix training (prefix K/V as constants) vs full training on a 12-token successor task",
    run=run,
    config_fields=CONFIG_FIELDS,
    result_fields=RESULT_FIELDS,
    validate_config=validate_config,
    summarize=summarize,
    claims=claims,
)
