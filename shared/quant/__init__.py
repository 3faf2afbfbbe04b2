"""Weight-only quantization at serving time: the formats (INT8 per channel, INT4 per group, outlier-aware INT8,
mixed precision by layer), quantized checkpoints (tandem, HF AWQ, HF GPTQ, GGUF Q4_0/Q4_1/Q8_0) and the layers that run them.

Public API:
    QuantConfig                         frozen config; .weight_format -> "fp32", "int8", "int4-g128-gptq", ...
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
from tandem.shared.quant.config import QuantConfig
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from tandem.shared.quant.modules import (apply_quantized_state, float_tensor_names, quantizable_linears,
                                  weight_bytes)

__all__ = ["QuantConfig", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "apply_quantization",
           "apply_quantized_state", "detect_quant_config", "load_quantized_state",
           "save_quantized", "weight_bytes"]


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
        ValueError: unsupported or unquantized checkpoint, one that does not fit the model (a GGUF of another
            architecture or head layout) or is incomplete, or one whose tensors disagree with its
            quantization_config.
    """
    if Path(source).suffix == ".gguf" and hasattr(getattr(model, "config", None), "model_type"):
        from tandem.shared.quant.gguf_loader import check_gguf_fits

        check_gguf_fits(source, model.config)  # (a GGUF names its architecture; the model's comes from its config)
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
