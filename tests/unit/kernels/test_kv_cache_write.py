"""write_kv_cache (Triton; interpreted on CPU, or compiled on CUDA) against write_kv_cache_ref: both must
write the same slots."""

import pytest
import torch

from tandem.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from tandem.kernels.kv_quant import row_size


def _tokens(num_tokens, num_kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return key.to(device), value.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 64), (3, 64), (2, 128), (5, 80)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(device, block_size, num_kv_heads, head_dim, dtype):
    num_blocks = 6
    key, value = _tokens(9, num_kv_heads, head_dim, dtype, device)
    # Block starts and ends, the last slot of the pool, and two padding tokens.
    slots = torch.tensor([0, block_size - 1, block_size, -1, 3 * block_size + 5, num_blocks * block_size - 1,
                          2 * block_size + 1, -1, 4 * block_size], dtype=torch.int64, device=device)
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    key_ref, value_ref = key_cache.clone(), value_cache.clone()
    write_kv_cache(key, value, key_cache, value_cache, slots)
    write_kv_cache_ref(key, value, key_ref, value_ref, slots)
    assert torch.equal(key_cache, key_ref) and torch.equal(value_cache, value_ref)
    assert torch.equal(key_cache[0, block_size - 1], key[1])
    assert torch.equal(value_cache[3, 5], value[4])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 7  # the padding tokens wrote nothing


def test_strided_layer_view_of_pool(device):
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    pool = torch.zeros(2, 2, 4, 16, 3, 64, device=device)
    ref = pool.clone()
    key, value = _tokens(5, 3, 64, torch.float32, device)
    slots = torch.tensor([17, 3, 63, -1, 40], device=device)
    write_kv_cache(key, value, pool[1, 0], pool[1, 1], slots)
    write_kv_cache_ref(key, value, ref[1, 0], ref[1, 1], slots)
    assert torch.equal(pool, ref)
    assert torch.all(pool[0] == 0)


def test_large_block_ids(device):
    # Slots beyond 2**31 elements: int32 offset arithmetic would wrap. torch.empty keeps this virtual on CPU;
    # on CUDA it is 4 GiB per cache.
    num_blocks, block_size = 2**21 + 8, 16
    key_cache = torch.empty(num_blocks, block_size, 1, 64, dtype=torch.float16, device=device)
    value_cache = torch.empty_like(key_cache)
    key, value = _tokens(3, 1, 64, torch.float16, device)
    blocks = torch.tensor([num_blocks - 1, 2**21 + 3, 70000], device=device)
    offsets = torch.tensor([15, 0, 7], device=device)
    write_kv_cache(key, value, key_cache, value_cache, blocks * block_size + offsets)
    assert torch.equal(key_cache[blocks, offsets], key)
    assert torch.equal(value_cache[blocks, offsets], value)


def test_no_tokens_is_a_no_op(device):
    cache = torch.zeros(2, 16, 1, 64, device=device)
    empty = torch.empty(0, 1, 64, device=device)
    write_kv_cache(empty, empty.clone(), cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=device))
    assert torch.all(cache == 0)


def _valid_args(device):
    key, value = _tokens(3, 2, 64, torch.float32, device)
    cache = torch.zeros(4, 16, 2, 64, device=device)
    return [key, value, cache, cache.clone(), torch.tensor([0, 1, 2], device=device)]


@pytest.mark.parametrize("index, bad, match", [
    (0, torch.randn(3, 2, 32), "shape"),
    (1, torch.randn(3, 2, 64, dtype=torch.float16), "dtype"),
    (2, torch.zeros(4, 16, 3, 64), "shape"),
    (3, torch.zeros(4, 16, 2, 64, dtype=torch.float16), "dtype"),
    (4, torch.tensor([0, 1, 2], dtype=torch.int32), "int64"),
    (4, torch.tensor([0, 1]), "shape"),
    (0, torch.randn(3, 2, 128)[:, :, ::2], "stride"),
])
def test_bad_arguments_raise(device, on_device, index, bad, match):
    args = _valid_args(device)
    args[index] = on_device(bad)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(*args)


@pytest.mark.parametrize("kv_quant", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_write_matches_reference_byte_for_byte(device, kv_quant, dtype):
    """Quantized on write (kernels/kv_quant.py): the same codes (and int8's scales) as kv_quant.quantize, bit for
    bit, for rows spanning fp8's subnormals, values past fp8's qmax (saturated), rounding ties and an all-zero row; a
    layer view of a packed pool."""
    num_kv_heads, head_dim, block_size = 3, 64, 16
    key, value = _tokens(6, num_kv_heads, head_dim, dtype, device)
    key[0, 0] = 0  # codes 0 (int8: scale 0)
    key[1] *= torch.logspace(-6, 0, head_dim, device=device).to(dtype)  # fp8 subnormals
    value[3] *= 1e5  # past e4m3's 448 (and int8's rows: one large scale)
    value[2, 1] = torch.arange(head_dim, device=device).to(dtype) - 31.5  # int8 ties (x.5 * 127 / 32.5 ...)
    pool = torch.zeros(2, 2, 4, block_size, num_kv_heads, row_size(head_dim, kv_quant), dtype=torch.uint8,
                       device=device)
    ref = pool.clone()
    slots = torch.tensor([17, 3, 63, -1, 40, 0], device=device)
    write_kv_cache(key, value, pool[1, 0], pool[1, 1], slots, kv_quant=kv_quant)
    write_kv_cache_ref(key, value, ref[1, 0], ref[1, 1], slots, kv_quant=kv_quant)
    assert torch.equal(pool, ref)
    assert torch.all(pool[0] == 0) and torch.all(pool[1, 0, 1, 1, 0] == 0)  # (slot 17: the zero row)


def test_quantized_write_refuses_a_float_cache(device):
    key, value = _tokens(2, 1, 64, torch.float32, device)
    cache = torch.zeros(2, 16, 1, 68, device=device)
    with pytest.raises(ValueError, match="key_cache dtype"):
        write_kv_cache(key, value, cache, cache.clone(), torch.tensor([0, 1], device=device), kv_quant="int8")
