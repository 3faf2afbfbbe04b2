"""Outlier-aware INT8 ("llmint8"): LLM.int8()'s mixed-precision decomposition, applied to the stored weights.

Dettmers, Lewis, Belkada, Zettlemoyer, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale"
(2022), section 3.2: a few input channels (hidden dimensions) carry activations far larger than the rest
(|x| >= 6 in their experiments); uniform INT8 wrecks them, so the matmul is split: those channels run in 16-bit,
the rest in INT8. Here activations stay float (weight-only quantization), so what hurts is the weight error in
those channels, multiplied by their large activations: output error sum_k e_nk x_k is dominated by the outlier
k. Keeping W[:, O] in float removes the dominant terms, and per-channel scales computed without those columns
get finer when they held the row's largest weights. O is fixed from calibration activations (the paper picks it
per batch at run time, which would need the float weight at run time; a static O is what makes it a format).

Why this and not SmoothQuant's scale migration (Xiao et al. 2022): SmoothQuant moves activation range into the
weights so that activations can be INT8 too (W8A8); with float activations it only makes the weights harder to
quantize. AWQ (awq.py) is the weight-only form of scale migration and is already a method here.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tandem.tools.quant.calibration import INPUT_OWNERS, calibration_batch, decoder_layers, input_owner, layer_linears
from tandem.shared.quant.rtn import quantize_int8

DEFAULT_THRESHOLD = 6.0  # LLM.int8()'s outlier threshold on |activation|
DEFAULT_MAX_FRACTION = 0.02  # at most this share of a linear's input channels stays float


@torch.no_grad()
def activation_absmax(model: nn.Module, calib_token_ids, seq_len: int = 512) -> dict[str, torch.Tensor]:
    """max |x_k| over all calibration tokens of each decoder-layer linear's input, per input channel k.

    Args:
        model: HF-named float model (LlamaForCausalLM).
        calib_token_ids: 1-D token ids, cut into rows of seq_len (calibration.calibration_batch's rules).
    Returns:
        canonical input-owner name ("model.layers.{i}.self_attn.q_proj", o_proj, mlp.gate_proj, mlp.down_proj)
        -> float32 [K]. k/v_proj read q_proj's input and up_proj gate_proj's (calibration.input_owner).
    """
    absmax, handles = {}, []
    for i, layer in enumerate(decoder_layers(model)):
        for suffix in INPUT_OWNERS:
            name = f"model.layers.{i}.{suffix}"

            def hook(_module, args, name=name):
                amax = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                absmax[name] = amax if name not in absmax else torch.maximum(absmax[name], amax)
            handles.append(layer.get_submodule(suffix).register_forward_pre_hook(hook))
    try:
        for row in calibration_batch(calib_token_ids, seq_len):
            model(input_ids=row[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return absmax


def outlier_channels(absmax: torch.Tensor, threshold: float = DEFAULT_THRESHOLD,
                     max_fraction: float = DEFAULT_MAX_FRACTION) -> torch.Tensor:
    """Input channels whose calibration |activation| reaches threshold, the largest first when more than
    max_fraction * K do (the cap bounds the float part's bytes). Returns sorted int64 indices [num_outliers].
    Raises ValueError for a threshold <= 0 or a max_fraction outside [0, 1]."""
    check_outlier_options(threshold, max_fraction)
    idx = (absmax >= threshold).nonzero().flatten()
    limit = int(max_fraction * absmax.numel())
    if idx.numel() > limit:
        idx = absmax.topk(limit).indices
    return idx.sort().values


def check_outlier_options(threshold: float, max_fraction: float) -> None:
    """ValueError unless 0 < threshold < inf and 0 <= max_fraction <= 1."""
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"outlier threshold must be a finite number > 0, got {threshold}")
    if not 0 <= max_fraction <= 1:
        raise ValueError(f"outlier max fraction must be in [0, 1], got {max_fraction}")


def outlier_int8_tensors(w: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """One weight [N, K] -> canonical tensors of an outlier-aware INT8 layer: qweight int8 [N, K] (zero in idx's
    columns), scales [N] (per output channel, over the other columns), outlier_idx int64 [n], outlier_weight
    [N, n] (w's columns idx, exact)."""
    inliers = w.detach().clone()
    inliers[:, idx] = 0
    qweight, scales = quantize_int8(inliers)
    return {"qweight": qweight, "scales": scales, "outlier_idx": idx.to(torch.long).clone(),
            "outlier_weight": w.detach()[:, idx].clone()}


@torch.no_grad()
def llmint8_quantize_model(model: nn.Module, calib_token_ids, threshold: float = DEFAULT_THRESHOLD,
                           max_fraction: float = DEFAULT_MAX_FRACTION, seq_len: int = 512) -> dict[str, torch.Tensor]:
    """Outlier-aware INT8 for every decoder-layer linear; the model is left unchanged.

    Returns:
        canonical tensors "model.layers.{i}.<suffix>.qweight|scales|outlier_idx|outlier_weight". Linears that
        read one input (q/k/v, gate/up) share its outlier channels, so their fused layer stays one matmul.
    """
    check_outlier_options(threshold, max_fraction)  # before minutes of calibration
    channels = {name: outlier_channels(amax, threshold, max_fraction)
                for name, amax in activation_absmax(model, calib_token_ids, seq_len).items()}
    state = {}
    for i, layer in enumerate(decoder_layers(model)):
        for suffix, linear in layer_linears(layer).items():
            idx = channels[f"model.layers.{i}.{input_owner(suffix)}"]
            tensors = outlier_int8_tensors(linear.weight, idx)
            state.update({f"model.layers.{i}.{suffix}.{k}": v for k, v in tensors.items()})
    return state
