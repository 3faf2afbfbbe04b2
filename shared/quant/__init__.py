"""Weight-only quantization: INT8 per channel and INT4 per group (RTN, GPTQ, AWQ), outlier-aware INT8
(LLM.int8()'s decomposition, outliers.py), mixed precision by layer sensitivity (sensitivity.py), quantized
checkpoints (tandem, HF AWQ, HF GPTQ, GGUF Q4_0/Q4_1/Q8_0) and the layers that run them.

Public API:
    QuantConfig                         frozen config; .weight_format -> "fp32", "int8", "int4-g128-gptq", ...
    quantize_model(model, method, bits, group_size, calib_token_ids, layer_formats) -> canonical state dict
    apply_quantized_state(model, state) swap nn.Linear -> WeightOnlyInt{8,4}Linear in place
    apply_quantization(model, source)   same, reading a quantized checkpoint dir or .gguf file -> QuantConfig
    save_quantized / load_quantized_state / detect_quant_config   checkpoint I/O (checkpoint.py)
    WeightOnlyInt8Linear, WeightOnlyInt4Linear
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.shared.quant.checkpoint import detect_quant_config, load_quantized_state, save_quantized
from tandem.shared.quant.config import QuantConfig, parse_linear_format
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from tandem.shared.quant.modules import (apply_quantized_state, float_tensor_names, quantizable_linears,
                                  weight_bytes)

__all__ = ["QuantConfig", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "apply_quantization",
           "apply_quantized_state", "detect_quant_config", "load_quantized_state", "quantize_model",
           "save_quantized", "weight_bytes"]


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, bits: int, group_size: int | None = None,
                   calib_token_ids=None, layer_formats: dict[str, str] | None = None,
                   **options) -> dict[str, torch.Tensor]:
    """Quantize a float model's attention/MLP linears; return the complete canonical state dict.

    Args:
        model: float model with HF Llama names (HF LlamaForCausalLM for GPTQ/AWQ, which replay decoder layers).
            GPTQ overwrites linear weights with their dequantized values, AWQ folds its scales into norms and
            linears; RTN and llmint8 leave the model unchanged. The model keeps nn.Linear modules: call
            apply_quantized_state(model, state) to swap in the quantized layers.
        method: "rtn", "gptq", "awq" or "llmint8" (outlier-aware INT8, outliers.py).
        bits: 8 (per output channel; group_size None) or 4 (group_size 32, 64 or 128).
        calib_token_ids: 1-D token ids for GPTQ/AWQ/llmint8 (at least seq_len of them, default seq_len 512).
        layer_formats: mixed precision (rtn, gptq): canonical linear name -> "float", "int8" or "int4-gG" for
            the linears that leave the (bits, group_size) format; a "float" one is stored as "<name>.weight".
        options: passed to gptq_quantize_model (seq_len, percdamp, act_order), awq_quantize_model
            (seq_len, n_grid, max_search_tokens; defaults 512, 20, 256) or llmint8_quantize_model (threshold,
            max_fraction, seq_len).
    Returns:
        "model.layers.{i}.<proj>.qweight|scales|zeros" for every linear, plus every other float tensor of the
        model's state dict (embeddings, norms) except a tied lm_head.
    Raises:
        ValueError: unknown method, bad bits/group_size, a layer format or name that does not exist, or
            GPTQ/AWQ/llmint8 without calibration tokens.
    """
    layer_formats = dict(layer_formats or {})
    QuantConfig(bits=bits, group_size=group_size, method=method,
                layer_formats=tuple(sorted(layer_formats.items())))  # validates
    if method == "gguf":
        raise ValueError("GGUF checkpoints are loaded (apply_quantization), not produced")
    if method in ("gptq", "awq", "llmint8") and calib_token_ids is None:
        raise ValueError(f"{method} needs calib_token_ids")
    linears = quantizable_linears(model)
    unknown = sorted(set(layer_formats) - set(linears))
    if unknown:
        raise ValueError(f"layer_formats names {len(unknown)} linears the model lacks, e.g. {unknown[0]}")
    # name -> (bits, group_size), bits None for a linear kept in float
    formats = {name: parse_linear_format(layer_formats[name]) if name in layer_formats else (bits, group_size)
               for name in linears}
    if method == "gptq":
        from tandem.shared.quant.gptq import gptq_quantize_model

        state = gptq_quantize_model(model, calib_token_ids, formats, **options)
    elif method == "awq":
        from tandem.shared.quant.awq import awq_quantize_model

        state = awq_quantize_model(model, calib_token_ids, bits, group_size, **options)
    elif method == "llmint8":
        from tandem.shared.quant.outliers import llmint8_quantize_model

        state = llmint8_quantize_model(model, calib_token_ids, **options)
    else:
        from tandem.shared.quant.rtn import rtn_tensors

        state = {}
        for name, linear in linears.items():
            fmt_bits, fmt_group = formats[name]
            tensors = ({"weight": linear.weight.detach().clone()} if fmt_bits is None
                       else rtn_tensors(linear.weight, fmt_bits, fmt_group))
            state.update({f"{name}.{k}": v for k, v in tensors.items()})
    return state | float_tensors(model)


def float_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict minus the quantizable linears and tied duplicates (lm_head), copied."""
    state = model.state_dict()
    return {key: state[key].detach().clone() for key in float_tensor_names(model)}


def apply_quantization(model: nn.Module, source: str | Path) -> QuantConfig:
    """Swap the model's linears for the quantized layers of a checkpoint, in place.

    Args:
        model: HF-named model (weights may be the float ones or uninitialised; every tensor in the checkpoint
            is copied in, so a tandem checkpoint fully defines the weights).
        source: tandem / HF AWQ / HF GPTQ checkpoint directory, or a .gguf file.
    Returns:
        the checkpoint's QuantConfig.
    Raises:
        ValueError: unsupported or unquantized checkpoint, one that does not fit the model or is incomplete, or
            one whose tensors disagree with its quantization_config.
    """
    state, config = load_quantized_state(source)
    apply_quantized_state(model, state)
    # A directory's quantization_config names its format (per linear for a mixed one), so its tensors must
    # agree. A GGUF file may mix types per tensor (its config names the most common one), and that is read from
    # the tensors themselves.
    linears = quantizable_linears(model)
    unknown = [name for name, _ in config.layer_formats if name not in linears]
    if unknown:
        raise ValueError(f"{source}: its layer_formats name {unknown[0]}, which the model does not have")
    for name, layer in linears.items() if config.method != "gguf" else ():
        if linear_format(layer) != config.linear_format(name):
            raise ValueError(f"{source}: its quantization_config says {name} is {config.linear_format(name)}, "
                             f"but it holds {linear_format(layer)} weights")
        if (getattr(layer, "outlier_idx", None) is not None) != (config.method == "llmint8"):
            raise ValueError(f"{source}: {name} " + ("lacks the outlier columns its method llmint8 needs"
                                                     if config.method == "llmint8" else
                                                     f"has outlier columns, which method {config.method} never writes"))
    return config


def linear_format(layer: nn.Module) -> str:
    """"float", "int8", "int8-gG" or "int4-gG": the format a (quantized) linear layer holds."""
    if isinstance(layer, WeightOnlyInt8Linear):
        return "int8" if layer.group_size is None else f"int8-g{layer.group_size}"
    if isinstance(layer, WeightOnlyInt4Linear):
        return f"int4-g{layer.group_size}"
    return "float"
