"""Write new tokens' keys and values into the paged KV cache (PagedAttention, Kwon et al. 2023).

Each token's key/value row goes to slot = block_id * block_size + offset of one layer's block pool.
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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

    src = token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    dst = block_id * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(key_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)

    src = token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block_id * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(value_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask=mask)


def _check_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("key_cache", key_cache, (None, None, num_kv_heads, head_dim))
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"key, value, key_cache and value_cache must share one dtype, got {dtypes}")
    check_devices(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value rows into the block pool, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], fp16/bf16/fp32.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype (one layer's pool;
            any strides with a unit last-dim stride, e.g. kv[layer, 0]).
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a slot < 0 skips the token.
    Raises:
        ValueError: on mismatched shapes, dtypes or devices. Slots are not range-checked (that would sync).
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch write_kv_cache: same arguments, same in-place result."""
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_ids, offsets = slots // block_size, slots % block_size
    key_cache[block_ids, offsets] = key[valid]
    value_cache[block_ids, offsets] = value[valid]
