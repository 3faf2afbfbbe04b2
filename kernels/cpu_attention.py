"""Paged decode attention on x86-64 CPUs: the C++ kernel in kernels/cpu/attention.cpp (built by kernels/cpu_ext.py)
and the argument checks around it. The reference is kernels/paged_attention.py paged_decode_attention_ref.
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_ext
from tandem.kernels.kv_quant import KV_QUANT_IDS


def supports(query: torch.Tensor, key_cache: torch.Tensor, kv_quant: str | None = None) -> bool:
    """True when the kernel takes these tensors: query fp32 or bf16 on the CPU with a cache of its dtype (or a
    uint8 cache of a quantized format kv_quant), head_dim a multiple of 16 up to 256, built."""
    head_dim = query.shape[-1]
    cache_dtype = query.dtype if kv_quant is None else torch.uint8
    return (query.device.type == "cpu" and key_cache.dtype == cache_dtype
            and query.dtype in (torch.float32, torch.bfloat16)
            and head_dim % 16 == 0 and head_dim <= 256 and cpu_ext.available())  # fmt: skip


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None,
                           kv_quant: str | None = None) -> torch.Tensor:
    """out [S, Hq, D] of the query's dtype: each sequence's one query row per head attends to its context_lens[s]
    cached tokens (with window, to the last `window` of them; the block-table entries before are never read).

    query [S, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (Hq % Hkv == 0, query heads grouped
    consecutively per KV head), all fp32 or all bf16; with kv_quant (kernels/kv_quant.py) the caches are uint8
    [num_blocks, block_size, Hkv, row_size] rows of codes (int8: and scale), read in place; block_tables int32
    [S, max_blocks]; context_lens int32 [S];
    softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2). Exact softmax (two-pass,
    fp32); bf16 is widened to fp32 as it is read and the output rounded once (as the reference computes it).
    RuntimeError on bad shapes or dtypes, or when the kernel is not built (check supports())."""
    ext = cpu_ext.extension()
    if ext is None:
        raise RuntimeError("the CPU attention kernel is not available on this machine")
    return ext.paged_decode_attention(query.contiguous(), key_cache.contiguous(), value_cache.contiguous(),
                                      block_tables.to(torch.int32).contiguous(),
                                      context_lens.to(torch.int32).contiguous(), scale, window or 0, softcap or 0.0,
                                      KV_QUANT_IDS[kv_quant])
