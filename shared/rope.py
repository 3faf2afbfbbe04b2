"""Rotary position embeddings (RoPE, Su et al. 2021) and the scaling variants checkpoints ask for in config.json's
`rope_parameters` (transformers >= 5) or `rope_scaling` (older files).

Each variant only changes the inverse frequencies (and, for YaRN, scales cos and sin), so every attention kernel
runs unchanged. The formulas follow HF transformers' `modeling_rope_utils` (the oracle the tests compare with):
`linear` (position interpolation, Chen et al. 2023) divides every frequency by `factor`; `llama3` (Meta's Llama 3.1
recipe) divides the low frequencies by `factor`, keeps the high ones and interpolates between;
`yarn` (Peng et al. 2023) blends interpolated and extrapolated frequencies by wavelength and scales attention by
`attention_factor`; `longrope` (LongRoPE, Ding et al. 2024; Phi-3 128k) divides each frequency by its own factor,
`short_factor` within the original context and `long_factor` past it, and scales cos and sin. Which types are
served, and how config.json is read: shared/architectures.py.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def inv_freq_and_attention_factor(params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32, the factor cos and sin are scaled by) for rope_parameters(...)'s output."""
    dim = head_dim
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "longrope":  # (the short factors; long_inv_freq gives the others)
        return _longrope_inv_freq(params, head_dim, "short_factor"), _longrope_attention_factor(params)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    old_len = params["original_max_position_embeddings"]
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    factor = float(params["factor"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no division by zero)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(params: dict, head_dim: int, factors: str) -> torch.Tensor:
    """longrope's inverse frequencies [head_dim // 2] fp32 with params[factors] (short_factor or long_factor), in
    HF's order of operations."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(params[factors], dtype=torch.float32) * float(params["rope_theta"]) ** shape)


def _longrope_attention_factor(params: dict) -> float:
    """LongRoPE's scale of cos and sin: given, or sqrt(1 + ln(factor) / ln(original context)) (HF's default)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (Peng et al. 2023, eq. 21)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos and sin per position, rotate-half layout as in HF Llama; inv_freq from inv_freq_and_attention_factor."""

    def __init__(self, head_dim: int, params: dict):
        super().__init__()
        inv_freq, self.attention_factor = inv_freq_and_attention_factor(params, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.longrope = params["rope_type"] == "longrope"
        if self.longrope:
            self.register_buffer("inv_freq_long", _longrope_inv_freq(params, head_dim, "long_factor"), persistent=False)

    def forward(self, positions: torch.Tensor, long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] int64 -> cos, sin [num_tokens, head_dim] fp32. longrope: long [num_tokens] bool
        marks the tokens that take the long factors (AttentionMetadata.rope_long; None: none)."""
        inv_freq = self.inv_freq.unsqueeze(0)
        if self.longrope and long is not None:
            inv_freq = torch.where(long.unsqueeze(1), self.inv_freq_long.unsqueeze(0), inv_freq)
        freqs = positions.float().unsqueeze(1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
