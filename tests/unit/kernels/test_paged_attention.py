"""paged_decode_attention (Triton; interpreted on CPU, or compiled on CUDA) against paged_decode_attention_ref."""

import pytest
import torch

from tandem.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

NUM_KV_HEADS = 2


def _query(num_seqs, num_q_heads, head_dim, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, num_q_heads, head_dim, generator=gen).to(dtype).to(device)


def _context_lens(block_size):
    return [1, block_size - 1, block_size, block_size + 1, 300]


def _run_both(query, key_cache, value_cache, block_tables, context_lens, **kwargs):
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=query.device)
    scale = query.shape[-1] ** -0.5
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, **kwargs)
    ref = paged_decode_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale)
    return out, ref


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_matches_reference(make_paged_kv, close, device, queries_per_kv, head_dim, block_size, dtype):
    lens = _context_lens(block_size)
    k, v, tables = make_paged_kv(lens, block_size, NUM_KV_HEADS, head_dim, dtype)
    query = _query(len(lens), NUM_KV_HEADS * queries_per_kv, head_dim, dtype, device)
    out, ref = _run_both(query, k, v, tables, lens)
    assert out.dtype == dtype and out.shape == query.shape and out.device == query.device
    close(out, ref)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_context_matches_reference(make_paged_kv, close, device, num_splits):
    # Short contexts leave later splits empty; the 0-length context must give zeros, not NaN.
    lens = [0, 1, 17, 130, 300]
    k, v, tables = make_paged_kv(lens, 16, NUM_KV_HEADS, 64)
    query = _query(len(lens), NUM_KV_HEADS * 3, 64, torch.float32, device)
    out, ref = _run_both(query, k, v, tables, lens, num_splits=num_splits)
    close(out, ref)
    assert torch.all(out[0] == 0)


def test_large_block_ids(make_paged_kv, close, device):
    lens = [15, 33, 200]
    k, v, tables = make_paged_kv(lens, 16, 1, 64, torch.float16, large_block_ids=True)
    assert int(tables.max()) > 2**21
    query = _query(len(lens), 8, 64, torch.float16, device)
    out, ref = _run_both(query, k, v, tables, lens, num_splits=2)
    close(out, ref)


def test_strided_layer_view_of_pool(close, device):
    # The engine passes kv[layer, 0] and kv[layer, 1] of a [num_layers, 2, num_blocks, ...] pool.
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(3, 2, 8, 16, 2, 64, generator=gen).to(device)
    tables = torch.tensor([[5, 1, 7], [0, 2, 3]], dtype=torch.int32, device=device)
    query = _query(2, 6, 64, torch.float32, device)
    out, ref = _run_both(query, pool[1, 0], pool[1, 1], tables, [40, 9])
    close(out, ref)


def _valid_args(device):
    query = torch.randn(2, 4, 64, device=device)
    cache = torch.randn(4, 16, 2, 64, device=device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    return [query, cache, cache.clone(), tables, lens, 0.125]


@pytest.mark.parametrize("index, bad, match", [
    (0, torch.randn(2, 4, 32), "head_dim|shape"),  # head_dim differs from the cache
    (0, torch.randn(2, 3, 64), "multiple"),  # 3 query heads over 2 kv heads
    (0, torch.randn(2, 4, 64, dtype=torch.float16), "dtype"),
    (0, torch.randn(2, 4, 128)[:, :, ::2], "stride"),
    (3, torch.zeros(2, 2, dtype=torch.int64), "int32"),
    (3, torch.zeros(3, 2, dtype=torch.int32), "shape"),
    (4, torch.ones(3, dtype=torch.int32), "shape"),
    (1, torch.randn(4, 16, 64), "dims"),
])
def test_bad_arguments_raise(device, on_device, index, bad, match):
    args = _valid_args(device)
    args[index] = on_device(bad)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(*args)


def test_cpu_without_interpreter_raises(monkeypatch):
    # CPU tensors on purpose, whatever TANDEM_KERNEL_DEVICE says: without the interpreter they must be refused.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        paged_decode_attention(*_valid_args(torch.device("cpu")))



KV_QUANTS = ["fp8_e4m3", "fp8_e5m2", "int8"]
# (atol, rtol) of attention over quantized against float KV: half an fp8 ulp is 2^-4 (e4m3) or 2^-3 (e5m2) of a
# value, plus the scores' error in a weighted mean; int8's is at most absmax / 254 of a row
QUANT_ERROR = {"fp8_e4m3": (0.05, 0.07), "fp8_e5m2": (0.2, 0.13), "int8": (0.03, 0.0)}


@pytest.mark.parametrize("kv_quant", KV_QUANTS)
@pytest.mark.parametrize("dtype, window, softcap", [(torch.float32, None, None), (torch.bfloat16, 20, 30.0)], ids=str)
def test_quantized_kv_matches_reference(make_paged_kv, close, device, kv_quant, dtype, window, softcap):
    """A quantized cache (uint8 rows of codes + fp32 scale) read in place against the reference, which dequantizes;
    both near the attention over the float values (the quantization error alone)."""
    from tandem.kernels.kv_quant import quantize

    lens = [0, 1, 17, 130, 300]
    k, v, tables = make_paged_kv(lens, 16, NUM_KV_HEADS, 64)
    qk, qv = quantize(k, kv_quant), quantize(v, kv_quant)
    query = _query(len(lens), NUM_KV_HEADS * 3, 64, dtype, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(query, qk, qv, tables, context_lens, 0.125, num_splits=2, window=window,
                                 softcap=softcap, kv_quant=kv_quant)
    ref = paged_decode_attention_ref(query, qk, qv, tables, context_lens, 0.125, window, softcap, kv_quant)
    close(out, ref)
    exact = paged_decode_attention_ref(query, k, v, tables, context_lens, 0.125, window, softcap)
    atol, rtol = QUANT_ERROR[kv_quant]
    torch.testing.assert_close(ref.float(), exact.float(), atol=atol, rtol=rtol)


def test_quantized_kv_large_block_ids(make_paged_kv, close, device):
    from tandem.kernels.kv_quant import quantize

    lens = [15, 200]
    k, v, tables = make_paged_kv(lens, 16, 1, 64, torch.float16, large_block_ids=True)
    rows = tables[tables > 0].long().unique()  # (only the blocks in use: the rest of the caches stays virtual)
    qk = torch.empty(*k.shape[:3], 68, dtype=torch.uint8, device=device)
    qv = torch.empty_like(qk)
    qk[rows], qv[rows] = quantize(k[rows], "int8"), quantize(v[rows], "int8")
    query = _query(len(lens), 4, 64, torch.float32, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(query, qk, qv, tables, context_lens, 0.125, num_splits=2, kv_quant="int8")
    close(out, paged_decode_attention_ref(query, qk, qv, tables, context_lens, 0.125, kv_quant="int8"))


def test_quantized_kv_refuses_a_cache_without_scales(device):
    query, cache, _, tables, lens, scale = _valid_args(device)
    codes = torch.zeros(*cache.shape, dtype=torch.uint8, device=device)  # rows of head_dim: no room for the scale
    with pytest.raises(ValueError, match="key_cache must have shape"):
        paged_decode_attention(query, codes, codes.clone(), tables, lens, scale, kv_quant="int8")
    scaled = torch.zeros(*cache.shape[:3], cache.shape[3] + 4, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="key_cache must have shape"):  # (fp8 rows are the codes alone)
        paged_decode_attention(query, scaled, scaled.clone(), tables, lens, scale, kv_quant="fp8_e4m3")
