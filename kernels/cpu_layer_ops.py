"""The elementwise parts of a Llama decoder layer on x86-64 CPUs: the C++ kernels in kernels/cpu/layer_ops.cpp
(built by kernels/cpu_ext.py), each beside its pure-torch reference (the HF Llama math shared/model.py runs
elsewhere). One call each where torch needs 5-15 small ops; at decode batch sizes those ops' dispatch, not their
arithmetic, was most of a step (docs/performance.md).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_ext


def supports(x: torch.Tensor) -> bool:
    """True when the kernels take this activation: fp32 on the CPU, and built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_ext.available()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as HF Llama: fp32 statistics, then times the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x fp32 [T, H], weight fp32 [H] -> fp32 [T, H]. RuntimeError on other shapes or dtypes."""
    return cpu_ext.extension().rms_norm(x.contiguous(), weight.contiguous(), eps)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), new tensors."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place (vLLM's fused_add_rms_norm): residual += x, then x = RMSNorm(residual); returns (x, residual).
    x, residual contiguous, non-overlapping fp32 [T, H]; weight fp32 [H]. RuntimeError on other shapes or dtypes,
    or overlapping x and residual."""
    cpu_ext.extension().fused_add_rms_norm(x, residual, weight.contiguous(), eps)
    return x, residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_write_kv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, HF Llama) on the query and key heads; keys and values indexed into the
    caches by slot. Returns the rotated queries [T, num_heads, D]."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    qk = qkv[:, : num_heads + num_kv_heads]
    qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, qkv[:, num_heads + num_kv_heads :])
    return q


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qkv fp32 [T, num_heads + 2 Hkv, D] (query, key, value heads); cos, sin fp32 [T, D]; key_cache, value_cache
    contiguous fp32 [num_blocks, block_size, Hkv, D] (written in place at slot_mapping int64 [T]). Returns the
    rotated queries fp32 [T, num_heads, D]. RuntimeError on other shapes or dtypes, or a slot outside the cache."""
    return cpu_ext.extension().rope_write_kv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), key_cache,
                                             value_cache, slot_mapping.contiguous(), num_heads)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate, up] on the last dim (the SwiGLU MLP, Shazeer 2020)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up fp32 [T, 2 I] -> fp32 [T, I]. RuntimeError on other shapes or dtypes. Differs from silu_and_mul_ref
    only where e^-gate overflows: a gate below about -87 gives about gate * e^-88 (the reference: -0), and a gate of
    -inf gives -inf (the reference: NaN)."""
    return cpu_ext.extension().silu_and_mul(gate_up.contiguous())
