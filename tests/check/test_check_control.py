"""Control mode: "rounding" for correct models whose cache path adds up in another order than their
recompute, "bug" for every catalogue bug that deviates in float32 and bfloat16 storage, and in the float64
logic check of a bfloat16 accumulator (where the native verdict may be "inconclusive", never "rounding");
an independently written NumPy model (whole-matrix recompute, one-row decode) gets "rounding" in float32."""

from __future__ import annotations

import numpy as np
import pytest

from kvfast import ModelConfig, Numerics, init_params
from kvfast.check import KvfastModel, check_cache
from kvfast.check.control import DEFAULT_DECISIVE, DEFAULT_MARGIN, judge, ulp
from kvfast.model.bugs import BUGS

CFG = ModelConfig(vocab=32, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
PROMPT = [3, 1, 4, 1, 5, 9, 2]
STEPS = 20

# prefill in one order, decode in another: f32, the bf16 preset (f32 accumulator), a bf16 accumulator
NUMERICS = {
    "f32": ("f32", "f32"),
    "bf16": ("bf16", "f32"),
    "bf16-acc": ("bf16", "bf16"),
}


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 1)


def _pair(name: str) -> tuple[Numerics, Numerics]:
    storage, accum = NUMERICS[name]
    return Numerics(storage, accum, "pairwise"), Numerics(storage, accum, "sequential")


@pytest.mark.parametrize("name", list(NUMERICS))
def test_kvfast_with_prefill_order_not_decode_order(params, name):
    prefill_nx, decode_nx = _pair(name)
    clean = check_cache(KvfastModel(CFG, params, prefill_nx, decode_numerics=decode_nx), PROMPT, STEPS, mode="control")
    assert clean.verdict == "rounding" and clean.passed
    exact = check_cache(KvfastModel(CFG, params, prefill_nx, decode_numerics=decode_nx), PROMPT, STEPS, mode="exact")
    if name != "bf16":
        # the orders really differ here, so an exact check flags the clean cache: control mode is needed
        assert exact.verdict == "divergent" and clean.max_deviation > 0
    else:
        # bf16 storage with an f32 accumulator: both orders land on the same bfloat16 values
        assert exact.verdict == "exact"
    for bug in BUGS:
        model = KvfastModel(CFG, params, prefill_nx, bug=bug, decode_numerics=decode_nx)
        report = check_cache(model, PROMPT, STEPS, mode="control", promote="float64")
        assert report.max_deviation > 0 and np.isfinite(report.max_ratio)
        same_order = check_cache(
            KvfastModel(CFG, params, decode_nx, bug=bug), PROMPT, STEPS, scenarios="decode", mode="exact"
        )
        acts = same_order.first_divergent_step
        if name == "bf16-acc":
            # a bfloat16 accumulator's own noise hides part of the effect: never "rounding", and the
            # float64 logic check calls it a bug at the step where it first acts
            assert report.verdict in ("bug", "inconclusive"), (name, bug)
        else:
            assert report.verdict == "bug", (name, bug)
            assert report.first_bug_step == acts, (name, bug)
        assert report.promoted.verdict == "bug" and report.promoted.first_bug_step == acts, (name, bug)
        assert not report.passed


def test_split_kv_decode_against_standard_prefill_is_rounding(params):
    prefill_nx = Numerics("f32", "f32", "sequential")
    decode_nx = Numerics("f32", "f32", "sequential", attention="splitcount", attn_block=3)
    model = KvfastModel(CFG, params, prefill_nx, decode_numerics=decode_nx)
    assert check_cache(model, PROMPT, STEPS, mode="exact").verdict == "divergent"
    assert check_cache(model, PROMPT, STEPS, mode="control").verdict == "rounding"


def test_without_any_noise_source_the_bound_is_the_formats_resolution(params):
    report = check_cache(KvfastModel(CFG, params, "f64", bug="posoff"), PROMPT, 4, mode="control", keep_logits=True)
    s = report.scenarios["decode"]
    assert s.bounds.bound[1] == ulp("float64", np.abs(s.reference[len(PROMPT)]).max())
    assert report.verdict == "bug" and np.isfinite(s.bounds.ratio).all() and (s.bounds.bound > 0).all()
    assert any("format resolution alone" in n for n in report.notes)
    assert s.bounds.floor_source[1] == "float64 resolution (1 ulp)"
    clean = check_cache(KvfastModel(CFG, params, "f64"), PROMPT, 4, mode="control")
    assert clean.verdict == "rounding" and clean.max_deviation == 0 and clean.max_ratio == 0


# --- judge -------------------------------------------------------------------------------------


def test_ulp_is_the_spacing_of_each_format():
    import ml_dtypes

    for fmt, dtype in [("float64", np.float64), ("float32", np.float32), ("float16", np.float16),
                       ("bfloat16", ml_dtypes.bfloat16)]:  # fmt: skip
        for x in (1.0, 0.7, 3.0, 1e-3, 250.0):
            v = np.asarray(x, dtype=dtype)
            spacing = float(np.nextafter(v, np.asarray(np.inf, dtype=dtype)) - v) if fmt != "bfloat16" else None
            if spacing is None:  # ml_dtypes: the next bfloat16 up from the bit pattern
                bits = v.view(np.uint16)
                spacing = float((bits + np.uint16(1)).view(ml_dtypes.bfloat16)) - float(v)
            assert ulp(fmt, float(v)) == spacing, (fmt, x)


def test_judge_thresholds_pooled_noise_and_resolution():
    scale = np.array([2.0, 2.0, 2.0, 4.0, 2.0])
    dev = np.array([0.0, 4e-3, 5e-3, 8e-3, 0.5])
    # pooled relative noise 1e-3: bounds 2e-3 (4e-3 at scale 4); the float32 ulp (2.4e-7 at 2) is below
    bound, ratio, verdicts, sources = judge(dev, scale, 1e-3, "variant 'x' at position 3", "float32", 2.0, 8.0)
    assert bound.tolist() == [2e-3, 2e-3, 2e-3, 4e-3, 2e-3]
    assert verdicts == ("rounding", "rounding", "inconclusive", "rounding", "bug")
    assert ratio[0] == 0.0 and ratio[4] == 250.0
    assert sources[1].startswith("order noise (variant 'x' at position 3")
    # no noise at all: the bound is one ulp of the logits' format, never 0, the ratio never infinite
    bound, ratio, verdicts, sources = judge(dev, scale, 0.0, "none", "bfloat16", 4.0, 16.0)
    assert bound.tolist() == [2**-6, 2**-6, 2**-6, 2**-5, 2**-6] and np.isfinite(ratio).all()
    assert sources[0] == "bfloat16 resolution (1 ulp)"
    assert verdicts == ("rounding",) * 4 + ("bug",)
    _, ratio, _, _ = judge(np.array([1e300]), np.array([0.0]), 0.0, "none", "float64", 4.0, 64.0)
    assert np.isfinite(ratio).all()
    assert DEFAULT_MARGIN == 4.0 and DEFAULT_DECISIVE > DEFAULT_MARGIN


# --- an independently written NumPy model ---------------------------------------------------------


class MatrixVsRowModel:
    """Written here, independently of kvfast: float32; ``recompute`` multiplies whole matrices (heads
    batched in one 3-D product), ``decode`` one row over the cache; ``recompute_variants`` recomputes
    one row at a time (no cache). ``bug="skip_first_key"``: decode attention drops key 0."""

    def __init__(self, params: dict, n_head: int, hook: bool = True, bug: str | None = None):
        self.p = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
        self.H, self.hook, self.bug = n_head, hook, bug
        self.L = sum(k.endswith(".wq") for k in params)
        self.vocab_size = self.p["wte"].shape[0]

    def _norm(self, x, g):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(1e-5)) * g

    def _attend_matrix(self, q, k, v):
        T, d = q.shape
        hd = d // self.H

        def heads(a):
            return a.reshape(a.shape[0], self.H, hd).transpose(1, 0, 2)

        s = heads(q) @ heads(k).transpose(0, 2, 1) / np.float32(np.sqrt(hd))
        s = np.where(np.triu(np.ones((T, k.shape[0]), bool), 1), -np.inf, s)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        return ((w / w.sum(axis=-1, keepdims=True)) @ heads(v)).transpose(1, 0, 2).reshape(T, d)

    def _attend_row(self, q, k, v, lo=0):
        hd = q.shape[1] // self.H
        out = np.empty_like(q)
        for h in range(self.H):
            c = slice(h * hd, (h + 1) * hd)
            s = q[:, c] @ k[lo:, c].T / np.float32(np.sqrt(hd))
            w = np.exp(s - s.max())
            out[:, c] = (w / w.sum()) @ v[lo:, c]
        return out

    def _forward(self, tokens, rows: bool):
        p = self.p
        T = len(tokens)

        def mm(a, w):
            return np.concatenate([a[t : t + 1] @ w for t in range(a.shape[0])]) if rows else a @ w

        x = p["wte"][tokens] + p["wpe"][:T]
        ks, vs = [], []
        for i in range(self.L):
            pre = f"h{i}."
            h = self._norm(x, p[pre + "g1"])
            q, k, v = mm(h, p[pre + "wq"]), mm(h, p[pre + "wk"]), mm(h, p[pre + "wv"])
            if rows:
                y = np.concatenate([self._attend_row(q[t : t + 1], k[: t + 1], v[: t + 1]) for t in range(T)])
            else:
                y = self._attend_matrix(q, k, v)
            x = x + mm(y, p[pre + "wo"])
            u = mm(self._norm(x, p[pre + "g2"]), p[pre + "w1"])
            x = x + mm(u / (1 + np.exp(-u)), p[pre + "w2"])
            ks.append(k)
            vs.append(v)
        return mm(self._norm(x, p["gf"]), p["w_out"]), ks, vs

    def recompute(self, tokens):
        return self._forward(np.asarray(tokens), rows=False)[0]

    def recompute_variants(self, tokens):
        return {"one row at a time": self._forward(np.asarray(tokens), rows=True)[0]} if self.hook else {}

    def prefill(self, tokens):
        logits, self.K, self.V = self._forward(np.asarray(tokens), rows=False)
        return logits

    def decode(self, token):
        p, pos = self.p, self.K[0].shape[0]
        x = (p["wte"][token] + p["wpe"][pos])[None, :]
        for i in range(self.L):
            pre = f"h{i}."
            h = self._norm(x, p[pre + "g1"])
            q = h @ p[pre + "wq"]
            self.K[i] = np.concatenate([self.K[i], h @ p[pre + "wk"]])
            self.V[i] = np.concatenate([self.V[i], h @ p[pre + "wv"]])
            y = self._attend_row(q, self.K[i], self.V[i], lo=1 if self.bug == "skip_first_key" else 0)
            x = x + y @ p[pre + "wo"]
            u = self._norm(x, p[pre + "g2"]) @ p[pre + "w1"]
            x = x + (u / (1 + np.exp(-u))) @ p[pre + "w2"]
        return (self._norm(x, p["gf"]) @ p["w_out"])[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_independent_numpy_model_is_rounding_in_float32(seed):
    params = init_params(CFG, seed)
    exact = check_cache(MatrixVsRowModel(params, CFG.n_head), PROMPT, 30, scenarios="decode", mode="exact")
    assert exact.verdict == "divergent"  # whole-matrix and one-row products really add up differently
    assert exact.max_deviation < 1e-4
    for hook in (True, False):
        report = check_cache(MatrixVsRowModel(params, CFG.n_head, hook=hook), PROMPT, 30, mode="control")
        assert report.verdict == "rounding", (seed, hook)
        # BLAS rows depend on the batch: not append-invariant, yet control mode keeps its fast path
        assert report.path == "fast" and any("prefix recomputes" in n for n in report.notes)
        per_step = check_cache(MatrixVsRowModel(params, CFG.n_head, hook=hook), PROMPT, 30, mode="control", fast=False)
        assert per_step.verdict == "rounding" and per_step.path == "per-step"
    bugged = check_cache(MatrixVsRowModel(params, CFG.n_head, bug="skip_first_key"), PROMPT, 30, mode="control")
    assert bugged.verdict == "bug"
    assert bugged.scenarios["decode"].first_bug_step == 1
