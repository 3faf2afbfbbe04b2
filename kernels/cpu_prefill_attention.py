"""Causal attention of query chunks over the paged KV cache on x86-64 CPUs (prefill, chunked prefill, mixed
batches): the C++ kernel in kernels/cpu/prefill_attention.cpp (built by kernels/cpu_ext.py), its argument checks
and its pure-torch reference. The CUDA counterpart is kernels/prefill_attention.py (Triton).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_ext
from tandem.kernels.masks import causal_mask, soft_cap


def supports(query: torch.Tensor, key_cache: torch.Tensor, kv_quant: str | None = None) -> bool:
    """True when the kernel takes these tensors: query fp32 or bf16 on the CPU with a float cache of its dtype (no
    quantized KV), head_dim a multiple of 16, built."""
    return (query.device.type == "cpu" and kv_quant is None and key_cache.dtype == query.dtype
            and query.dtype in (torch.float32, torch.bfloat16) and query.shape[-1] % 16 == 0
            and cpu_ext.available())  # fmt: skip


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """out [T, Hq, D] of the query's dtype: sequence s's query rows query_start_loc[s] .. query_start_loc[s + 1] - 1
    are the last positions of its context of context_lens[s] tokens (already in the cache) and attend causally to
    it (with window, to the last `window` positions up to their own; block-table entries before are never read).

    query [T, Hq, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] (Hq % Hkv == 0, query heads grouped
    consecutively per KV head), all fp32 or all bf16; block_tables int32 [S, max_blocks]; query_start_loc [S + 1];
    context_lens [S]; softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
    FlashAttention-2's online softmax in fp32 (bf16 widened as it is read, the output rounded once), on the CPU
    kernels' threads. RuntimeError on bad shapes or dtypes, a sequence with more query rows than context, or when
    the kernel is not built (check supports())."""
    ext = cpu_ext.extension()
    if ext is None:
        raise RuntimeError("the CPU prefill attention kernel is not available on this machine")
    return ext.paged_prefill_attention(query.contiguous(), key_cache.contiguous(), value_cache.contiguous(),
                                       block_tables.to(torch.int32).contiguous(),
                                       query_start_loc.to(torch.int32).contiguous(),
                                       context_lens.to(torch.int32).contiguous(), scale, window or 0, softcap or 0.0)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """Plain-torch paged_prefill_attention: one sequence at a time, its blocks gathered, fp32 math (a full
    softmax), the output cast to the query's dtype. Same arguments and result."""
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    for s in range(context_lens.shape[0]):
        start, end, ctx = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        if end == start:
            continue
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        k = key_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = value_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        scores = soft_cap(torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * scale, softcap)
        visible = causal_mask(torch.arange(ctx - (end - start), ctx), ctx, window)  # [n, ctx]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
