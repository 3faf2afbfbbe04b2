"""The engine's CPU attention (shared/attention.py: torch ops, no Triton) against the kernels' pure-torch
references: decode-only batches (the grouped-query reshape), short queries (speculative verification) and mixed
chunked-prefill batches."""
import pytest
import torch

from tandem.kernels.paged_attention import paged_decode_attention_ref
from tandem.kernels.prefill_attention import paged_prefill_attention_ref
from tandem.shared.attention import AttentionMetadata, paged_attention

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM = 64, 4, 3, 9, 16


def make_batch(query_lens: list[int], context_lens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    value_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    width = max(-(-n // BLOCK_SIZE) for n in context_lens)
    # distinct, shuffled block ids per sequence, padded with 0 as the model runner does
    ids = torch.randperm(NUM_BLOCKS, generator=gen)[: width * len(context_lens)].view(len(context_lens), width)
    for i, n in enumerate(context_lens):
        ids[i, -(-n // BLOCK_SIZE):] = 0
    query = torch.randn(sum(query_lens), Q_HEADS, HEAD_DIM, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=starts,
        context_lens=context_lens, block_tables=ids.to(torch.int32),
        query_start_loc_t=torch.tensor(starts, dtype=torch.int32),
        context_lens_t=torch.tensor(context_lens, dtype=torch.int32))
    return query, key_cache, value_cache, meta


@pytest.mark.parametrize("context_lens", [[1], [5, 17, 9], [32, 1, 30, 8, 13]])
def test_cpu_decode_attention_matches_reference(context_lens):
    query, k, v, meta = make_batch([1] * len(context_lens), context_lens)
    expected = paged_decode_attention_ref(query, k, v, meta.block_tables, meta.context_lens_t, 0.25)
    torch.testing.assert_close(paged_attention(query, k, v, meta, 0.25), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens, context_lens", [
    ([7], [7]), ([3, 1, 6], [10, 9, 6]), ([1, 4], [1, 20]),  # short queries: as decode rows in the C++ kernel
    ([5, 5, 1, 3], [40, 9, 17, 3]),  # a speculative verification batch (a token and its drafts per request)
    ([20, 2], [20, 30]), ([17], [50]),  # a longer chunk: the gather + scaled_dot_product_attention path
])  # fmt: skip
def test_cpu_mixed_attention_matches_reference(query_lens, context_lens):
    query, k, v, meta = make_batch(query_lens, context_lens, seed=1)
    expected = paged_prefill_attention_ref(query, k, v, meta.block_tables, meta.query_start_loc_t,
                                           meta.context_lens_t, 0.25)
    torch.testing.assert_close(paged_attention(query, k, v, meta, 0.25), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_quant", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("query_lens, context_lens, dtype", [
    ([1, 1, 1], [5, 17, 9], torch.float32),  # decode: the C++ kernel on the codes
    ([1, 1], [5, 17], torch.float16),  # decode without the kernel: gathered blocks dequantized
    ([3, 1, 6], [10, 9, 6], torch.float32),  # short queries: as decode rows in the C++ kernel
    ([20, 2], [20, 30], torch.float32),  # a longer chunk: per request, gathered blocks dequantized
])  # fmt: skip
def test_cpu_attention_over_quantized_kv_matches_reference(kv_quant, query_lens, context_lens, dtype):
    from tandem.kernels.kv_quant import quantize

    query, k, v, meta = make_batch(query_lens, context_lens, seed=2)
    k, v, query = quantize(k, kv_quant), quantize(v, kv_quant), query.to(dtype)
    meta.kv_quant = kv_quant
    expected = paged_prefill_attention_ref(query, k, v, meta.block_tables, meta.query_start_loc_t,
                                           meta.context_lens_t, 0.25, kv_quant=kv_quant)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(paged_attention(query, k, v, meta, 0.25), expected, atol=tol, rtol=tol)
