"""Offline quantization producers: the methods that turn a float model into a quantized checkpoint's tensors, run
by `tandem quantize` and `tandem eval-quant` (tools/quantize.py, tools/eval_quant.py), never by a server.

    quantize_model(model, method, bits, group_size, calib_token_ids, layer_formats) -> canonical state dict
    calibration.py   calibration batches and replaying decoder layers on captured inputs
    gptq.py          GPTQ (Frantar et al. 2022)
    awq.py           AWQ (Lin et al. 2023)
    outliers.py      outlier-aware INT8 (LLM.int8()'s decomposition) from calibration activations
    sensitivity.py   per-linear sensitivity (KL) and mixed-precision layer maps under a byte or KL budget

The formats they produce, the checkpoint I/O and the layers that run them are tandem.shared.quant (serving).
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.shared.quant import QuantConfig, float_tensors, quantizable_linears
from tandem.shared.quant.config import parse_linear_format


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
        method: "rtn", "gptq", "awq" or "llmint8" (outlier-aware INT8, tools/quant/outliers.py).
        bits: 8 (per output channel; group_size None) or 4 (group_size 32, 64 or 128).
        calib_token_ids: 1-D token ids for GPTQ/AWQ/llmint8 (at least seq_len of them, default seq_len 512).
        layer_formats: mixed precision (rtn, gptq): canonical linear name -> "float", "int8" or "int4-gG" for
            the linears that leave the (bits, group_size) format; a "float" one is stored as "<name>.weight".
        options: passed to gptq_quantize_model (seq_len, percdamp, act_order), awq_quantize_model
            (seq_len, n_grid, max_search_tokens; defaults 512, 20, 256) or llmint8_quantize_model (threshold,
            max_fraction, seq_len).
    Returns:
        "model.layers.{i}.<proj>.qweight|scales|zeros" for every linear (and "<proj>.bias" for one with a bias),
        plus every other float tensor of the model's state dict (embeddings, norms) except a tied lm_head.
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
        from tandem.tools.quant.gptq import gptq_quantize_model

        state = gptq_quantize_model(model, calib_token_ids, formats, **options)
    elif method == "awq":
        from tandem.tools.quant.awq import awq_quantize_model

        state = awq_quantize_model(model, calib_token_ids, bits, group_size, **options)
    elif method == "llmint8":
        from tandem.tools.quant.outliers import llmint8_quantize_model

        state = llmint8_quantize_model(model, calib_token_ids, **options)
    else:
        from tandem.shared.quant.rtn import rtn_tensors

        state = {}
        for name, linear in linears.items():
            fmt_bits, fmt_group = formats[name]
            tensors = ({"weight": linear.weight.detach().clone()} if fmt_bits is None
                       else rtn_tensors(linear.weight, fmt_bits, fmt_group))
            state.update({f"{name}.{k}": v for k, v in tensors.items()})
    # a linear's bias (Qwen2's q/k/v) stays float beside its codes, under the linear's name
    biases = {f"{name}.bias": linear.bias.detach().clone() for name, linear in linears.items()
              if linear.bias is not None}
    return state | biases | float_tensors(model)
