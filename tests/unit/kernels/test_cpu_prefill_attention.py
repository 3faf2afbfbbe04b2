"""The C++ paged prefill attention (kernels/cpu/prefill_attention.cpp) against its pure-torch reference
paged_prefill_attention_ref: chunks whose lengths are not multiples of the kernel's tiles, cached prefixes before
the chunk (chunked prefill, prefix hits), several sequences in one batch (decode rows among them), GQA ratios,
head sizes, sliding windows and soft-capping, fp32 and bf16, on 1 and 2 kernel threads; the argument checks; the
AVX2 build."""
import pytest
import torch

from tandem.kernels import cpu_ext, cpu_prefill_attention
from tandem.kernels.cpu_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.unit.kernels.bf16 import bf16_ulps

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels need AVX2 and a C++ compiler")


def make(query_lens, prefix_lens, q_heads, kv_heads, head_dim, block_size=16, seed=0, spread=1.0,
         dtype=torch.float32):
    """A batch of sequences with query_lens[s] new rows after prefix_lens[s] cached tokens, on shuffled blocks
    (the padding of each block table 0, as the model runner writes it)."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
    width = max(1, max(-(-n // block_size) for n in context_lens))
    num_blocks = width * len(context_lens) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * spread
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)[: width * len(context_lens)].view(len(context_lens), width)
    for i, n in enumerate(context_lens):
        ids[i, -(-n // block_size):] = 0
    query = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen) * spread
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), ids.to(torch.int32), starts,
            torch.tensor(context_lens, dtype=torch.int32))




BATCHES = [  # (query_lens, prefix_lens)
    ([1], [0]),
    ([37], [0]),  # one tile of positions, not a whole key tile
    ([200], [0]),  # several position blocks and key tiles, ragged ends
    ([64], [129]),  # a chunk after a cached prefix (chunked prefill)
    ([130, 1, 17, 5], [0, 40, 300, 16]),  # a mixed batch: prefills, a decode row, a prefix hit
]


@pytest.mark.parametrize("query_lens, prefix_lens", BATCHES)
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (6, 2, 80)])
def test_fp32_matches_reference(query_lens, prefix_lens, q_heads, kv_heads, head_dim, kernel_threads):
    args = make(query_lens, prefix_lens, q_heads, kv_heads, head_dim)
    expected = paged_prefill_attention_ref(*args, head_dim**-0.5)
    torch.testing.assert_close(paged_prefill_attention(*args, head_dim**-0.5), expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("query_lens, prefix_lens", BATCHES[1:])
@pytest.mark.parametrize("window, softcap", [(1, None), (20, None), (100, None), (None, 5.0), (33, 30.0)])
def test_window_and_softcap_match_reference(query_lens, prefix_lens, window, softcap, kernel_threads):
    """A sliding window (1: each row sees only itself; windows shorter and longer than a key tile) and Gemma 2's
    soft-capping, alone and together; spread 3 puts scores where the cap bends them."""
    args = make(query_lens, prefix_lens, 8, 2, 64, spread=3.0)
    expected = paged_prefill_attention_ref(*args, 0.125, window, softcap)
    torch.testing.assert_close(paged_prefill_attention(*args, 0.125, window, softcap), expected, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("query_lens, prefix_lens", BATCHES)
@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 5.0)])
def test_bf16_within_one_ulp_of_reference(query_lens, prefix_lens, window, softcap, kernel_threads):
    """bf16 query and cache, fp32 scores, softmax and sums, the output rounded once: within one bf16 ulp of the
    reference (fp32 math, then bf16), or within fp32 rounding of it where a sum nearly cancels."""
    args = make(query_lens, prefix_lens, 9, 3, 64, spread=3.0, dtype=torch.bfloat16)
    expected = paged_prefill_attention_ref(*args, 0.125, window, softcap)
    out = paged_prefill_attention(*args, 0.125, window, softcap)
    assert out.dtype == torch.bfloat16
    far = (bf16_ulps(out, expected) > 1) & ((out.float() - expected.float()).abs() > 2e-6)
    assert not far.any(), (out[far], expected[far])


def test_long_context_and_large_block_ids(kernel_threads):
    """A 1,024-token chunk after a 1,000-token prefix (the exp of scores far below the running max, many
    rescalings) on blocks with ids spread over a large cache."""
    args = make([1024], [1000], 9, 3, 64, block_size=16, seed=3)
    expected = paged_prefill_attention_ref(*args, 0.125)
    torch.testing.assert_close(paged_prefill_attention(*args, 0.125), expected, atol=2e-6, rtol=2e-5)


def test_refuses_bad_arguments():
    query, key_cache, value_cache, tables, starts, lens = make([10], [0], 4, 2, 32)
    assert cpu_prefill_attention.supports(query, key_cache)
    assert not cpu_prefill_attention.supports(query, key_cache.bfloat16())
    assert not cpu_prefill_attention.supports(query, key_cache, "int8")
    assert not cpu_prefill_attention.supports(query[..., :24], key_cache[..., :24])
    with pytest.raises(RuntimeError, match="one dtype"):
        paged_prefill_attention(query, key_cache.bfloat16(), value_cache.bfloat16(), tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="query rows but a context"):
        paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens - 1, 1.0)
    with pytest.raises(RuntimeError, match="exceed the block table"):
        paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens + 100, 1.0)
    with pytest.raises(RuntimeError, match="block id outside"):
        paged_prefill_attention(query, key_cache, value_cache, tables + 1000, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="from 0 to the query's rows"):
        paged_prefill_attention(query[:5], key_cache, value_cache, tables, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        paged_prefill_attention(query[:, :3], key_cache, value_cache, tables, starts, lens, 1.0)


@pytest.mark.heavy  # (a second build of the whole extension: about a minute of gcc)
def test_avx2_build_matches_reference_too():
    """Built for AVX2 + FMA alone (TANDEM_CPU_ARCH=x86-64-v3, as the Docker image builds it: 8 lanes, other
    micro-tile shapes)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TANDEM_CPU_ARCH="x86-64-v3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not avx2"], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
