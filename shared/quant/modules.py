"""Find the quantizable linears of a Llama-family module tree and swap them for quantized layers in place.

Works on any nn.Module tree that keeps HF names: ``...layers.{i}.self_attn.{q,k,v,o}_proj`` and
``...layers.{i}.mlp.{gate,up,down}_proj`` (HF LlamaForCausalLM and the engine's model). Embeddings, norms and
the (tied) lm_head stay in float, except an lm_head a checkpoint quantizes (GGUF Q8_0: lm_head.qweight).
Quantized state dicts use the canonical names ``model.layers.{i}.<suffix>`` followed by ``.qweight`` /
``.scales`` / ``.zeros`` (``.outlier_idx`` / ``.outlier_weight`` for LLM.int8() layers); a linear a
mixed-precision checkpoint keeps in float has ``.weight`` instead; a linear's bias is ``.bias`` (float), and
every other key is a float tensor copied by name. Checkpoints that store a layer's q/k/v or gate/up as one
linear (Phi-3's HF AWQ/GPTQ and GGUF files: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``) use those names, and
apply_quantized_state splits their rows into the model's projections.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear

LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QUANT_TENSOR_NAMES = ("qweight", "scales", "zeros", "outlier_idx", "outlier_weight")
_LINEAR_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(s) for s in LINEAR_SUFFIXES) + r")$")
# a fused linear -> the projections its rows hold, in order (as HF's Phi3Attention and Phi3MLP slice them)
FUSED_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_FUSED_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(s) for s in FUSED_LINEARS) + r")$")

QuantLinear = WeightOnlyInt8Linear | WeightOnlyInt4Linear


def canonical_name(module_name: str) -> str | None:
    """"model.model.layers.3.mlp.up_proj" -> "model.layers.3.mlp.up_proj"; None for a non-quantizable name."""
    match = _LINEAR_RE.search(module_name)
    return None if match is None else f"model.layers.{match.group(1)}.{match.group(2)}"


def canonical_fused_name(name: str) -> str | None:
    """"model.layers.3.self_attn.qkv_proj" -> the same, canonical; None unless name is a FUSED_LINEARS linear."""
    match = _FUSED_RE.search(name)
    return None if match is None else f"model.layers.{match.group(1)}.{match.group(2)}"


def split_fused_linears(state: dict[str, torch.Tensor], linears: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """A state dict whose fused linears ("model.layers.{i}.self_attn.qkv_proj.<tensor>", "mlp.gate_up_proj")
    become the model's own projections: each row-wise tensor (qweight, scales, zeros, bias, outlier_weight, a
    float weight) split into the parts' out_features rows (q, k, v; gate, up), outlier_idx shared. Other keys pass
    through; a state without fused names is returned as is.

    Args:
        linears: the model's quantizable linears (canonical name -> module), which give each part's row count.
    Raises:
        ValueError: the model lacks a part, or the fused rows are not the parts' rows together.
    """
    fused = {key: _FUSED_RE.search(key.rpartition(".")[0]) for key in state}
    fused = {key: match for key, match in fused.items() if match is not None}
    if not fused:
        return state
    out = {key: tensor for key, tensor in state.items() if key not in fused}
    for key, match in fused.items():
        kind = key.rpartition(".")[2]
        parts = [f"model.layers.{match.group(1)}.{part}" for part in FUSED_LINEARS[match.group(2)]]
        if any(part not in linears for part in parts):
            raise ValueError(f"checkpoint tensor {key!r} is fused, but the model has no {parts[0]}")
        sizes = [linears[part].out_features for part in parts]
        tensor = state[key]
        if kind == "outlier_idx":  # the input channels kept in float: one set for all parts
            out.update({f"{part}.{kind}": tensor for part in parts})
            continue
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {key!r} has {tensor.shape[0]} rows; the model's "
                             f"{[p.rpartition('.')[2] for p in parts]} have {sizes}")
        out.update({f"{part}.{kind}": t.contiguous() for part, t in zip(parts, tensor.split(sizes))})
    return out


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical name -> module (nn.Linear or an already quantized layer), in model order."""
    found = {}
    for name, module in model.named_modules():
        canon = canonical_name(name)
        if canon is not None and isinstance(module, (nn.Linear, WeightOnlyInt8Linear, WeightOnlyInt4Linear)):
            found[canon] = module
    return found


def _set_module(model: nn.Module, canon: str, new: nn.Module) -> None:
    for name, module in model.named_modules():
        if canonical_name(name) == canon:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            return
    raise KeyError(canon)


def make_quant_layer(linear: nn.Module, tensors: dict[str, torch.Tensor]) -> QuantLinear:
    """Build the quantized layer for one linear from its canonical tensors; the kind and group size come from
    the tensor shapes and dtypes (int8 qweight -> INT8, uint8 -> INT4). Raises ValueError on a mismatch."""
    qweight, scales = tensors["qweight"], tensors["scales"]
    n, k = linear.out_features, linear.in_features
    bias = getattr(linear, "bias", None)
    dtype = _float_dtype(linear)
    if qweight.dtype == torch.int8:
        if scales.dim() not in (1, 2) or (scales.dim() == 2 and (scales.shape[1] == 0 or k % scales.shape[1])):
            raise ValueError(f"int8 scales must be [N] or [N, groups] with groups dividing {k}, got "
                             f"{tuple(scales.shape)}")
        group_size = None if scales.dim() == 1 else k // scales.shape[1]
        layer = WeightOnlyInt8Linear(k, n, group_size, bias=bias is not None, dtype=dtype)
        layer.load_quantized(qweight, scales, bias, tensors.get("outlier_idx"), tensors.get("outlier_weight"))
    elif qweight.dtype == torch.uint8:
        if scales.dim() != 2 or scales.shape[1] == 0:
            raise ValueError(f"int4 scales must be [N, groups], got {tuple(scales.shape)}")
        if "zeros" not in tensors:
            raise ValueError(f"int4 tensors lack zeros (scales {tuple(scales.shape)})")
        group_size = 2 * qweight.shape[1] // scales.shape[1]
        layer = WeightOnlyInt4Linear(k, n, group_size, bias=bias is not None, dtype=dtype)
        layer.load_quantized(qweight, scales, tensors["zeros"], bias)
    else:
        raise ValueError(f"qweight must be int8 or uint8, got {qweight.dtype}")
    return layer.to(device=_device(linear))


def apply_quantized_state(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Swap every quantizable linear for its quantized layer from ``state`` and copy the remaining float
    tensors (norms, embeddings; AWQ changes norms) onto the model's parameters/buffers of the same name.

    Args:
        model: module tree with HF names; modified in place and returned.
        state: canonical state dict (see module docstring), as quantize_model or load_quantized_state return;
            a linear with "<name>.weight" and no "<name>.qweight" stays nn.Linear (mixed precision). Fused
            linears (qkv_proj, gate_up_proj) are split into the model's projections (split_fused_linears).
            NOTE: it must be complete (every float tensor of the model but a tied lm_head), as every supported
            checkpoint format is; a partial one would leave randomly initialised weights behind.
    Raises:
        ValueError: a linear without quantized tensors, a missing float tensor, a tensor the model has no place
            for, a shape mismatch, or a NaN/inf value.
    """
    linears = quantizable_linears(model)
    state = split_fused_linears(state, linears)
    float_linears = {name for name in linears if f"{name}.qweight" not in state and f"{name}.weight" in state}
    missing = [name for name in linears if f"{name}.qweight" not in state and name not in float_linears]
    if missing:
        raise ValueError(f"quantized checkpoint lacks {len(missing)} linear layers, e.g. {missing[0]}")
    quantized_head = "lm_head.qweight" in state  # (then lm_head.weight is not needed)
    missing = [key for key in float_tensor_names(model) if key not in state
               and not (quantized_head and key == "lm_head.weight")]
    missing += [f"{name}.bias" for name, linear in linears.items()
                if getattr(linear, "bias", None) is not None and f"{name}.bias" not in state]
    if missing:
        raise ValueError(f"quantized checkpoint lacks {len(missing)} float tensors, e.g. {missing[0]}")
    bad = first_non_finite(state)
    if bad is not None:
        raise ValueError(f"quantized checkpoint tensor {bad!r} holds NaN or inf")
    for name, linear in linears.items():
        if name in float_linears:  # copied below with the other float tensors
            if not isinstance(linear, nn.Linear) or not state[f"{name}.weight"].is_floating_point():
                raise ValueError(f"{name}: a linear kept in float needs a float weight and an nn.Linear to hold it")
            continue
        tensors = {t: state[f"{name}.{t}"] for t in QUANT_TENSOR_NAMES if f"{name}.{t}" in state}
        try:
            layer = make_quant_layer(linear, tensors)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        _set_module(model, name, layer)
    quant_keys = {f"{name}.{t}" for name in linears for t in QUANT_TENSOR_NAMES}
    if "lm_head.qweight" in state and isinstance(getattr(model, "lm_head", None), nn.Linear):
        # A quantized output projection (GGUF Q8_0): it no longer shares the embedding's float tensor.
        tensors = {t: state[f"lm_head.{t}"] for t in QUANT_TENSOR_NAMES if f"lm_head.{t}" in state}
        model.lm_head = make_quant_layer(model.lm_head, tensors)
        quant_keys |= {f"lm_head.{t}" for t in tensors}
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    with torch.no_grad():
        for key, value in state.items():
            if key in quant_keys:
                continue
            if key not in targets:
                raise ValueError(f"quantized checkpoint tensor {key!r} matches nothing in the model")
            if tuple(targets[key].shape) != tuple(value.shape):
                raise ValueError(f"{key}: model shape {tuple(targets[key].shape)}, checkpoint {tuple(value.shape)}")
            targets[key].copy_(value)
    return model


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """Name of the first float tensor holding a NaN or inf, or None."""
    return next((name for name, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()), None)


def float_tensor_names(model: nn.Module) -> list[str]:
    """State-dict names of the model's tensors outside the quantizable linears, each storage once (a tied lm_head
    is left out): what a quantized checkpoint carries in float."""
    skip = {id(t) for m in quantizable_linears(model).values() for t in list(m.parameters()) + list(m.buffers())}
    names = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in skip:
            skip.add(id(tensor))
            names.append(key)
    return names


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (tied embeddings count once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _float_dtype(module: nn.Module) -> torch.dtype:
    ref = module.weight if isinstance(module, nn.Linear) else module.scales
    return ref.dtype


def _device(module: nn.Module) -> torch.device:
    ref = module.weight if isinstance(module, nn.Linear) else module.qweight
    return ref.device
