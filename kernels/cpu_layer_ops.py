"""The elementwise parts of a Llama decoder layer on x86-64 CPUs: the C++ kernels in kernels/cpu/layer_ops.cpp
(built by kernels/cpu_ext.py), each beside its pure-torch reference (the HF Llama math shared/model.py runs
elsewhere). One call each where torch needs 5-15 small ops; at decode batch sizes those ops' dispatch, not their
arithmetic, was most of a step (docs/performance.md). fp32 or bf16 activations: in bf16 the kernels compute in fp32
and round to bf16 where the reference's torch ops do (equal results, but for the order of RMSNorm's sum of squares
and SiLU's e^x, which may move a bf16 result by one ulp). And the greedy sampler's argmax over the vocabulary
(argmax_rows).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_ext


def supports(x: torch.Tensor) -> bool:
    """True when the kernels take this activation: fp32 or bf16 on the CPU, and built."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and cpu_ext.available()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as HF LlamaRMSNorm: normalized in fp32, cast to x's dtype, then times the
    weight in that dtype (bf16: rounded, multiplied, rounded again)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H], both fp32 or both bf16 -> [T, H] of x's dtype. RuntimeError on other shapes or
    dtypes."""
    return cpu_ext.extension().rms_norm(x.contiguous(), weight.contiguous(), eps)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), new tensors (the sum rounded to x's dtype first)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place (vLLM's fused_add_rms_norm): residual += x, then x = RMSNorm(residual); returns (x, residual).
    x, residual contiguous, non-overlapping [T, H]; weight [H]; all fp32 or all bf16. RuntimeError on other shapes
    or dtypes, or overlapping x and residual."""
    cpu_ext.extension().fused_add_rms_norm(x, residual, weight.contiguous(), eps)
    return x, residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_write_kv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, HF Llama) on the query and key heads, in fp32 with fp32 cos, sin and
    rounded once to qkv's dtype; keys and values indexed into the caches by slot. Returns the rotated queries
    [T, num_heads, D] of qkv's dtype."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    qk = qkv[:, : num_heads + num_kv_heads]
    qk = (qk * cos[:, None] + rotate_half(qk) * sin[:, None]).to(qkv.dtype)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, num_heads + num_kv_heads :]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(value_cache.dtype))
    return q


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qkv [T, num_heads + 2 Hkv, D] (query, key, value heads); cos, sin fp32 [T, D]; key_cache, value_cache
    contiguous [num_blocks, block_size, Hkv, D] (written in place at slot_mapping int64 [T]); qkv and the caches
    both fp32 or both bf16. Returns the rotated queries [T, num_heads, D] of qkv's dtype. RuntimeError on other
    shapes or dtypes, or a slot outside the cache."""
    return cpu_ext.extension().rope_write_kv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), key_cache,
                                             value_cache, slot_mapping.contiguous(), num_heads)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate, up] on the last dim (the SwiGLU MLP, Shazeer 2020); in bf16 two
    roundings: silu(gate), then the product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] -> [T, I], fp32 or bf16. RuntimeError on other shapes or dtypes. Differs from
    silu_and_mul_ref where e^-gate overflows: a gate below about -87 gives about gate * e^-88 (the reference: -0),
    and a gate of -inf gives -inf (the reference: NaN); in bf16 also by one ulp where the two e^x round silu(gate)
    apart."""
    return cpu_ext.extension().silu_and_mul(gate_up.contiguous())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's argmax: logits [M, vocab] fp32 -> int64 [M], each row's first index of its largest value
    (a NaN counts as the largest: torch.argmax(-1)'s rule, its reference), on the kernels' threads. RuntimeError
    when not built (check supports()) or the logits are not fp32."""
    return cpu_ext.extension().argmax_rows(logits.contiguous())
