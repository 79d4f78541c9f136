"""The model's sizes (:class:`ModelConfig`), its parameters' names and shapes, their initialisation,
validation and ``.npz`` storage."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvfast.validation import not_allowed, require_int


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny pre-norm transformer.

    ``d_model`` must be divisible by ``n_head``; every size is a positive integer;
    ``eps`` (RMSNorm) is a positive float.
    """

    vocab: int  # number of token ids (rows of wte, columns of w_out)
    d_model: int  # width of the residual stream, of q, k, v and of each K/V cache row
    n_head: int  # attention heads, each of width head_dim = d_model // n_head
    n_layer: int  # transformer blocks (attention + MLP), each with its own K/V cache
    d_ff: int  # hidden width of the SiLU MLP
    max_pos: int  # learned positions (rows of wpe): the longest sequence and the cache capacity
    eps: float = 1e-5  # added to mean(x^2) inside every RMSNorm

    def __post_init__(self) -> None:
        for field in ("vocab", "d_model", "n_head", "n_layer", "d_ff", "max_pos"):
            object.__setattr__(self, field, require_int(getattr(self, field), field, 1))
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model: {self.d_model} is not divisible by n_head={self.n_head}; allowed: a multiple of n_head"
            )
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, float | int | np.floating) or not eps > 0:
            raise not_allowed("eps", eps, "a positive float")
        object.__setattr__(self, "eps", float(eps))

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order."""
    d, f = config.d_model, config.d_ff
    shapes: dict[str, tuple[int, ...]] = {"wte": (config.vocab, d), "wpe": (config.max_pos, d)}
    for layer in range(config.n_layer):
        shapes[f"h{layer}.g1"] = (d,)
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"h{layer}.{name}"] = (d, d)
        shapes[f"h{layer}.g2"] = (d,)
        shapes[f"h{layer}.w1"] = (d, f)
        shapes[f"h{layer}.w2"] = (f, d)
    shapes["gf"] = (d,)
    shapes["w_out"] = (d, config.vocab)
    return shapes


#: The short names of the parameters that start at 1 (the RMSNorm gains); every other parameter is drawn.
GAINS = ("g1", "g2", "gf")


def init_params(config: ModelConfig, seed: int, positions_last: bool = False) -> dict[str, np.ndarray]:
    """Random float64 parameters: embeddings N(0, 1), matrices N(0, 1/fan_in), gains 1.

    The drawn parameters take consecutive standard normal draws of ``numpy.random.default_rng(seed)``
    in :func:`param_shapes`' order; the gains take none. ``positions_last``: the position embeddings
    ``wpe`` take the last draws instead of the second, so that every other parameter is the same for
    any ``max_pos`` and a model with more positions extends one with fewer (row ``p`` of ``wpe`` is the
    same in both): a model of a seed and shape whose weights do not depend on how long a sequence it
    runs (the exactness study's). The names are in :func:`param_shapes`' order either way.
    """
    rng = np.random.default_rng(require_int(seed, "seed", 0))
    shapes = param_shapes(config)
    drawn = ({n: s for n, s in shapes.items() if n != "wpe"} | {"wpe": shapes["wpe"]}) if positions_last else shapes
    n_drawn = sum(math.prod(shape) for name, shape in shapes.items() if _short(name) not in GAINS)
    params = _cut(drawn, rng.standard_normal(n_drawn))
    return {name: params[name] for name in shapes}


def _cut(shapes: dict[str, tuple[int, ...]], draws: np.ndarray) -> dict[str, np.ndarray]:
    """The parameters of ``shapes`` cut from ``draws`` in that order (each array its own, no view of ``draws``)."""
    params = {}
    at = 0
    for name, shape in shapes.items():
        short = _short(name)
        if short in GAINS:
            params[name] = gain = np.empty(shape)  # np.ones, without its Python wrapper (a third of the time)
            gain.fill(1.0)
            continue
        block = draws[at : at + math.prod(shape)].reshape(shape)
        at += block.size
        # math.sqrt and np.sqrt are both IEEE's correctly rounded square root: the same divisor
        params[name] = block.copy() if short in ("wte", "wpe") else block / math.sqrt(shape[0])
    return params


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def require_params(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Validate names, shapes and dtypes; return float64 C-contiguous copies."""
    if not isinstance(params, dict):
        raise ValueError(f"params: {type(params).__name__} is not allowed; allowed: a dict of arrays")
    shapes = param_shapes(config)
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise ValueError(
            f"params: names do not match the config (missing: {missing[:5]}, unexpected: {extra[:5]}); "
            f"allowed: exactly {len(shapes)} arrays named like 'wte', 'h0.wq', 'w_out'"
        )
    out = {}
    for name, shape in shapes.items():
        arr = params[name]
        dtype = getattr(arr, "dtype", None)
        if dtype is None:
            raise ValueError(
                f"params[{name!r}]: {type(arr).__name__} is not allowed; allowed: a float32 or float64 array"
            )
        if dtype not in (np.float64, np.float32):
            raise ValueError(f"params[{name!r}]: dtype {dtype} is not allowed; allowed: float32, float64")
        if arr.shape != shape:
            raise ValueError(f"params[{name!r}]: shape {arr.shape} is not allowed; allowed: {shape}")
        out[name] = np.ascontiguousarray(arr, dtype=np.float64)
    return out


def save_params(path: str | Path, config: ModelConfig, params: dict) -> None:
    """Write a ``.npz`` with one array per parameter (its name) and ``config`` (JSON)."""
    checked = require_params(config, params)
    np.savez(Path(path), config=np.array(json.dumps(asdict(config))), **checked)


def load_params(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a ``.npz`` written by :func:`save_params`."""
    with np.load(Path(path), allow_pickle=False) as data:
        if "config" not in data.files:
            raise ValueError(f"path: {path} has no 'config' entry; allowed: a file written by save_params")
        config = ModelConfig(**json.loads(str(data["config"])))
        params = {name: data[name] for name in data.files if name != "config"}
    return config, require_params(config, params)
