"""Sliding-window attention and score soft-capping in every attention kernel: the Triton decode and prefill
kernels (interpreted on CPU, compiled with TANDEM_KERNEL_DEVICE=cuda), the C++ CPU decode kernel and the engine's
torch paths (shared/attention.py) against the pure-torch references; the references' mask against HF's. Blocks
wholly before a sequence's window are poisoned with NaN, so a kernel that reads one fails (the engine frees them)."""
import pytest
import torch

from tandem.kernels import cpu_attention, cpu_ext
from tandem.kernels.masks import causal_mask
from tandem.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from tandem.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tandem.shared.attention import AttentionMetadata, paged_attention

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 2, 64
# (query_lens, context_lens): prompts longer than the window, a chunk after a prefix, decode rows, drafts
QUERY_LENS = [1, 1, 40, 4, 70, 1]
CONTEXT_LENS = [1, 20, 250, 129, 70, 300]


def make(query_lens, context_lens, window, dtype, device, queries_per_kv=3, seed=0):
    """(query, key_cache, value_cache, clean block tables, poisoned block tables, query_start_loc, context_lens):
    the poisoned tables point every block wholly before a sequence's first query row's window at a NaN block."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(widths) + 1
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    k[-1], v[-1] = float("nan"), float("nan")  # the poison block
    ids = torch.randperm(num_blocks - 1, generator=gen)
    clean = torch.zeros(len(context_lens), max(widths) + 1, dtype=torch.int32)
    poisoned = clean.clone()
    start = 0
    for i, (q, n, w) in enumerate(zip(query_lens, context_lens, widths)):
        clean[i, :w] = poisoned[i, :w] = ids[start:start + w].int()
        start += w
        poisoned[i, : max(0, n - q - window + 1) // BLOCK_SIZE] = num_blocks - 1
    query = torch.randn(sum(query_lens), KV_HEADS * queries_per_kv, HEAD_DIM, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    on = lambda t: t.to(device)  # noqa: E731
    return (on(query.to(dtype)), on(k.to(dtype)), on(v.to(dtype)), on(clean), on(poisoned), on(starts),
            on(torch.tensor(context_lens, dtype=torch.int32)))


def test_mask_is_hf_sliding_window_mask():
    from transformers.masking_utils import sliding_window_causal_mask_function

    hf = sliding_window_causal_mask_function(5)
    q_pos = torch.arange(3, 20)
    expected = torch.tensor([[bool(hf(0, 0, q, k)) for k in torch.arange(20)] for q in q_pos])
    assert causal_mask(q_pos, 20, 5).equal(expected)
    assert causal_mask(q_pos, 20, 5).sum(1).max() == 5


@pytest.mark.parametrize("window, softcap", [(17, None), (64, 5.0), (None, 2.0), (1, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_prefill(device, close, window, softcap, dtype):
    query, k, v, clean, poisoned, starts, lens = make(QUERY_LENS, CONTEXT_LENS, window or 10**6, dtype, device)
    out = paged_prefill_attention(query, k, v, poisoned, starts, lens, 0.125, window=window, softcap=softcap)
    close(out, paged_prefill_attention_ref(query, k, v, clean, starts, lens, 0.125, window, softcap))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window, softcap", [(17, None), (100, 5.0), (None, 2.0)])
def test_triton_decode(device, close, window, softcap, num_splits):
    ones = [1] * len(CONTEXT_LENS)
    query, k, v, clean, poisoned, _, lens = make(ones, CONTEXT_LENS, window or 10**6, torch.float32, device)
    out = paged_decode_attention(query, k, v, poisoned, lens, 0.125, num_splits=num_splits, window=window,
                                 softcap=softcap)
    close(out, paged_decode_attention_ref(query, k, v, clean, lens, 0.125, window, softcap))


@pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels need AVX2 and a C++ compiler")
@pytest.mark.parametrize("window, softcap", [(17, None), (100, 5.0), (None, 2.0), (1, 30.0)])
def test_cpu_kernel_decode(window, softcap):
    ones = [1] * len(CONTEXT_LENS)
    query, k, v, clean, poisoned, _, lens = make(ones, CONTEXT_LENS, window or 10**6, torch.float32, "cpu")
    out = cpu_attention.paged_decode_attention(query, k, v, poisoned, lens, 0.125, window, softcap)
    torch.testing.assert_close(out, paged_decode_attention_ref(query, k, v, clean, lens, 0.125, window, softcap),
                               atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("query_lens, context_lens", [
    ([1] * 6, CONTEXT_LENS),  # decode: the C++ kernel (fp32) or the padded batch
    ([3, 1, 6, 16], [40, 9, 6, 200]),  # short queries: rows of the C++ kernel
    (QUERY_LENS, CONTEXT_LENS),  # the per-request gather
])  # fmt: skip
@pytest.mark.parametrize("window, softcap", [(17, None), (30, 5.0), (None, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_cpu_paths(query_lens, context_lens, window, softcap, dtype):
    query, k, v, clean, poisoned, starts, lens = make(query_lens, context_lens, window or 10**6, dtype, "cpu", seed=2)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(query), dtype=torch.int64), query_start_loc=starts.tolist(),
                             context_lens=context_lens, block_tables=poisoned, query_start_loc_t=starts,
                             context_lens_t=lens)
    expected = paged_prefill_attention_ref(query, k, v, clean, starts, lens, 0.125, window, softcap)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(paged_attention(query, k, v, meta, 0.125, window, softcap), expected, **tolerance)
