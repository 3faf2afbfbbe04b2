"""paged_prefill_attention (Triton; interpreted on CPU, or compiled on CUDA) against paged_prefill_attention_ref."""

import pytest
import torch

from tandem.kernels.paged_attention import paged_decode_attention_ref
from tandem.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

NUM_KV_HEADS = 2


def _batch(block_size):
    """(query_lens, context_lens): whole prompts of edge lengths, a chunk after a cached prefix, and a
    speculative-verification step of 4 tokens."""
    query_lens = [1, block_size - 1, block_size, block_size + 1, 40, 4]
    context_lens = [1, block_size - 1, block_size, block_size + 1, 250, 129]
    return query_lens, context_lens


def _run_both(make_paged_kv, query_lens, context_lens, block_size, queries_per_kv, head_dim, dtype,
              large_block_ids=False, num_kv_heads=NUM_KV_HEADS):
    k, v, tables = make_paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, large_block_ids)
    device = k.device
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(query_lens), num_kv_heads * queries_per_kv, head_dim, generator=gen).to(dtype)
    query = query.to(device)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(query, k, v, tables, query_start_loc, lens, scale)
    ref = paged_prefill_attention_ref(query, k, v, tables, query_start_loc, lens, scale)
    assert out.dtype == dtype and out.shape == query.shape and out.device == query.device
    return out, ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_matches_reference(make_paged_kv, close, queries_per_kv, head_dim, block_size):
    query_lens, context_lens = _batch(block_size)
    out, ref = _run_both(make_paged_kv, query_lens, context_lens, block_size, queries_per_kv, head_dim,
                         torch.float32)
    close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_half_precision(make_paged_kv, close, queries_per_kv, dtype):
    query_lens, context_lens = _batch(16)
    out, ref = _run_both(make_paged_kv, query_lens, context_lens, 16, queries_per_kv, 64, dtype)
    close(out, ref)


def test_sequence_without_queries_is_skipped(make_paged_kv, close):
    # A sequence scheduled for 0 tokens this step sits between two others in the flat batch.
    out, ref = _run_both(make_paged_kv, [5, 0, 40], [5, 10, 80], 16, 3, 64, torch.float32)
    close(out, ref)


def test_large_block_ids(make_paged_kv, close):
    out, ref = _run_both(make_paged_kv, [17, 40], [17, 150], 16, 8, 64, torch.float16, large_block_ids=True,
                         num_kv_heads=1)
    close(out, ref)


def test_single_query_matches_decode_reference(make_paged_kv, close, device):
    lens = [1, 33, 200]
    k, v, tables = make_paged_kv(lens, 16, NUM_KV_HEADS, 64)
    query = torch.randn(3, 6, 64).to(device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=device)
    out = paged_prefill_attention(query, k, v, tables, query_start_loc, context_lens, 0.125)
    close(out, paged_decode_attention_ref(query, k, v, tables, context_lens, 0.125))


def _valid_args(device):
    query = torch.randn(5, 4, 64, device=device)
    cache = torch.randn(4, 16, 2, 64, device=device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    lens = torch.tensor([2, 3], dtype=torch.int32, device=device)
    return [query, cache, cache.clone(), tables, query_start_loc, lens, 0.125]


@pytest.mark.parametrize("index, bad, match", [
    (0, torch.randn(5, 3, 64), "multiple"),
    (0, torch.randn(5, 4, 64, dtype=torch.bfloat16), "dtype"),
    (2, torch.randn(4, 16, 2, 32), "shape"),
    (3, torch.zeros(2, 2, dtype=torch.int64), "int32"),
    (4, torch.tensor([0, 5], dtype=torch.int32), "shape"),
    (4, torch.tensor([0, 2, 5], dtype=torch.int64), "int32"),
    (5, torch.tensor([2, 3, 1], dtype=torch.int32), "shape"),
])
def test_bad_arguments_raise(device, on_device, index, bad, match):
    args = _valid_args(device)
    args[index] = on_device(bad)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(*args)


@pytest.mark.parametrize("kv_quant", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype, window", [(torch.float32, None), (torch.bfloat16, 24)], ids=str)
def test_quantized_kv_matches_reference(make_paged_kv, close, device, kv_quant, dtype, window):
    """A quantized cache (kernels/kv_quant.py) read in place against the reference, which dequantizes it."""
    from tandem.kernels.kv_quant import quantize

    query_lens, context_lens = [1, 17, 40, 4], [1, 17, 130, 70]
    k, v, tables = make_paged_kv(context_lens, 16, NUM_KV_HEADS, 64)
    qk, qv = quantize(k, kv_quant), quantize(v, kv_quant)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * 3, 64, generator=gen).to(dtype).to(device)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    out = paged_prefill_attention(query, qk, qv, tables, starts, lens, 0.125, window=window, kv_quant=kv_quant)
    close(out, paged_prefill_attention_ref(query, qk, qv, tables, starts, lens, 0.125, window, kv_quant=kv_quant))
