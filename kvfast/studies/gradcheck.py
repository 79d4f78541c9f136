"""The gradient check: the hand-written backward against independently computed central differences.

One run: a random model (:func:`kvfast.init_params` of ``seed``) and ``seq_len``
random tokens and targets (drawn from ``seed``). The hand-written float64
gradient of the mean cross-entropy (:func:`kvfast.model.transformer.loss_and_grads`)
is compared, tensor by tensor, with central differences
``(L(theta + h e_i) - L(theta - h e_i)) / 2h`` (``h =`` :data:`STEP`) of a loss
computed independently: kvfast's float64 forward logits, then a log-sum-exp
cross-entropy written here in NumPy (:func:`reference_loss`). Every element of
every parameter tensor is perturbed.

A tensor's relative error is ``max |analytic - numeric| / max(max |numeric|,
max |analytic|)``; a run reports it per tensor and its worst. The claim holds
when every tensor of every run is within :data:`TOLERANCE` and every tensor of
the model was checked.

Tensor count: kvfast's model has ``4 + 8 n_layer`` parameter tensors
(``wte``, ``wpe``, final gain ``gf``, ``w_out``; per layer ``g1, wq, wk, wv,
wo, g2, w1, w2``; no biases), 20 at two layers. The seed reports 24 tensors and
does not list them; a model with the same layers and two biases per layer (or
separate Q, K, V gains) would have 24. The difference is the seed's
architecture, not a skipped tensor: :data:`RESULT_FIELDS` records every name.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast.kernels.rowops import exp_array, log_array
from kvfast.model.config import ModelConfig, init_params, param_shapes
from kvfast.model.transformer import Weights, forward_prepared, loss_and_grads
from kvfast.numerics import Numerics
from kvfast.studies.common import MODEL_SHAPE_FIELDS, aggregated, model_config, ok_rows, require_model_shape, study_of
from kvfast.studies.criteria import BOUND, judged
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Claim, Fact, Figure
from kvfast.validation import require_int

VERSION = "1"

STEP = 1e-5
# Central differences with h = 1e-5 in float64: truncation O(h^2) ~ 1e-10 and rounding O(eps / h) ~ 1e-11 relative
# to O(1) losses; a wrong backward is off by O(1). 1e-6 separates the two by orders of magnitude either way.
TOLERANCE = 1e-6
SEED_WORST = 3.2e-8
SEED_TENSORS = 24
F64 = Numerics()

CONFIG_FIELDS = {"seed": pa.int64(), **MODEL_SHAPE_FIELDS, "seq_len": pa.int64()}
RESULT_FIELDS = {
    "tensors": pa.int64(),
    "tensor_names": pa.list_(pa.string()),
    "rel_err": pa.list_(pa.float64()),
    "worst_rel_err": pa.float64(),
    "worst_tensor": pa.string(),
    "loss": pa.float64(),
}


def validate_config(config: dict) -> None:
    """Raise ``ValueError`` naming the field, its value and what is allowed."""
    require_model_shape(config, max_layers=8, max_width=64, min_vocab=2)
    require_int(config.get("seq_len"), "seq_len", 1, 64)


def reference_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean cross-entropy of ``targets`` (T,) under ``logits`` (T, V), by a shifted log-sum-exp in NumPy
    (``exp`` and ``log`` the C library's: NumPy's own depend on the CPU's SIMD features)."""
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + log_array(exp_array(logits - m).sum(axis=1))
    return float(np.mean(lse - logits[np.arange(targets.size), targets]))


def central_differences(
    cfg: ModelConfig, params: dict, tokens: np.ndarray, targets: np.ndarray, h: float = STEP
) -> dict[str, np.ndarray]:
    """d loss / d theta for every element of every tensor, by central differences of :func:`reference_loss`."""

    def loss(p: dict) -> float:
        return reference_loss(forward_prepared(cfg, Weights.prepare(cfg, p, F64), tokens, F64), targets)

    grads = {}
    for name, arr in params.items():
        g = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            plus = {**params, name: arr.copy()}
            minus = {**params, name: arr.copy()}
            plus[name][idx] += h
            minus[name][idx] -= h
            g[idx] = (loss(plus) - loss(minus)) / (2 * h)
        grads[name] = g
    return grads


def relative_errors(analytic: dict[str, np.ndarray], numeric: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor: ``max |a - n| / max(max |n|, max |a|)`` (0.0 for a tensor whose both gradients are 0)."""
    out = {}
    for name in numeric:
        scale = max(float(np.max(np.abs(numeric[name]))), float(np.max(np.abs(analytic[name]))))
        diff = float(np.max(np.abs(analytic[name] - numeric[name])))
        out[name] = diff / scale if scale > 0 else diff
    return out


def model_for(config: dict) -> tuple[ModelConfig, dict, np.ndarray, np.ndarray]:
    """The run's model, parameters, tokens and targets (all from ``seed``)."""
    cfg = model_config(config, config["seq_len"])
    params = init_params(cfg, config["seed"])
    rng = np.random.default_rng([config["seed"], config["seq_len"], 0x6C])
    tokens = rng.integers(0, cfg.vocab, size=config["seq_len"]).astype(np.int64)
    targets = rng.integers(0, cfg.vocab, size=config["seq_len"]).astype(np.int64)
    return cfg, params, tokens, targets


def run(config: dict) -> dict:
    """One gradient check (module docstring). Columns: :data:`RESULT_FIELDS`."""
    validate_config(config)
    cfg, params, tokens, targets = model_for(config)
    loss, analytic = loss_and_grads(cfg, params, tokens, targets, F64)
    numeric = central_differences(cfg, params, tokens, targets)
    errors = relative_errors(analytic, numeric)
    names = list(param_shapes(cfg))
    worst = max(names, key=lambda n: errors[n])
    return {
        "tensors": len(errors),
        "tensor_names": names,
        "rel_err": [errors[n] for n in names],
        "worst_rel_err": errors[worst],
        "worst_tensor": worst,
        "loss": float(loss),
    }


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per depth: runs, tensors per model, worst relative error and the tensor that has it."""
    ok = ok_rows(df)
    return aggregated(
        ok,
        "n_layer",
        runs=("tensors", "size"),
        tensors=("tensors", "max"),
        worst_rel_err=("worst_rel_err", "max"),
        worst_tensor=("worst_rel_err", lambda errors: ok.loc[errors.idxmax(), "worst_tensor"]),
        median_rel_err=("worst_rel_err", "median"),
    )


def claims(df: pd.DataFrame) -> list[Claim]:
    """Every tensor of every run within :data:`TOLERANCE`, and every tensor checked."""
    ok = ok_rows(df)
    if not len(df):
        return []
    worst = float(ok["worst_rel_err"].max()) if len(ok) else float("nan")
    complete = all(int(r["tensors"]) == 4 + 8 * int(r["n_layer"]) == len(r["rel_err"]) for _, r in ok.iterrows())
    two = ok[ok["n_layer"] == 2]
    per_model = f"{int(two['tensors'].iloc[0])} tensors at 2 layers (4 + 8 per layer, no biases)" if len(two) else ""
    return [
        judged(
            "the hand-written gradient agrees with independently written central differences",
            f"{SEED_WORST:.1e} over {SEED_TENSORS} tensors",
            f"worst relative error {worst:.1e} over {int(ok['tensors'].sum())} tensors in {len(ok)} runs; {per_model}",
            BOUND,
            [
                ("every run ok", len(ok) == len(df)),
                (f"worst relative error <= {TOLERANCE:g}", bool(worst <= TOLERANCE)),
                ("every parameter tensor of every run checked (4 + 8 per layer)", bool(len(ok)) and complete),
            ],
        )
    ]


# --- the report: its figures and quoted facts (kvfast.report shows them: see Figure and Fact) ----------


def gradcheck_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per tensor name (over every run): runs, worst and median relative error."""
    long = ok_rows(df)[["n_layer", "tensor_names", "rel_err"]].explode(["tensor_names", "rel_err"])
    return (
        long.astype({"rel_err": np.float64})
        .groupby(["n_layer", "tensor_names"], sort=False)
        .agg(runs=("rel_err", "size"), worst=("rel_err", "max"), median=("rel_err", "median"))
        .reset_index()
        .rename(columns={"tensor_names": "tensor"})
    )


def _draw_rel_err(df: pd.DataFrame, table: pd.DataFrame):
    """Per tensor of the two-layer model, the worst and median relative error against the seed and the bound."""
    two = table[table["n_layer"] == (2 if (table["n_layer"] == 2).any() else table["n_layer"].max())]
    fig, ax = pyplot().subplots(figsize=(10, 3.8))
    x = np.arange(len(two))
    ax.bar(x, two["worst"], color="#1f77b4", label="worst over runs")
    ax.plot(x, two["median"], "o", color="black", ms=4, label="median")
    ax.axhline(3.2e-8, color="#d62728", ls="--", lw=1, label="seed's worst: 3.2e-8")
    ax.axhline(1e-6, color="grey", ls=":", lw=1, label="bound: 1e-6")
    ax.set_yscale("log")
    ax.set_ylim(top=1e-4)
    ax.set_xticks(x, two["tensor"], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("relative error vs central differences")
    ax.set_xlabel(f"parameter tensor ({len(two)} in a {int(two['n_layer'].iloc[0])}-layer model)")
    ax.set_title("Hand-written gradient vs central differences, per tensor")
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


def facts(df: pd.DataFrame) -> list[Fact]:
    """The quoted figures per depth: tensors per model and the worst relative error."""
    return [
        Fact(
            f"gradcheck_{int(n_layer)}layer",
            f"gradient check, {int(n_layer)} layer(s): tensors per model, worst relative error",
            f"{int(g['tensors'].max())} tensors, {float(g['worst_rel_err'].max()):.2g}",
        )
        for n_layer, g in ok_rows(df).groupby("n_layer")
    ]


FIGURES = (
    Figure(
        "gradcheck",
        "Gradient check per tensor",
        "The hand-written float64 backward against central differences (h = 1e-5) of an independently written "
        "loss, every element of every tensor. kvfast's model has 4 + 8 per layer tensors (no biases): 20 at two "
        "layers, where the seed reports 24 without listing them.",
        gradcheck_table,
        _draw_rel_err,
    ),
)


STUDY = study_of(
    globals(),
    "gradcheck",
    "hand-written backward vs central differences of an independent loss, every tensor",
    rank=70,
)
