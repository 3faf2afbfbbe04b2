"""Causal attention of new query tokens over a paged KV cache (prefill, chunked prefill, prefix-cache hits,
speculative verification).

Method: FlashAttention-2 (Dao 2023) tiles queries and keys with an online softmax; keys and values are read
through the block table as in PagedAttention (Kwon et al. 2023). Query tiles pack BLOCK_Q tokens x the query
heads of one KV head (GQA), so each key/value tile serves the whole group. Programs find their sequence by a
binary search over query_start_loc, so the launch needs no host sync. With a sliding window a tile's key loop
starts at its first row's window (earlier blocks are never read) and masks both ends; soft-capping as in
paged_attention.scores_log2. A quantized cache (kv_quant) is read in place as in paged_attention.load_kv_tile.
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor, dot_dtype, dot_precision
from tandem.kernels.kv_quant import KV_QUANT_IDS
from tandem.kernels.masks import causal_mask, soft_cap
from tandem.kernels.paged_attention import _gather_ref, check_caches, load_kv_tile, scores_log2

BLOCK_M = 64  # query rows (tokens x heads of one group) per program
BLOCK_N = 64  # key tokens per tile


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence s owns tiles [query_start_loc[s] // BLOCK_Q + s, ...): the largest s whose first tile <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, m, l, q, q_pos, n0, kv_end, k_cache_ptr, v_cache_ptr, block_table, kv_head, scale, window, softcap,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, block_size, offs_d, mask_d, head_dim,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_end
    block_ids = tl.load(block_table + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
    in_block = offs_n % block_size
    k_offs = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
    k, k_scale = load_kv_tile(k_cache_ptr, k_offs, offs_d, mask_n, mask_d, head_dim, KV_QUANT)  # [N, D], [N]
    v_offs = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
    v, v_scale = load_kv_tile(v_cache_ptr, v_offs, offs_d, mask_n, mask_d, head_dim, KV_QUANT)

    dot = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)  # [M, N]
    if KV_QUANT == 3:  # (int8's row scales)
        dot = dot * k_scale[None, :]
    s = scores_log2(dot, scale, softcap, SOFTCAP)
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    if SLIDING:
        s = tl.where(offs_n[None, :] > q_pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if SLIDING:  # a row may have no key of this tile in its window
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    if KV_QUANT == 3:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_new, l


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    scale, window, softcap, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    block_size, queries_per_kv, head_dim,
    BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = context_len - q_len  # absolute position of the sequence's first query token

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # [M] query index within the sequence
    group = rows % GROUP_PAD
    mask_m = (q_tok < q_len) & (group < queries_per_kv)
    q_head = kv_head * queries_per_kv + group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q_offs = (q_start + q_tok).to(tl.int64)[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)  # [M, D]
    q_pos = first_pos + q_tok  # [M]

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    tile_first_pos = first_pos + q_tile * BLOCK_Q
    kv_end = tl.minimum(context_len, tile_first_pos + BLOCK_Q)  # keys past the tile's last query are unseen
    if SLIDING:  # keys from the first row's window on (no earlier one is loaded), masked at both ends
        for n0 in range(tl.maximum(tile_first_pos - window + 1, 0), kv_end, BLOCK_N):
            acc, m, l = _attend_tile(
                acc, m, l, q, q_pos, n0, kv_end, k_cache_ptr, v_cache_ptr, block_table, kv_head, scale, window,
                softcap, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, block_size, offs_d,
                mask_d, head_dim, True, True, SOFTCAP, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_QUANT,
            )
    else:
        full_end = (tile_first_pos // BLOCK_N) * BLOCK_N  # keys before this are visible to every row
        for n0 in range(0, full_end, BLOCK_N):
            acc, m, l = _attend_tile(
                acc, m, l, q, q_pos, n0, kv_end, k_cache_ptr, v_cache_ptr, block_table, kv_head, scale, window,
                softcap, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, block_size, offs_d,
                mask_d, head_dim, False, False, SOFTCAP, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_QUANT,
            )
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m, l = _attend_tile(
                acc, m, l, q, q_pos, n0, kv_end, k_cache_ptr, v_cache_ptr, block_table, kv_head, scale, window,
                softcap, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, block_size, offs_d,
                mask_d, head_dim, True, False, SOFTCAP, BLOCK_N, DOT_DTYPE, DOT_PRECISION, KV_QUANT,
            )

    acc = acc / tl.where(l > 0.0, l, 1.0)[:, None]  # (l is 0 only on padding rows, never stored)
    o_offs = (q_start + q_tok).to(tl.int64)[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _check_args(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, kv_quant) -> None:
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_caches(query, key_cache, value_cache, kv_quant)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    num_seqs = context_lens.shape[0]
    check_shape("block_tables", block_tables, (num_seqs, None))
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_devices(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                  query_start_loc=query_start_loc, context_lens=context_lens)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    kv_quant: str | None = None,
) -> torch.Tensor:
    """Causal attention for a flat batch of query chunks whose keys/values are already in the cache.

    Args:
        query: [num_tokens, num_q_heads, head_dim], fp16/bf16/fp32, sequences back to back.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], query's dtype;
            num_q_heads % num_kv_heads == 0.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        query_start_loc: [num_seqs + 1] int32, cumulative query counts (query_start_loc[0] == 0).
        context_lens: [num_seqs] int32, cached tokens per sequence after this chunk was written. Sequence i's
            queries are its last q_len_i = query_start_loc[i+1] - query_start_loc[i] positions; the query at
            absolute position p attends keys 0..p. Caller contract (not checked, it would sync):
            q_len_i <= context_lens[i].
        scale: softmax scale, usually head_dim ** -0.5.
        window: the query at position p attends keys p - window + 1 .. p only (kernels/masks.causal_mask); None: all.
        softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); None: no cap.
        kv_quant: the caches' quantized format (kernels/kv_quant.py: uint8 [num_blocks, block_size,
            num_kv_heads, row_size]: head_dim, int8's head_dim + 4); None: float caches of query's dtype.
    Returns:
        [num_tokens, num_q_heads, head_dim] in query's dtype; rows past query_start_loc[-1] (padding) are
        left unwritten.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    _check_args(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, kv_quant)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = context_lens.shape[0]
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group_pad = triton.next_power_of_2(queries_per_kv)
    block_q = max(1, BLOCK_M // group_pad)
    num_tiles = num_tokens // block_q + num_seqs  # upper bound on the query tiles of all sequences
    _prefill_kernel[(num_tiles, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
        scale, window or 0, softcap or 1.0, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        block_size, queries_per_kv, head_dim,
        BLOCK_Q=block_q, GROUP_PAD=group_pad, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N, SLIDING=window is not None, SOFTCAP=softcap is not None,
        DOT_DTYPE=dot_dtype(query.dtype), DOT_PRECISION=dot_precision(query.dtype),
        KV_QUANT=KV_QUANT_IDS[kv_quant],
    )
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    kv_quant: str | None = None,
) -> torch.Tensor:
    """Plain-torch paged_prefill_attention (fp32 math, one sequence at a time; a quantized cache dequantized)."""
    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    for i in range(context_lens.shape[0]):
        q_start, q_end, n = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        if q_end == q_start:
            continue
        if q_end - q_start > n:
            raise ValueError(f"sequence {i}: {q_end - q_start} query tokens but context_len {n}")
        blocks = block_tables[i, : triton.cdiv(n, block_size)].long()
        k = _gather_ref(key_cache, blocks, n, kv_quant)  # [n, kv_heads, D] fp32
        v = _gather_ref(value_cache, blocks, n, kv_quant)
        k = k.repeat_interleave(queries_per_kv, dim=1)  # [n, q_heads, D]
        v = v.repeat_interleave(queries_per_kv, dim=1)
        q = query[q_start:q_end].float()  # [q_len, q_heads, D]
        scores = soft_cap(torch.einsum("qhd,nhd->hqn", q, k) * scale, softcap)
        q_pos = torch.arange(n - (q_end - q_start), n, device=query.device)
        visible = causal_mask(q_pos, n, window)  # [q_len, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q_start:q_end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
