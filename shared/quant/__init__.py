"""Weight-only quantization: INT8 per channel and INT4 per group (RTN, GPTQ, AWQ), quantized checkpoints
(tandem, HF AWQ, HF GPTQ, GGUF Q4_0/Q4_1/Q8_0) and the layers that run them.

Public API:
    QuantConfig                         frozen config; .weight_format -> "fp32", "int8", "int4-g128-gptq", ...
    quantize_model(model, method, bits, group_size, calib_token_ids) -> canonical state dict
    apply_quantized_state(model, state) swap nn.Linear -> WeightOnlyInt{8,4}Linear in place
    apply_quantization(model, source)   same, reading a quantized checkpoint dir or .gguf file -> QuantConfig
    save_quantized / load_quantized_state / detect_quant_config   checkpoint I/O (checkpoint.py)
    WeightOnlyInt8Linear, WeightOnlyInt4Linear
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared.quant.checkpoint import detect_quant_config, load_quantized_state, save_quantized
from shared.quant.config import QuantConfig
from shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from shared.quant.modules import (apply_quantized_state, float_tensor_names, quantizable_linears,
                                  weight_bytes)

__all__ = ["QuantConfig", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "apply_quantization",
           "apply_quantized_state", "detect_quant_config", "load_quantized_state", "quantize_model",
           "save_quantized", "weight_bytes"]


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, bits: int, group_size: int | None = None,
                   calib_token_ids=None, **options) -> dict[str, torch.Tensor]:
    """Quantize a float model's attention/MLP linears; return the complete canonical state dict.

    Args:
        model: float model with HF Llama names (HF LlamaForCausalLM for GPTQ/AWQ, which replay decoder layers).
            GPTQ overwrites linear weights with their dequantized values, AWQ folds its scales into norms and
            linears; RTN leaves the model unchanged. The model keeps nn.Linear modules: call
            apply_quantized_state(model, state) to swap in the quantized layers.
        method: "rtn", "gptq" or "awq".
        bits: 8 (per output channel; group_size None) or 4 (group_size 32, 64 or 128).
        calib_token_ids: 1-D token ids for GPTQ/AWQ (at least seq_len of them, default seq_len 512).
        options: passed to gptq_quantize_model (seq_len, percdamp, act_order) or awq_quantize_model
            (seq_len, n_grid, max_search_tokens; defaults 512, 20, 256).
    Returns:
        "model.layers.{i}.<proj>.qweight|scales|zeros" for every linear, plus every other float tensor of the
        model's state dict (embeddings, norms) except a tied lm_head.
    Raises:
        ValueError: unknown method, bad bits/group_size, or GPTQ/AWQ without calibration tokens.
    """
    QuantConfig(bits=bits, group_size=group_size, method=method)  # validates
    if method == "gguf":
        raise ValueError("GGUF checkpoints are loaded (apply_quantization), not produced")
    if method in ("gptq", "awq") and calib_token_ids is None:
        raise ValueError(f"{method} needs calib_token_ids")
    if method == "gptq":
        from shared.quant.gptq import gptq_quantize_model

        state = gptq_quantize_model(model, calib_token_ids, bits, group_size, **options)
    elif method == "awq":
        from shared.quant.awq import awq_quantize_model

        state = awq_quantize_model(model, calib_token_ids, bits, group_size, **options)
    else:
        from shared.quant.rtn import rtn_tensors

        state = {}
        for name, linear in quantizable_linears(model).items():
            state.update({f"{name}.{k}": v for k, v in rtn_tensors(linear.weight, bits, group_size).items()})
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
    # A directory's quantization_config names its format, so its tensors must agree. A GGUF file may mix types
    # per tensor (its config names the most common one), and that is read from the tensors themselves.
    for name, layer in quantizable_linears(model).items() if config.method != "gguf" else ():
        bits = 8 if isinstance(layer, WeightOnlyInt8Linear) else 4
        if (bits, layer.group_size) != (config.bits, config.group_size):
            raise ValueError(f"{source}: its quantization_config says {config.weight_format}, but {name} holds "
                             f"int{bits} weights with group_size {layer.group_size}")
    return config
