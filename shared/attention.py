"""Attention over the paged KV cache: C++ kernels or torch ops on CPU, Triton kernels on CUDA
(shared.device.use_triton picks).

The batch is flat: request i owns query rows query_start_loc[i]:query_start_loc[i+1], which are the last
positions of its context of context_lens[i] tokens (cached prefix + this step's tokens). Causal masking is
therefore offset: query row j of a request with n new tokens sits at position context_len - n + j. A layer with a
sliding window sees only the last `window` positions up to its own (kernels/masks.causal_mask), and reads no block
before them; soft-capping maps each score s to cap * tanh(s / cap) before the softmax (Gemma 2).

A quantized KV cache (meta.kv_quant: kernels/kv_quant.py) holds uint8 rows of codes + scale: write_kv_cache
quantizes as it writes; every path reads the codes: the C++ and Triton kernels in place, the torch paths by
dequantizing the blocks they gather (to the query's dtype). Attention math stays in the query's type.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels import cpu_attention, cpu_prefill_attention
from tandem.kernels.kv_quant import dequantize, quantize
from tandem.kernels.masks import causal_mask, soft_cap
from tandem.shared.device import use_triton
from tandem.shared.utils import cdiv


@dataclass(slots=True)
class AttentionMetadata:
    """Batch layout for one forward. All tensors live on the model's device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, pool slot of each new token
    query_start_loc: list[int]  # [num_seqs + 1] cumulative query counts
    context_lens: list[int]  # [num_seqs] tokens in cache after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc_t: torch.Tensor  # [num_seqs + 1] int32
    context_lens_t: torch.Tensor  # [num_seqs] int32
    # CPU decode: (block ids [num_seqs * blocks of the longest context] int64, key mask [num_seqs, 1, 1, max_ctx]),
    # made by the first layer and reused by the others
    cpu_decode_layout: tuple[torch.Tensor, torch.Tensor] | None = None
    # CPU short queries (speculative verification): each query row as a decode row, (block tables [num_tokens,
    # max_blocks] int32, context lens [num_tokens] int32), made by the first layer
    cpu_rows_layout: tuple[torch.Tensor, torch.Tensor] | None = None
    # longrope: [num_tokens] bool, the tokens whose RoPE takes the long factors (None: none)
    rope_long: torch.Tensor | None = None
    # the pool's quantized KV format (kernels/kv_quant.py; None: float KV of the query's dtype)
    kv_quant: str | None = None

    @property
    def is_decode_only(self) -> bool:
        return len(self.query_start_loc) - 1 == self.query_start_loc[-1]

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:]))


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_quant: str | None = None) -> None:
    """Scatter new K/V rows [num_tokens, num_kv_heads, head_dim] into one layer's pool by slot; with kv_quant,
    quantized as they are written (kernels/kv_quant.py: fp8 rows of head_dim codes; int8 rows with their scale)."""
    if use_triton(key):
        from tandem.kernels.kv_cache_write import write_kv_cache as kernel

        return kernel(key, value, key_cache, value_cache, slot_mapping, kv_quant=kv_quant)
    if kv_quant is not None:
        key, value = quantize(key, kv_quant), quantize(value, kv_quant)
    num_blocks, block_size, num_kv_heads, row = key_cache.shape
    key_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, value)


def paged_attention(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of new query rows over each request's paged context.

    query [num_tokens, num_q_heads, head_dim]; key_cache/value_cache [num_blocks, block_size, num_kv_heads,
    head_dim] (already holding this step's K/V; with meta.kv_quant, uint8 rows of kv_quant.row_size); window: a sliding
    window (None: the whole context); softcap: the scores' tanh cap (None: none); returns [num_tokens, num_q_heads,
    head_dim].
    CUDA: Triton kernels (decode and extend). CPU: decode batches and short queries in the C++ decode kernel
    (fp32, bf16; float or quantized KV) or one padded scaled_dot_product_attention (fp16); longer queries (prefill
    chunks, mixed batches) in the C++ prefill kernel (fp32, bf16; float KV), otherwise per-request gather +
    attention.
    """
    if use_triton(query):
        return _attention_triton(query, key_cache, value_cache, meta, scale, window, softcap)
    if meta.is_decode_only:
        return _decode_attention_cpu(query, key_cache, value_cache, meta, scale, window, softcap)
    if cpu_attention.supports(query, key_cache, meta.kv_quant) and (rows := decode_kernel_rows(meta)) is not None:
        return cpu_attention.paged_decode_attention(query, key_cache, value_cache, *rows, scale, window, softcap,
                                                    meta.kv_quant)  # (short queries: verified drafts)
    if cpu_prefill_attention.supports(query, key_cache, meta.kv_quant):
        return cpu_prefill_attention.paged_prefill_attention(query, key_cache, value_cache, meta.block_tables,
                                                             meta.query_start_loc_t, meta.context_lens_t, scale,
                                                             window, softcap)
    return _per_request_cpu(query, key_cache, value_cache, meta, scale, window, softcap)


def _per_request_cpu(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None,
                     softcap: float | None) -> torch.Tensor:
    """Each request in turn: gather its context's blocks (from its first row's window on), attend."""
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    for i, ctx in enumerate(meta.context_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n = end - start
        # keys from the first query row's window on (its blocks' start), so no block before is read
        first = 0 if window is None else max(0, ctx - n - window + 1) // block_size * block_size
        block_ids = meta.block_tables[i, first // block_size : cdiv(ctx, block_size)]
        k = _dequantized(key_cache[block_ids].flatten(0, 1)[: ctx - first], meta.kv_quant, query.dtype)
        v = _dequantized(value_cache[block_ids].flatten(0, 1)[: ctx - first], meta.kv_quant, query.dtype)
        # k, v [ctx - first, num_kv_heads, head_dim]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_q_heads, n, head_dim]
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        if n == ctx and window is None and softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        elif n == 1 and window is None and softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        else:
            mask = causal_mask(torch.arange(ctx - n - first, ctx - first), ctx - first, window)  # [n, ctx - first]
            o = _attend(q, k, v, mask, scale, softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out


def _dequantized(rows: torch.Tensor, kv_quant: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as the query's dtype: quantized rows [..., row_size] dequantized; float ones as
    they are."""
    return rows if kv_quant is None else dequantize(rows, kv_quant, dtype)


def _attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v: q [B, Hq, n, D], k and v [B, Hkv, ctx, D], mask broadcastable to
    [B, Hq, n, ctx] (True: visible) -> [B, Hq, n, D]. Without a cap, scaled_dot_product_attention."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = soft_cap((q.float() @ k.float().transpose(-1, -2)) * scale, softcap).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


MAX_ROWS_AS_DECODE = 16  # CPU: requests with at most this many query rows (verified drafts) run as decode rows


def decode_kernel_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of the CPU decode kernel when a batch runs there: (block tables [rows, max_blocks] int32, context
    lens [rows] int32); None when a request has more than MAX_ROWS_AS_DECODE query rows (the prefill kernel's).
    A decode batch's rows are its requests. Short queries (a decode token and its drafts) are one row per query
    row, each attending to its own causal prefix through its request's block table: row j of a request with n rows
    and context c sees c - n + j + 1 tokens (made once per forward: meta.cpu_rows_layout)."""
    if meta.is_decode_only:
        return meta.block_tables, meta.context_lens_t
    if meta.max_query_len > MAX_ROWS_AS_DECODE:
        return None
    if meta.cpu_rows_layout is None:
        counts = torch.tensor([b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])])
        lens = [c - n + j + 1 for c, n in zip(meta.context_lens, counts.tolist()) for j in range(n)]
        meta.cpu_rows_layout = (meta.block_tables.repeat_interleave(counts, dim=0),
                                torch.tensor(lens, dtype=torch.int32))  # fmt: skip
    return meta.cpu_rows_layout


def _decode_attention_cpu(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None,
                          softcap: float | None) -> torch.Tensor:
    """One query token per request. fp32 and bf16: the C++ kernel, which reads K/V in place through the block
    table; otherwise gather every context into a padded batch and attend in one call (with a window, a per-request
    loop: the blocks before each window may be gone)."""
    if cpu_attention.supports(query, key_cache, meta.kv_quant):
        return cpu_attention.paged_decode_attention(query, key_cache, value_cache, meta.block_tables,
                                                    meta.context_lens_t, scale, window, softcap, meta.kv_quant)
    if window is not None:
        return _per_request_cpu(query, key_cache, value_cache, meta, scale, window, softcap)
    max_ctx = max(meta.context_lens)
    num_seqs, block_size, num_kv_heads, row = query.shape[0], *key_cache.shape[1:]
    head_dim = query.shape[-1]
    if meta.cpu_decode_layout is None:
        block_ids = meta.block_tables[:, : cdiv(max_ctx, block_size)].flatten().long()  # index_select: 2x [] here
        mask = torch.arange(max_ctx) < meta.context_lens_t.unsqueeze(1)  # [num_seqs, max_ctx]
        meta.cpu_decode_layout = block_ids, mask[:, None, None, :]
    block_ids, mask = meta.cpu_decode_layout

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_seqs, kv_heads, max_ctx, dim]
        rows = cache.index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, row)[:, :max_ctx]
        return _dequantized(rows, meta.kv_quant, query.dtype).transpose(1, 2)

    k, v = gather(key_cache), gather(value_cache)
    # NOTE: the query heads sharing a KV head are that head's query rows (GQA as plain attention over
    # [num_seqs, kv_heads, group, dim]; about 25% faster than enable_gqa here). Heads are grouped consecutively.
    q = query.view(num_seqs, num_kv_heads, -1, head_dim)
    if softcap is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        o = _attend(query.view(num_seqs, -1, 1, head_dim), k, v, mask, scale, softcap)
    return o.view(num_seqs, -1, head_dim)


def _attention_triton(query, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None,
                      softcap: float | None) -> torch.Tensor:
    if meta.is_decode_only:
        from tandem.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(query, key_cache, value_cache, block_tables=meta.block_tables,
                                      context_lens=meta.context_lens_t, scale=scale, window=window, softcap=softcap,
                                      kv_quant=meta.kv_quant)
    from tandem.kernels.prefill_attention import paged_prefill_attention

    return paged_prefill_attention(query, key_cache, value_cache, block_tables=meta.block_tables,
                                   query_start_loc=meta.query_start_loc_t, context_lens=meta.context_lens_t,
                                   scale=scale, window=window, softcap=softcap, kv_quant=meta.kv_quant)
