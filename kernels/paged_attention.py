"""Decode attention over a paged KV cache: one new query token per sequence.

Method: PagedAttention (Kwon et al. 2023) reads keys/values through a block table; the online softmax of
FlashAttention-2 (Dao 2023) streams them in tiles; flash-decoding (Dao et al. 2023) splits long contexts
across programs and merges the partial results by their log-sum-exp. One program handles all query heads of
one KV head (GQA), so each key/value tile is read once per KV head. A sliding window starts each sequence's
loop at its window (earlier blocks are never read); soft-capping (Gemma 2) maps scores through cap * tanh(s / cap).
A quantized cache (kv_quant: kernels/kv_quant.py, uint8 rows of head_dim codes, int8's followed by the fp32 scale)
is read in place: codes are decoded to fp32 with integer bit operations (no fp8 type needed, so the interpreter and
pre-Hopper GPUs run it), and an int8 row's scale multiplies its score (keys) or its softmax weight (values).
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import (
    FLOAT_DTYPES, check_devices, check_shape, check_tensor, dot_dtype, dot_precision, multiprocessor_count,
)
from tandem.kernels.kv_quant import KV_QUANT_IDS, ROW_SCALED, dequantize, row_size
from tandem.kernels.masks import soft_cap

LOG2E = tl.constexpr(1.4426950408889634)
BLOCK_N = 64  # context tokens per tile
MIN_PARTITION = 256  # fewest context tokens one split program handles
MAX_SPLITS = 256


@triton.jit
def scores_log2(dot, scale, softcap, SOFTCAP: tl.constexpr):
    """Attention scores in log2 units from the raw q.k dot products: dot * scale, soft-capped when SOFTCAP
    (softcap * tanh(dot * scale / softcap)), times log2(e) for exp2."""
    if SOFTCAP:
        x = dot * (scale / softcap)
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)  # tanh(|x|), without overflow
        return tl.where(x >= 0, t, -t) * (softcap * LOG2E)
    return dot * (scale * LOG2E)


@triton.jit
def decode_codes(codes, KV_QUANT: tl.constexpr):
    """uint8 codes of a quantized KV format (KV_QUANT: 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8) -> fp32, unscaled. fp8: a
    normal code's exponent and mantissa shifted into fp32's place and the exponent rebiased (127 - 7, 127 - 15); a
    subnormal one (exponent 0) is its mantissa times 2^-9 (2^-16); then the sign. (No NaN/inf codes: quantize
    clamps to qmax.)"""
    if KV_QUANT == 3:
        value = codes.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        bits = codes.to(tl.int32)
        em = bits & 0x7F
        if KV_QUANT == 1:
            value = tl.where(em < 8, em.to(tl.float32) * (1.0 / 512),
                             ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True))
        else:
            value = tl.where(em < 4, em.to(tl.float32) * (1.0 / 65536),
                             ((em << 21) + (112 << 23)).to(tl.float32, bitcast=True))
        value = tl.where((bits & 0x80) != 0, -value, value)
    return value


@triton.jit
def load_kv_tile(cache_ptr, row_offs, offs_d, mask_n, mask_d, head_dim, KV_QUANT: tl.constexpr):
    """Rows [N, D] of a K or V tile whose rows start at cache_ptr + row_offs [N], and their scales [N]: a float
    cache's values or fp8 codes as fp32 (scales 1, unused), or int8 codes as fp32 and the fp32 scale after each
    row (KV_QUANT 3: the one format whose rows carry a scale, kv_quant.ROW_SCALED)."""
    x = tl.load(cache_ptr + row_offs[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0)
    if KV_QUANT != 0:
        x = decode_codes(x, KV_QUANT)
    if KV_QUANT == 3:
        scale = tl.load((cache_ptr + row_offs + head_dim).to(tl.pointer_type(tl.float32)), mask=mask_n, other=0.0)
    else:
        scale = tl.zeros_like(row_offs).to(tl.float32) + 1.0
    return x, scale


@triton.jit
def _decode_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    scale, window, softcap,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ps, stride_ph, stride_pp,
    block_size, queries_per_kv, head_dim, partition_size,
    GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    if split > 0 and start >= context_len:
        return
    end = tl.minimum(start + partition_size, context_len)
    if SLIDING:  # (a split wholly before the window attends to nothing: lse -inf, weight 0 in the merge)
        start = tl.maximum(start, context_len - window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    q_heads = kv_head * queries_per_kv + offs_g
    mask_g = offs_g < queries_per_kv
    mask_d = offs_d < head_dim
    q_offs = seq.to(tl.int64) * stride_qs + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)  # [G, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        block_ids = tl.load(block_table + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % block_size
        k_offs = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k, k_scale = load_kv_tile(k_cache_ptr, k_offs, offs_d, mask_n, mask_d, head_dim, KV_QUANT)  # [N, D], [N]
        v_offs = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v, v_scale = load_kv_tile(v_cache_ptr, v_offs, offs_d, mask_n, mask_d, head_dim, KV_QUANT)

        dot = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)  # [G, N]
        if KV_QUANT == 3:  # (int8's row scales)
            dot = dot * k_scale[None, :]
        s = scores_log2(dot, scale, softcap, SOFTCAP)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a tile with no key in the window)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if KV_QUANT == 3:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m = m_new

    safe_l = tl.where(l > 0.0, l, 1.0)  # an empty context gives zeros
    acc = acc / safe_l[:, None]
    out_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        part = seq.to(tl.int64) * stride_ps + q_heads * stride_ph + split * stride_pp  # [G]
        tl.store(part_out_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=out_mask)
        lse = tl.where(l > 0.0, m + tl.log2(safe_l), float("-inf"))  # log2 units
        tl.store(part_lse_ptr + part, lse, mask=mask_g)
    else:
        o_offs = seq.to(tl.int64) * stride_os + q_heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, context_lens_ptr,
    stride_os, stride_oh, stride_ps, stride_ph,
    head_dim, partition_size,
    NUM_SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Combines the per-split outputs of one (seq, query head) weighted by exp(lse - max lse).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_valid = tl.maximum(tl.cdiv(context_len, partition_size), 1)
    base = seq.to(tl.int64) * stride_ps + head * stride_ph  # in split units
    offs_p = tl.arange(0, NUM_SPLITS_PAD)
    lse = tl.load(part_lse_ptr + base + offs_p, mask=offs_p < num_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m), 0)
    denom = tl.where(denom > 0.0, denom, 1.0)

    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, num_valid, CHUNK):
        mask_c = p0 + offs_c < num_valid
        w = tl.exp2(tl.load(part_lse_ptr + base + p0 + offs_c, mask=mask_c, other=float("-inf")) - m)
        o_offs = (base + p0 + offs_c[:, None]) * head_dim + offs_d[None, :]
        o = tl.load(part_out_ptr + o_offs, mask=mask_c[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    out_offs = seq.to(tl.int64) * stride_os + head * stride_oh + offs_d
    tl.store(out_ptr + out_offs, (acc / denom).to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def check_caches(query, key_cache, value_cache, kv_quant: str | None) -> None:
    """The caches of one layer against the query [num_tokens, num_q_heads, head_dim]: [num_blocks, block_size,
    num_kv_heads, row], the query's dtype and row head_dim, or with kv_quant uint8 and row kv_quant.row_size (also
    used by prefill_attention). ValueError naming the argument."""
    if kv_quant is not None and kv_quant not in KV_QUANT_IDS:
        raise ValueError(f"kv_quant must be one of {[k for k in KV_QUANT_IDS if k]} or None, got {kv_quant!r}")
    cache_dtypes = FLOAT_DTYPES if kv_quant is None else (torch.uint8,)
    check_tensor("key_cache", key_cache, 4, cache_dtypes)
    check_tensor("value_cache", value_cache, 4, cache_dtypes)
    num_q_heads, head_dim = query.shape[1:]
    check_shape("key_cache", key_cache, (None, None, None, row_size(head_dim, kv_quant)))
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    num_kv_heads = key_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_quant is None and not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(f"query, key_cache, value_cache dtypes differ: "
                         f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if kv_quant in ROW_SCALED and any(s % 4 for s in key_cache.stride()[:3] + value_cache.stride()[:3]):
        raise ValueError(f"a {kv_quant} cache's strides must be multiples of 4 bytes (its fp32 scales are aligned)")


def _check_args(query, key_cache, value_cache, block_tables, context_lens, kv_quant) -> None:
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_caches(query, key_cache, value_cache, kv_quant)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    num_seqs = query.shape[0]
    check_shape("block_tables", block_tables, (num_seqs, None))
    check_shape("context_lens", context_lens, (num_seqs,))
    check_devices(query=query, key_cache=key_cache, value_cache=value_cache,
                  block_tables=block_tables, context_lens=context_lens)


def _choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split the context only when (seq, kv head) programs alone cannot fill the GPU twice over."""
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(2 * multiprocessor_count(device), programs)
    return max(1, min(wanted, triton.cdiv(max_context, MIN_PARTITION), MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    kv_quant: str | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its cached context (its last `window` tokens with a
    sliding window).

    Args:
        query: [num_seqs, num_q_heads, head_dim], fp16/bf16/fp32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], query's dtype.
            num_q_heads % num_kv_heads == 0; query head h reads kv head h // (num_q_heads // num_kv_heads).
        block_tables: [num_seqs, max_blocks_per_seq] int32 block ids.
        context_lens: [num_seqs] int32, cached tokens per sequence including the current one (0 gives zeros).
        scale: softmax scale, usually head_dim ** -0.5.
        num_splits: context splits per sequence (flash-decoding); None picks from the GPU size and the
            context bound max_blocks_per_seq * block_size, without a host sync.
        window: attend to the last `window` positions only (block-table entries before them are never read);
            None: all.
        softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); None: no cap.
        kv_quant: the caches' quantized format (kernels/kv_quant.py: uint8 [num_blocks, block_size,
            num_kv_heads, row_size]: head_dim, int8's head_dim + 4); None: float caches of query's dtype.
    Returns:
        [num_seqs, num_q_heads, head_dim] in query's dtype.
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    _check_args(query, key_cache, value_cache, block_tables, context_lens, kv_quant)
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    max_context = max(block_tables.shape[1] * block_size, 1)
    if num_splits is None:
        num_splits = _choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    partition_size = triton.cdiv(triton.cdiv(max_context, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_context, partition_size)

    split = num_splits > 1
    shape = (num_seqs, num_q_heads, num_splits) if split else (1, 1, 1)
    part_out = torch.empty(*shape, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(shape, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_lse, query, key_cache, value_cache, block_tables, context_lens,
        scale, window or 0, softcap or 1.0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        block_size, queries_per_kv, head_dim, partition_size,
        GROUP_PAD=max(16, triton.next_power_of_2(queries_per_kv)), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
        SPLIT=split, SLIDING=window is not None, SOFTCAP=softcap is not None,
        DOT_DTYPE=dot_dtype(query.dtype), DOT_PRECISION=dot_precision(query.dtype),
        KV_QUANT=KV_QUANT_IDS[kv_quant],
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_lse, context_lens,
            out.stride(0), out.stride(1), part_lse.stride(0), part_lse.stride(1),
            head_dim, partition_size,
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits), CHUNK=min(16, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
        )
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    kv_quant: str | None = None,
) -> torch.Tensor:
    """Plain-torch paged_decode_attention (fp32 math, one sequence at a time; a quantized cache dequantized with
    kernels/kv_quant.dequantize)."""
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    for i in range(num_seqs):
        n = int(context_lens[i])
        if n == 0:
            continue
        blocks = block_tables[i, : triton.cdiv(n, block_size)].long()
        k = _gather_ref(key_cache, blocks, n, kv_quant)  # [n, kv_heads, D] fp32
        v = _gather_ref(value_cache, blocks, n, kv_quant)
        k = k.repeat_interleave(queries_per_kv, dim=1)  # [n, q_heads, D]
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = soft_cap(torch.einsum("hd,nhd->hn", query[i].float(), k) * scale, softcap)  # [q_heads, n]
        if window is not None:
            scores[:, : max(0, n - window)] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out


def _gather_ref(cache: torch.Tensor, blocks: torch.Tensor, n: int, kv_quant: str | None) -> torch.Tensor:
    """The first n token rows of blocks [num_blocks] of a cache as fp32 [n, num_kv_heads, head_dim]."""
    rows = cache[blocks].flatten(0, 1)[:n]
    return rows.float() if kv_quant is None else dequantize(rows, kv_quant)
