"""The architectures the engine serves: one entry per HF `model_type`, each reading the features its family uses
from config.json (the same checkpoint layout and module names as HF's modeling code, so the weights load by
name into shared/model.py's layers). Where config.json leaves a field out, the family's HF default applies.

| model_type | family | what differs from Llama |
|---|---|---|
| llama | Llama 2, Llama 3.x, SmolLM | rope scaling (`llama3`, `linear`, `yarn`: shared/rope.py); q/k/v/o bias |
| mistral | Mistral | a sliding window on every layer |
| qwen2 | Qwen2, Qwen2.5 | bias on q/k/v; with use_sliding_window, windows from layer max_window_layers on |
| qwen3 | Qwen3 | RMSNorm over each query and key head before RoPE; head_dim set apart from hidden/heads |
| phi3 | Phi-3, 3.5 | q/k/v as one `qkv_proj`, gate/up as one `gate_up_proj` (split on load); window; `longrope` |
| gemma2 | Gemma 2 | see below; windows on alternate layers; attention-logit and final-logit soft-capping |
| gemma3_text | Gemma 3 (text) | see below; q/k norms; five windowed layers to one global; a RoPE of their own |

Gemma (gemma_norms): RMSNorm scales by (1 + weight), computed in fp32 before the cast; embeddings are multiplied by
sqrt(hidden_size); each layer norms the attention output, and the MLP input and output (four norms a layer); the
MLP gate is GELU (tanh approximation); attention scales by query_pre_attn_scalar ** -0.5.

Sliding windows run in every attention kernel (shared/attention.py). Anything this module does not know (another
model_type, another activation, `mlp_bias`, a rope type shared/rope.py refuses, bidirectional attention, a layer
type other than full or sliding) is refused at start with the field named and the supported values.
"""
from __future__ import annotations

import math

# shared/rope.py computes each. `dynamic` NTK scaling changes the frequencies with each batch's longest sequence, so
# a request's tokens would depend on its neighbours: refused. `longrope` is decided per request (Request.rope_long):
# the long factors when its tokens outnumber the original context, and a recompute when it grows past it, as HF's
# Phi-3 generating one sequence (ModelConfig.longrope_context).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters(cfg: dict, params: dict | None = None) -> dict:
    """The rope settings of an HF config.json dict (or of params, one layer type's entry in it): rope_theta,
    rope_type and that type's numbers. ValueError naming the field when the type is not one of ROPE_TYPES."""
    params = dict(params if params is not None else cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
                         + (" (dynamic NTK scaling makes a request's tokens depend on the batch)"
                            if rope_type == "dynamic" else ""))
    params["rope_type"] = rope_type
    params.pop("type", None)
    if rope_type in ("llama3", "yarn", "longrope"):  # (as transformers' standardize_rope_params fills them in)
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings")
                          or cfg.get("max_position_embeddings", 2048))
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = cfg.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = params.get(name)
            if not isinstance(factors, (list, tuple)) or len(factors) * 2 != _head_dim(cfg):
                raise ValueError(f"rope_parameters.{name} must list head_dim / 2 = {_head_dim(cfg) // 2} factors")
            params[name] = tuple(float(f) for f in factors)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported; supported: [1.0]")
    return params


def positive_number(cfg: dict, name: str, default: float | None = None, integer: bool = False) -> float:
    """cfg[name] (default when absent) when it is a finite number > 0 (an int with integer); ValueError naming the
    field otherwise (null included)."""
    value = cfg.get(name, default)
    kinds = (int,) if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return value


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _as_items(params: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in params.items() if v is not None))


def _llama(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias}


def _no_bias(cfg: dict) -> dict:
    return {}


def _qwen2(cfg: dict) -> dict:
    return {"attention_bias": True}


def _qwen3(cfg: dict) -> dict:
    return _llama(cfg) | {"qk_norm": True}


def _gemma2(cfg: dict) -> dict:
    return _llama(cfg) | {
        "gemma_norms": True, "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",
        "query_pre_attn_scalar": positive_number(cfg, "query_pre_attn_scalar", 256),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0)}


def _gemma3(cfg: dict) -> dict:
    return _gemma2(cfg) | {"qk_norm": True, "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
                           "final_logit_softcapping": cfg.get("final_logit_softcapping")}


# the features beyond Llama's fields, as a Llama has them (ModelConfig's defaults)
LLAMA_FEATURES = {"model_type": "llama", "attention_bias": False, "o_proj_bias": False, "qk_norm": False,
                  "gemma_norms": False, "hidden_act": "silu", "query_pre_attn_scalar": None,
                  "attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": None,
                  "layer_types": (), "rope_local": ()}

# model_type -> features read from its config.json beyond the Llama fields ModelConfig.from_dir reads
ARCHITECTURES = {"llama": _llama, "mistral": _no_bias, "phi3": _no_bias, "qwen2": _qwen2, "qwen3": _qwen3,
                 "gemma2": _gemma2, "gemma3_text": _gemma3}


def _default_layer_types(cfg: dict, num_layers: int) -> list[str]:
    """Which layers slide when config.json has no layer_types: HF's default for each family."""
    model_type = cfg.get("model_type")
    if model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    pattern = {"gemma2": 2, "gemma3_text": positive_number(cfg, "sliding_window_pattern", 6, integer=True)}.get(
        model_type)
    if pattern is not None:
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers  # (Mistral, Phi-3: the window is on every layer)


def sliding_window(cfg: dict) -> tuple[int | None, tuple[str, ...]]:
    """(the window, each layer's type): (None, ()) without a window; otherwise layer_types lists, per layer,
    "sliding_attention" (attends within the last `window` positions) or "full_attention". Qwen2/3 use their window
    only with use_sliding_window; Gemma's defaults to 4096 (HF's). ValueError on another layer type or on
    bidirectional attention."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention true is not supported (causal attention only)")
    window = cfg.get("sliding_window", 4096 if cfg.get("model_type", "").startswith("gemma") else None)
    if window is None or (cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window")):
        return None, ()
    layer_types = cfg.get("layer_types") or _default_layer_types(cfg, cfg["num_hidden_layers"])
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types {unknown or layer_types} is not supported; supported: one of "
                         f"{list(LAYER_TYPES)} per layer")
    if "sliding_attention" not in layer_types:
        return None, ()
    return positive_number(cfg, "sliding_window", integer=True), tuple(layer_types)


def architecture_features(cfg: dict) -> dict:
    """The architecture fields of ModelConfig beyond Llama's, from an HF config.json dict: model_type, biases,
    norms, activation, attention scale and soft-capping, rope (rope_parameters' items; rope_local for the sliding
    layers of Gemma 3), sliding_window and layer_types, max_model_len. ValueError naming the field when the
    checkpoint needs something the engine does not do."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        hint = " (the multimodal Gemma 3; its text model is model_type gemma3_text)" if model_type == "gemma3" else ""
        raise ValueError(f"model_type {model_type!r} is not supported{hint}; supported: {sorted(ARCHITECTURES)}")
    features = LLAMA_FEATURES | {"model_type": model_type} | ARCHITECTURES[model_type](cfg)
    if features["hidden_act"] == "silu":
        features["hidden_act"] = cfg.get("hidden_act", "silu")
    if features["hidden_act"] not in ACTIVATIONS:
        raise ValueError(f"hidden_act {features['hidden_act']!r} is not supported for {model_type}; supported: "
                         f"{list(ACTIVATIONS)}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias true is not supported (no bias on the MLP projections)")
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type or model_type == "gemma3_text":  # Gemma 3: one RoPE per layer type
        full = per_type.get("full_attention", cfg.get("rope_scaling") or {})
        local = per_type.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
        features["rope"] = _as_items(rope_parameters({"rope_theta": 1_000_000.0} | cfg, full))
        features["rope_local"] = _as_items(rope_parameters(cfg, local))
    else:
        features["rope"] = _as_items(rope_parameters(cfg))
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):  # (null: no cap)
        if features[name] is not None:
            positive_number(features, name)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings"):
        positive_number(cfg, name, 2048 if name == "max_position_embeddings" else None, integer=True)
    for name in ("num_key_value_heads", "head_dim"):  # (null or absent: derived from the heads)
        if cfg.get(name) is not None:
            positive_number(cfg, name, integer=True)
    if cfg.get("rms_norm_eps") is not None:
        positive_number(cfg, "rms_norm_eps")
    if cfg["num_attention_heads"] % (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]):
        raise ValueError(f"num_attention_heads ({cfg['num_attention_heads']}) must be a multiple of "
                         f"num_key_value_heads ({cfg['num_key_value_heads']})")
    features["sliding_window"], features["layer_types"] = sliding_window(cfg)
    features["max_model_len"] = cfg.get("max_position_embeddings", 2048)
    return features
