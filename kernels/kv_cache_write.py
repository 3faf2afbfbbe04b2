"""Write new tokens' keys and values into the paged KV cache (PagedAttention, Kwon et al. 2023).

Each token's key/value row goes to slot = block_id * block_size + offset of one layer's block pool. With a
quantized cache (kv_quant: kernels/kv_quant.py) each row is quantized on the way: fp8 codes of the values clamped to
qmax; int8 codes of the values over scale = absmax / qmax per token and head, the scale stored after the codes.
Codes round to nearest even (fp8 encoded with integer bit operations, as the interpreter has no fp8 type); the bytes
equal kv_quant.quantize's.
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor
from tandem.kernels.kv_quant import KV_QUANT_IDS, QMAX, ROW_SCALED, quantize, row_size

# 1.5 * 2^23: (x + RNE_MAGIC) - RNE_MAGIC rounds fp32 |x| < 2^22 to the nearest integer, ties to even (no fast-math
# reassociation in Triton's fp32 adds, so it is not folded away)
RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round_even(x):
    """x (|x| < 2^22, fp32) rounded to the nearest integer, ties to even (as torch.round)."""
    return (x + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def encode_codes(y, KV_QUANT: tl.constexpr):
    """fp32 values y (|y| <= qmax) -> uint8 codes of a quantized KV format (KV_QUANT: 1 fp8 e4m3fn, 2 fp8 e5m2,
    3 int8), rounded to nearest even as torch's casts round. fp8: a normal value's fp32 bits rounded to the
    format's mantissa (add half an ulp less one, plus the kept lowest bit; carries into the exponent), shifted
    down and the exponent rebiased; below the smallest normal, the mantissa is |y| * 2^9 (2^16) rounded."""
    if KV_QUANT == 3:
        code = _round_even(y).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        bits = tl.abs(y).to(tl.int32, bitcast=True)
        sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
        if KV_QUANT == 1:
            rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
            normal = (rounded >> 20) - (120 << 3)
            subnormal = _round_even(tl.abs(y) * 512.0).to(tl.int32)
            em = tl.where(tl.abs(y) < 0.015625, subnormal, normal)  # 2^-6: e4m3's smallest normal
        else:
            rounded = bits + 0xFFFFF + ((bits >> 21) & 1)
            normal = (rounded >> 21) - (112 << 2)
            subnormal = _round_even(tl.abs(y) * 65536.0).to(tl.int32)
            em = tl.where(tl.abs(y) < 0.00006103515625, subnormal, normal)  # 2^-14: e5m2's smallest normal
        code = (em | sign).to(tl.uint8)
    return code


@triton.jit
def _store_quantized(cache_ptr, rows, offs_d, x, mask, mask_h, head_dim, qmax, KV_QUANT: tl.constexpr):
    """Quantize x [H, D] (fp32; masked lanes 0) into the rows starting at cache_ptr + rows [H]: the codes, then
    (int8, KV_QUANT 3) each row's fp32 scale after its head_dim codes."""
    if KV_QUANT == 3:
        scale = tl.max(tl.abs(x), 1) / qmax  # [H]
        x = x / tl.where(scale > 0.0, scale, 1.0)[:, None]
        tl.store((cache_ptr + rows + head_dim).to(tl.pointer_type(tl.float32)), scale, mask=mask_h)
    y = tl.minimum(tl.maximum(x, -qmax), qmax)
    tl.store(cache_ptr + rows[:, None] + offs_d[None, :], encode_codes(y, KV_QUANT), mask=mask)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    block_size, num_kv_heads, head_dim, qmax,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr,
):
    # One program per token: copies its [num_kv_heads, head_dim] key and value rows.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    mask_h = offs_h < num_kv_heads

    src = token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    rows = block_id * stride_kcb + offset * stride_kct + offs_h * stride_kch  # [H] row starts
    if KV_QUANT == 0:
        tl.store(key_cache_ptr + rows[:, None] + offs_d[None, :], tl.load(key_ptr + src, mask=mask), mask=mask)
    else:
        x = tl.load(key_ptr + src, mask=mask, other=0.0).to(tl.float32)
        _store_quantized(key_cache_ptr, rows, offs_d, x, mask, mask_h, head_dim, qmax, KV_QUANT)

    src = token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    rows = block_id * stride_vcb + offset * stride_vct + offs_h * stride_vch
    if KV_QUANT == 0:
        tl.store(value_cache_ptr + rows[:, None] + offs_d[None, :], tl.load(value_ptr + src, mask=mask), mask=mask)
    else:
        x = tl.load(value_ptr + src, mask=mask, other=0.0).to(tl.float32)
        _store_quantized(value_cache_ptr, rows, offs_d, x, mask, mask_h, head_dim, qmax, KV_QUANT)


def _check_args(key, value, key_cache, value_cache, slot_mapping, kv_quant) -> None:
    if kv_quant is not None and kv_quant not in QMAX:
        raise ValueError(f"kv_quant must be one of {list(QMAX)} or None, got {kv_quant!r}")
    cache_dtypes = FLOAT_DTYPES if kv_quant is None else (torch.uint8,)
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_tensor("key_cache", key_cache, 4, cache_dtypes)
    check_tensor("value_cache", value_cache, 4, cache_dtypes)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("key_cache", key_cache, (None, None, num_kv_heads, row_size(head_dim, kv_quant)))
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    dtypes = {key.dtype, value.dtype} | ({key_cache.dtype, value_cache.dtype} if kv_quant is None else set())
    if len(dtypes) != 1:
        raise ValueError(f"key, value, key_cache and value_cache must share one dtype, got {dtypes}")
    if kv_quant in ROW_SCALED and any(s % 4 for s in key_cache.stride()[:3] + value_cache.stride()[:3]):
        raise ValueError(f"a {kv_quant} cache's strides must be multiples of 4 bytes (its fp32 scales are aligned)")
    check_devices(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant: str | None = None,
) -> None:
    """Scatter key/value rows into the block pool, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], fp16/bf16/fp32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype (one layer's pool;
            any strides with a unit last-dim stride, e.g. kv[layer, 0]).
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a slot < 0 skips the token.
        kv_quant: a quantized format (kernels/kv_quant.py): the caches are uint8 [num_blocks, block_size,
            num_kv_heads, row_size] (head_dim; int8's head_dim + 4) and each row is quantized as it is written;
            None: float caches.
    Raises:
        ValueError: on mismatched shapes, dtypes or devices. Slots are not range-checked (that would sync).
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping, kv_quant)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[1], num_kv_heads, head_dim, QMAX.get(kv_quant, 1.0),
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_QUANT=KV_QUANT_IDS[kv_quant],
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant: str | None = None,
) -> None:
    """Plain-torch write_kv_cache: same arguments, same in-place result (quantized by kv_quant.quantize)."""
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_ids, offsets = slots // block_size, slots % block_size
    key, value = key[valid], value[valid]
    if kv_quant is not None:
        key, value = quantize(key, kv_quant), quantize(value, kv_quant)
    key_cache[block_ids, offsets] = key
    value_cache[block_ids, offsets] = value
