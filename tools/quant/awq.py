"""AWQ: activation-aware weight quantization by per-input-channel scaling, then round-to-nearest.

Lin, Tang, Tang, Yang, Dang, Gan, Han, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration" (2023), section 3.2. For linears sharing an input X [T, K], scaling input channel c by s_c
(W[:, c] *= s_c, X[:, c] /= s_c) leaves the float function unchanged but shrinks the relative rounding error of
salient channels. s = mean|X|^alpha (normalised), with alpha searched on a grid in [0, 1] to minimise
||Q(W diag(s)) (X / s) - W X||^2 over the group's outputs (alpha = 0 is plain RTN, so the search never does
worse than RTN on the searched calibration tokens). 1 / s is folded into the op that produces X:

    q/k/v_proj   <- input_layernorm.weight            gate/up_proj <- post_attention_layernorm.weight
    o_proj       <- v_proj rows and bias (GQA: one scale per kv-head channel, shared by the query heads using it)
    down_proj    <- up_proj rows

(Gemma: gate/up read pre_feedforward_layernorm, and its norms scale by 1 + weight, so 1 + weight is divided.)

Simplification: the loss is measured on the scaled linears' own outputs, not on the whole attention / MLP
block as llm-awq does, and there is no weight-clipping search.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from tandem.tools.quant.calibration import (calibration_batch, capture_first_layer_inputs, decoder_layers,
                                      layer_linears, record_inputs, run_layer)
from tandem.shared.quant.rtn import fake_quantize, rtn_tensors


@torch.no_grad()
def search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int | None,
                  n_grid: int = 20, tie: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Best per-input-channel scales for linears sharing the input x.

    Args:
        x: [T, K] float32 calibration inputs.
        weights: the group's [N_i, K] weights.
        n_grid: alpha takes the n_grid + 1 values 0, 1/n_grid, ..., 1.
        tie: (num_kv_heads, num_rep, head_dim) to share one scale across the query heads that read the same
            kv head (o_proj under GQA); the mean |x| is averaged over those heads.
    Returns:
        s [K] float32 (all ones if alpha = 0 wins).
    """
    W = torch.cat([w.float() for w in weights], dim=0)  # [N_total, K]
    x_mean = x.abs().mean(dim=0)  # [K]
    if tie is not None:
        num_kv, num_rep, head_dim = tie
        x_mean = x_mean.view(num_kv, num_rep, head_dim).mean(1, keepdim=True).expand(-1, num_rep, -1).reshape(-1)
    # ||x E^T||^2 for E = Wq - W, computed through the Gram matrix x^T x when that is cheaper (T > K).
    gram = x.T @ x if x.shape[0] > x.shape[1] else None
    best_loss, best_s = float("inf"), torch.ones_like(x_mean)
    for step in range(n_grid + 1):
        s = x_mean.pow(step / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = fake_quantize(W * s, bits, group_size) / s - W  # [N_total, K]
        loss = ((err @ gram) * err).sum().item() if gram is not None else (x @ err.T).pow(2).sum().item()
        if loss < best_loss:
            best_loss, best_s = loss, s
    return best_s


def fold_into_norm(norm: torch.nn.Module, s: torch.Tensor, unit_offset: bool = False) -> None:
    """Divide an RMSNorm's output channels by s [K] in place: its weight / s, or for Gemma's norms, which scale by
    (1 + weight), weight -> (1 + weight) / s - 1."""
    if unit_offset:
        norm.weight.copy_((norm.weight.float() + 1.0).div_(s).sub_(1.0))
    else:
        norm.weight.div_(s)


@torch.no_grad()
def apply_layer_scales(layer: torch.nn.Module, x: dict[str, torch.Tensor], bits: int, group_size: int | None,
                       head_dim: int, n_grid: int = 20, unit_offset: bool = False) -> None:
    """Search and fold the four AWQ scale groups of one Llama-family decoder layer (in place; float function
    kept). The MLP's input norm is pre_feedforward_layernorm where the layer has one (Gemma, whose
    post_attention_layernorm norms the attention output), else post_attention_layernorm; unit_offset: the norms
    scale by (1 + weight) (Gemma). A v_proj bias (Qwen2) is divided with its rows.

    x: recorded inputs [T, K] of "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj".
    """
    lin = layer_linears(layer)
    q, k, v, o = (lin[f"self_attn.{p}_proj"] for p in "qkvo")
    gate, up, down = lin["mlp.gate_proj"], lin["mlp.up_proj"], lin["mlp.down_proj"]
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm

    s = search_scales(x["self_attn.q_proj"], [q.weight, k.weight, v.weight], bits, group_size, n_grid)
    fold_into_norm(layer.input_layernorm, s, unit_offset)
    for m in (q, k, v):
        m.weight.mul_(s)

    num_kv, num_q = v.out_features // head_dim, o.in_features // head_dim
    tie = (num_kv, num_q // num_kv, head_dim)  # HF repeat_kv: query head h reads kv head h // num_rep
    s = search_scales(x["self_attn.o_proj"], [o.weight], bits, group_size, n_grid, tie=tie)
    s_v = s.view(num_kv, -1, head_dim)[:, 0].reshape(-1)  # [num_kv * head_dim]: v's output channels
    v.weight.div_(s_v[:, None])
    if v.bias is not None:
        v.bias.div_(s_v)
    o.weight.mul_(s)

    s = search_scales(x["mlp.gate_proj"], [gate.weight, up.weight], bits, group_size, n_grid)
    fold_into_norm(mlp_norm, s, unit_offset)
    gate.weight.mul_(s)
    up.weight.mul_(s)

    s = search_scales(x["mlp.down_proj"], [down.weight], bits, group_size, n_grid)
    up.weight.div_(s[:, None])
    down.weight.mul_(s)


@torch.no_grad()
def awq_quantize_model(model: torch.nn.Module, calib_token_ids, bits: int, group_size: int | None,
                       seq_len: int = 512, n_grid: int = 20, max_search_tokens: int | None = 256
                       ) -> dict[str, torch.Tensor]:
    """AWQ-scale every decoder layer (folding into norms and producer linears), then RTN all linears.

    Args:
        model: HF-named float Llama-family model; modified in place (scales folded, float function kept).
        calib_token_ids: 1-D token ids, cut into rows of seq_len.
        n_grid: alpha grid resolution (n_grid + 1 points in [0, 1]).
        max_search_tokens: rows of X used in the scale search (evenly strided subsample), bounding its cost;
            None uses every calibration token (the loss then goes through X^T X when T > K). On SmolLM2 all
            2,560 tokens scored no better than 256 on held-out text and took ~2x longer, hence the default.
    Returns:
        canonical quantized tensors "model.layers.{i}.<suffix>.qweight|scales|zeros". The changed norm weights
        are NOT included: take them from the model's state dict (quantize_model does).
    """
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads if config is not None else None)
    if head_dim is None:
        raise ValueError("AWQ needs model.config (head_dim, or hidden_size and num_attention_heads) for GQA ties")
    unit_offset = str(getattr(config, "model_type", "")).startswith("gemma")  # (1 + weight) norms
    inputs = capture_first_layer_inputs(model, calibration_batch(calib_token_ids, seq_len))
    state = {}
    for i, layer in enumerate(tqdm(decoder_layers(model), desc=f"awq int{bits}", unit="layer")):
        recorded = {}
        with record_inputs(layer, lambda suffix, x: recorded.setdefault(suffix, []).append(x)):
            run_layer(layer, inputs)
        x = {}
        for suffix, chunks in recorded.items():
            xs = torch.cat(chunks)
            if max_search_tokens is not None:
                xs = xs[:: max(1, xs.shape[0] // max_search_tokens)][:max_search_tokens]
            x[suffix] = xs
        apply_layer_scales(layer, x, bits, group_size, head_dim, n_grid, unit_offset)
        for suffix, linear in layer_linears(layer).items():
            tensors = rtn_tensors(linear.weight, bits, group_size)
            state.update({f"model.layers.{i}.{suffix}.{name}": t for name, t in tensors.items()})
        inputs.hidden = run_layer(layer, inputs)  # float outputs, as llm-awq (scaling keeps the function)
    return state
