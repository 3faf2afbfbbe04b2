"""The architectures the engine serves: one entry per HF `model_type`, each reading the features its family uses
from config.json (the same checkpoint layout and module names as HF's modeling code, so the weights load by
name into shared/model.py's layers).

| model_type | family | what differs from Llama |
|---|---|---|
| llama | Llama 2, Llama 3.x, SmolLM | rope scaling (`llama3`, `linear`, `yarn`: shared/rope.py) |
| mistral | Mistral | a sliding window (see below) |
| qwen2 | Qwen2, Qwen2.5 | bias on q/k/v (`attention_bias` implied); optional sliding window |
| qwen3 | Qwen3 | RMSNorm over each query and key head before RoPE; head_dim set apart from hidden/heads |
| phi3 | Phi-3 | q/k/v stored as one `qkv_proj`, gate/up as one `gate_up_proj` (split on load, shared/model.py) |

Sliding windows: attention limited to the last `sliding_window` positions is not in the kernels yet. A sequence
no longer than the window attends to the same tokens either way, so a checkpoint with a window is served with
max_model_len capped at the window (logged), never with full attention past it. Anything else this module does
not know (another model_type, `hidden_act` other than SiLU, `mlp_bias`, a rope type shared/rope.py refuses) is
refused at start with the field named and the supported values.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# shared/rope.py computes each. `dynamic` NTK scaling changes the frequencies with each batch's longest sequence, so
# a request's tokens would depend on its neighbours: refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(cfg: dict) -> dict:
    """The rope settings of an HF config.json dict: rope_theta, rope_type and that type's numbers. ValueError
    naming the field when the type is not one of ROPE_TYPES."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
                         + (" (dynamic NTK scaling makes a request's tokens depend on the batch)"
                            if rope_type == "dynamic" else ""))
    params["rope_type"] = rope_type
    params.pop("type", None)
    if rope_type in ("llama3", "yarn"):  # (as transformers' standardize_rope_params fills them in)
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings")
                          or cfg.get("max_position_embeddings", 2048))
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = cfg.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported; supported: [1.0]")
    return params


def _llama(cfg: dict) -> dict:
    return {"attention_bias": bool(cfg.get("attention_bias", False))}


def _qwen2(cfg: dict) -> dict:
    return {"attention_bias": True}


def _qwen3(cfg: dict) -> dict:
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "qk_norm": True}


# the features beyond Llama's fields, as a Llama has them (ModelConfig's defaults)
LLAMA_FEATURES = {"model_type": "llama", "attention_bias": False, "qk_norm": False}

# model_type -> features read from its config.json beyond the Llama fields ModelConfig.from_dir reads
ARCHITECTURES = {"llama": _llama, "mistral": _llama, "phi3": _llama, "qwen2": _qwen2, "qwen3": _qwen3}


def sliding_window(cfg: dict) -> int | None:
    """The window every layer attends within, or None (full attention). Qwen2/3 use theirs only with
    use_sliding_window; ValueError when only some layers slide (max_window_layers, layer_types), which needs
    per-layer windows."""
    window = cfg.get("sliding_window")
    if window is None or (cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window")):
        return None
    layer_types = cfg.get("layer_types") or []
    if any(t != "sliding_attention" for t in layer_types) and layer_types:
        raise ValueError(f"layer_types {sorted(set(layer_types))}: a window on some layers only is not supported")
    return int(window)


def architecture_features(cfg: dict) -> dict:
    """The architecture fields of ModelConfig beyond Llama's, from an HF config.json dict: model_type,
    attention_bias, qk_norm, rope (rope_parameters' items), and max_model_len capped at a sliding window.
    ValueError naming the field when the checkpoint needs something the engine does not do."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for {model_type}; supported: ['silu']")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias true is not supported (no bias on the MLP projections)")
    features = LLAMA_FEATURES | {"model_type": model_type} | ARCHITECTURES[model_type](cfg)
    rope = rope_parameters(cfg)
    features["rope"] = tuple(sorted((k, v) for k, v in rope.items() if v is not None))
    max_len = cfg.get("max_position_embeddings", 2048)
    window = sliding_window(cfg)
    if window is not None and window < max_len:
        log.warning("%s: sliding_window %d is not implemented in the kernels; serving at most %d tokens per "
                    "sequence (within the window, attention is the same)", model_type, window, window)
        max_len = window
    features["max_model_len"] = max_len
    return features
