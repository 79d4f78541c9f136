"""Every causal-LM architecture of the installed transformers as a tiny random model (extra ``kvfast[hf]``).

The architectures are transformers' own: every model type of its auto mapping
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (:func:`causal_lm_types`), never a hand-kept list. A type's tiny model
(:func:`tiny_architecture`) is its causal-LM class built from its config class's defaults, shrunk
(:func:`shrink`): widths, layers, heads, vocabulary, experts and low ranks made small; what matters to
the cache kept: sliding windows (made small enough to act within a check), rotary scaling, soft-capping,
and the attention types of its layers (one layer of each distinct type, in order of first appearance).
Sub-configs (``text_config``, ``vision_config``, ...) are shrunk the same way.

What transformers itself cannot build or run from that config raises :class:`Unbuildable` with transformers'
own error as the reason: the scan stores it as a ``skipped`` row, not as an error of kvfast.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import functools

#: The vocabulary of every tiny model (special token ids beyond it are left as they are: random prompts
#: never contain them, so a multimodal model's image token is never asked for).
VOCAB = 96
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 128
EXPERTS = 4
#: A sliding window this small acts within the scan's checks (prompts of 4 to 7 tokens, 16 steps).
WINDOW = 12
POSITIONS = 512
#: Per-layer lists are cut to at most this many layers (one of each distinct attention type first).
MAX_LAYERS = 4

#: Integer fields set to a small value when the default is larger (the name is the config's key).
SMALL: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "dim", "model_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), HEADS),
    **dict.fromkeys(("encoder_attention_heads",), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "d_head", "d_kv"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff"), FFN),
    **dict.fromkeys(("ffn_hidden_size", "mlp_dim", "inner_hidden_size", "d_inner", "dim_ff", "ffn_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("moe_ffn_hidden_size", "shared_intermediate_size", "intermediate_size_mlp"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "top_k", "num_selected_experts", "moe_topk"), 2),
    **dict.fromkeys(("num_experts_per_token",), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_groups", "moe_num_shared_experts", "num_expert_group"), 1),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "index_head_dim"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "swa_head_dim"), HEAD_DIM),
    **dict.fromkeys(("rotary_dim",), HEAD_DIM // 2),
    **dict.fromkeys(("vocab_size", "n_vocab", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length"), POSITIONS),
    **dict.fromkeys(("sliding_window", "attention_window", "window_size", "local_window_size"), WINDOW),
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size", "d_state", "linear_key_head_dim"), 16),
    **dict.fromkeys(("mamba_n_heads", "linear_num_value_heads", "linear_num_key_heads", "ssm_num_heads"), 4),
    **dict.fromkeys(("linear_num_heads",), HEADS),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    **dict.fromkeys(("mamba_expand", "expand"), 1),
    **dict.fromkeys(("swa_num_attention_heads",), HEADS),
    **dict.fromkeys(("swa_num_key_value_heads",), KV_HEADS),
    **dict.fromkeys(("num_nextn_predict_layers",), 0),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    **dict.fromkeys(("vocab_size_per_layer_input",), VOCAB),
    **dict.fromkeys(("hidden_size_per_layer_input",), HEAD_DIM),
    **dict.fromkeys(("image_size",), 32),
    **dict.fromkeys(("patch_size",), 8),
    **dict.fromkeys(("vision_output_dim", "projection_dim", "hidden_size_per_head"), HIDDEN),
}
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
#: Layer counts: shrunk to 2 unless the per-layer types ask for more (one layer per distinct type).
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
)
#: Per-layer attention types (the list the layer count follows).
TYPE_KEYS = ("layer_types", "attention_layers", "layers_block_type", "block_types", "hybrid_override_pattern")
#: Ids the embedding uses as ``padding_idx``: they must be inside the vocabulary.
PAD_KEYS = ("pad_token_id", "padding_idx")


class Unbuildable(Exception):
    """transformers cannot build or run this architecture's tiny model: ``reason`` is its own error."""

    def __init__(self, model_type: str, reason: str) -> None:
        super().__init__(f"{model_type}: {reason}")
        self.model_type = model_type
        self.reason = reason


#: Rotary scalings scanned as architectures of their own (``base+scaling``; issue 18, rule 7): their positions
#: pass ``ROPE_LIMIT`` within a 16-step check. Dynamic NTK and LongRoPE change every key's frequencies with the
#: length, so no cache can equal their recompute (verdict ``length-dependent``); YaRN's are fixed (a control).
ROPE_LIMIT = 16
ROPE_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama+dynamic": ("llama", {"max_position_embeddings": ROPE_LIMIT,
                                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama+yarn": ("llama", {"max_position_embeddings": 4 * ROPE_LIMIT,
                             "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": ROPE_LIMIT}}),
    "phi3+longrope": ("phi3", {"original_max_position_embeddings": ROPE_LIMIT,
                               "max_position_embeddings": 4 * ROPE_LIMIT,
                               "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * (HEAD_DIM // 2),
                                                "long_factor": [1.0 + k for k in range(HEAD_DIM // 2)]}}),
}  # fmt: skip


@functools.lru_cache(maxsize=1)
def causal_lm_types() -> dict[str, str]:
    """Model type -> causal-LM class name, from the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
    (only types that also have a config class), in name order; then the rotary scalings of
    :data:`ROPE_VARIANTS` whose base type is there."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if isinstance(name, tuple | list):  # some releases list several classes: the first is the default
            name = name[0]
        if model_type in CONFIG_MAPPING_NAMES and name:
            out[model_type] = name
    out.update({variant: out[base] for variant, (base, _) in ROPE_VARIANTS.items() if base in out})
    return out


def _layers_kept(types: list) -> list[int]:
    """Indices of the layers kept: the first layer of each distinct type, then the next layers, up to 2 (at most
    :data:`MAX_LAYERS`), in their original order."""
    firsts: dict[str, int] = {}
    for i, kind in enumerate(types):
        firsts.setdefault(repr(kind), i)
    kept = list(firsts.values())[:MAX_LAYERS]
    return sorted(kept + [i for i in range(len(types)) if i not in kept][: max(0, 2 - len(kept))])


def _per_layer(table: dict, kept: list[int]) -> dict:
    """A ``{layer index: options}`` table (keys as text, maybe zero-padded) for the kept layers, renumbered."""
    out = {}
    for new, old in enumerate(kept):
        for key, value in table.items():
            if str(key).isdigit() and int(key) == old:
                out[str(new).zfill(len(str(key))) if isinstance(key, str) else new] = value
    return out


def _first_int(d: dict, keys: tuple[str, ...]) -> int | None:
    """The value of the first of ``keys`` that ``d`` holds as an integer (not a bool), ``None`` if none."""
    return next((d[k] for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def _plan(d: dict) -> tuple[int | None, list[int], int]:
    """``(layers in the config, indices of the layers kept, layers of the tiny model)``.

    Per-layer types as long as the layer count keep :func:`_layers_kept`; a shorter list is a repeating pattern
    (RecurrentGemma's ``block_types``): the tiny model has one period of it (at most :data:`MAX_LAYERS`); layers
    that share another layer's keys and values (``num_kv_shared_layers``) get the kept layers twice over, so that
    the second half can share the first's.
    """
    n = _first_int(d, LAYER_KEYS)
    if not n:
        return n, [], 0
    types = next((d[k] for k in TYPE_KEYS if isinstance(d.get(k), list | str) and len(d[k]) == n), None)
    kept = _layers_kept(list(types)) if types is not None else list(range(min(n, 2)))
    pattern = next((d[k] for k in TYPE_KEYS if isinstance(d.get(k), list) and 2 < len(d[k]) < n), None)
    count = min(len(pattern), MAX_LAYERS) if pattern is not None and types is None else len(kept)
    if isinstance(d.get("num_kv_shared_layers"), int) and d["num_kv_shared_layers"] > 0 and types is not None:
        tail = {max(j for j in range(n) if types[j] == types[i]) for i in kept}  # the same types, last layers
        kept = sorted(set(kept) | tail)
        count = len(kept)
    return n, kept, count


def _hooks(d: dict, n: int | None, kept: list[int], count: int) -> dict:
    """Options whose defaults make no sense for a tiny model: hybrid layouts that would keep no attention layer,
    an adapter with no language, a shared-KV tail longer than the model."""
    out: dict = {}
    if isinstance(d.get("attn_layer_period"), int) and d["attn_layer_period"] > count:
        out["attn_layer_period"], out["attn_layer_offset"] = count, count - 1  # Jamba: the last layer attends
    if "attn_layer_indices" in d and not d["attn_layer_indices"]:
        out["attn_layer_indices"] = [count - 1]  # Bamba: attention in the last layer (none by default)
    if d.get("default_language") is None and d.get("languages"):
        out["default_language"] = d["languages"][0]  # X-MOD: a language adapter must be chosen
    if isinstance(d.get("num_kv_shared_layers"), int) and d["num_kv_shared_layers"] > 0:
        out["num_kv_shared_layers"] = count // 2
    return out


def _derived(d: dict, out: dict) -> dict:
    """Fields a default config leaves ``None`` for the checkpoint to fill, which the modeling code reads without a
    fallback (HunYuan's and Ministral's ``head_dim``, Nemotron's ``num_key_value_heads``): given the value the
    config's own docs derive for ``None`` (the hidden size over the heads; as many key/value heads as heads)."""
    merged = {**d, **out}
    heads = _first_int(merged, HEAD_KEYS)
    extra: dict = {}
    if "head_dim" in d and d["head_dim"] is None and heads:
        extra["head_dim"] = merged.get("hidden_size", HIDDEN) // heads
    for key in KV_KEYS:
        if key in d and d[key] is None and heads:
            extra[key] = heads
    return extra


def _rope_per_type(d: dict, types: list[str]) -> dict:
    """Default rotary parameters for each of ``types`` (CohereCompass's default ``rope_parameters`` is ``{}``,
    while its rotary embedding looks each layer type up in it)."""
    theta = d.get("default_theta") or 10000.0
    return {t: {"rope_type": "default", "rope_theta": theta} for t in dict.fromkeys(types)}


#: Per-type overrides, keyed by the config's ``model_type`` (a sub-config's too), applied after the generic ones:
#: what a type's default config leaves to the checkpoint, or a constraint between fields the generic shrinking
#: breaks. Each takes ``(default config dict, overrides so far)``; the comment says why.
TYPE_OVERRIDES: dict = {
    # The expert counts are None by default (every checkpoint sets them); the MoE layer needs them.
    "dots1": lambda d, out: {"n_routed_experts": EXPERTS, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "deepseek_v2": lambda d, out: {"num_experts_per_tok": 2},
    # The attention reads ``attn_config.rope_theta``, which the default attention sub-config lacks (the outer
    # config keeps it in ``rope_parameters``), and clamps by ``clip_qkv``, which torch refuses as None on both
    # sides: DBRX's own value (8).
    "dbrx": lambda d, out: {
        "attn_config": {**out.get("attn_config", d["attn_config"]), "clip_qkv": 8.0,
                        "rope_theta": (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)}
    },
    "cohere_compass_text": lambda d, out: {"rope_parameters": _rope_per_type(d, out.get("layer_types") or [])},
    # No default layer layout (None): a convolution layer then an attention layer, as the checkpoints mix them.
    "lfm2_moe": lambda d, out: {"layer_types": ["conv", "full_attention"]},
    # The default layout is recurrent only (checkpoints add attention layers): attention in the last layer.
    "granitemoehybrid": lambda d, out: {"layer_types": ["linear_attention", "attention"]},
    # The shared transformer block is tied across its hybrid layers: it needs two of them to tie.
    "zamba": lambda d, out: {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
                             "layers_block_type": ["linear_attention", "hybrid"] * 2},
    # Axial position embeddings: their widths sum to the hidden size, their shape multiplies to the positions.
    "reformer": lambda d, out: {"axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2], "axial_pos_shape": [16, 32]},
    # The QSA indexer has no defaults (None); small ones with a budget that selects within a check.
    "qwen4_exp_text": lambda d, out: {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                                      "indexer_budget": 8, "indexer_compress_ratio": 4},
    # ``to_dict`` lists an ``mlp`` block after each layer and doubles the layer counts; the constructor halves
    # them: one input, one recurrent and one output layer, with both attention types.
    "dory": lambda d, out: {"num_hidden_layers": 6, "n_input_layers": 2, "n_output_layers": 2,
                            "n_recurrent_layers": 2,
                            "layer_types": ["sliding_attention", "mlp", "sliding_attention", "mlp",
                                            "full_attention", "mlp"]},
}  # fmt: skip


def shrink(d: dict) -> dict:
    """The overrides that make a config (as ``to_dict()`` gives it) tiny; nested sub-config dicts shrunk too.

    Only keys the config has are set; per-layer lists (as long as the layer count) keep the layers of
    :func:`_plan`; a sliding window is made :data:`WINDOW` (never larger than it was); rotary scaling,
    soft-capping and attention types are kept as they are.
    """
    n, kept, count = _plan(d)
    out: dict = {}
    for key, value in d.items():
        if key == "is_decoder" and value is False:  # encoder classes (BERT, RoBERTa) cache only as decoders
            out[key] = True
        if isinstance(value, bool) or key in ("id2label", "label2id"):
            continue
        if key == "per_layer_config" and isinstance(value, dict):
            out[key] = _per_layer(value, kept)
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = {**value, **shrink(value)}
        elif key in LAYER_KEYS and isinstance(value, int) and n:
            out[key] = count
        elif n and isinstance(value, list | str) and key in TYPE_KEYS and len(value) == n:
            picked = [value[i] for i in kept]
            out[key] = "".join(picked) if isinstance(value, str) else picked
        elif n and isinstance(value, list) and len(value) == n and n > 2:
            out[key] = [value[i] for i in kept]
        elif key in KV_KEYS and isinstance(value, int) and value == _first_int(d, HEAD_KEYS):
            out[key] = HEADS  # as many key/value heads as query heads (multi-head latent attention needs it)
        elif key in SMALL and isinstance(value, int) and value > SMALL[key]:
            out[key] = SMALL[key]
        elif key in PAD_KEYS and isinstance(value, int) and value >= VOCAB:
            out[key] = 0
    out = {**out, **_hooks(d, n, kept, count)}
    out.update(_derived(d, out))
    fix = TYPE_OVERRIDES.get(d.get("model_type"))
    return {**out, **fix(d, out)} if fix else out


def adapter_of(model):
    """The :class:`kvfast.check.hf.HFModel` of ``model``: given no cache object where the model builds its own
    (:func:`kvfast.check.hf.builds_own_cache`, where it is decided)."""
    from kvfast.check.hf import HFModel, builds_own_cache

    return HFModel(model, new_cache=(lambda: None) if builds_own_cache(model) else None)


def pad_token(model) -> int | None:
    """The model's padding token id (its text config's for a composite model), ``None`` if it has none."""
    config = model.config
    pad = getattr(config, "pad_token_id", None)
    if pad is None and hasattr(config, "get_text_config"):
        try:
            pad = getattr(config.get_text_config(), "pad_token_id", None)
        except ValueError:  # several text configs (MusicGen): no single answer
            pad = None
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def tiny_config(model_type: str):
    """The shrunk config of ``model_type`` (its config class's defaults with :func:`shrink`'s overrides);
    :class:`Unbuildable` when transformers refuses it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base_type, rope = ROPE_VARIANTS.get(model_type, (model_type, {}))
    cls = CONFIG_MAPPING[base_type]
    try:
        base = cls()
        overrides = shrink(base.to_dict())
        return cls(**{**overrides, **rope})
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal is the reason the scan records
        raise Unbuildable(model_type, _reason("config", exc)) from exc


def _reason(where: str, exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{where}: {type(exc).__name__}: {text[:300]}"


def _config_for(model_type: str, config, wanted: type):
    """``config``, or its sub-config the causal-LM class takes (a multimodal type whose causal-LM class is its
    text model, MusicGen's decoder); :class:`Unbuildable` when there is none."""
    if isinstance(config, wanted):
        return config
    for value in vars(config).values():
        if isinstance(value, wanted):
            return value
    try:
        return config.get_text_config()
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal (several text configs) is the reason
        raise Unbuildable(model_type, _reason("config", exc)) from exc


def tiny_architecture(model_type: str, dtype: str = "float32", attention: str = "auto", seed: int = 0):
    """``model_type``'s causal-LM class over :func:`tiny_config`, weights seeded by ``seed``, in ``dtype``,
    eval mode, with ``attention`` (``auto``: transformers' own default for the class); :class:`Unbuildable`
    naming transformers' error when it cannot be built."""
    import torch
    import transformers

    config = tiny_config(model_type)
    name = causal_lm_types()[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise Unbuildable(model_type, f"class: transformers has no {name}")
    config = _config_for(model_type, config, cls.config_class)
    kwargs = {} if attention == "auto" else {"attn_implementation": attention}
    torch.manual_seed(seed)
    try:
        model = cls._from_config(config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' refusal (eager-only, missing kernels) is the reason
        raise Unbuildable(model_type, _reason("model", exc)) from exc
    if not isinstance(getattr(model.config, "vocab_size", None), int):
        # A composite config (Gemma 3, Fuyu) keeps its vocabulary in the text config, where the adapter does not
        # look (kvfast.check.hf reads model.config.vocab_size): name it on the outer config.
        model.config.vocab_size = model.config.get_text_config().vocab_size
    return model.eval().to(getattr(torch, dtype))
