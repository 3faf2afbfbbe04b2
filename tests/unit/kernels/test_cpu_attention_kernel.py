"""The C++ paged decode attention (kernels/cpu/attention.cpp) against the pure-torch reference
paged_decode_attention_ref: shuffled block tables, contexts across block boundaries, empty contexts, GQA groups,
head sizes, long contexts (the exp over scores far below the max), bf16 query and cache (fp32 math inside, within
one bf16 ulp of the reference's fp32 math rounded once), and the AVX2 build."""
import pytest
import torch

from tandem.kernels import cpu_attention, cpu_ext
from tandem.kernels.paged_attention import paged_decode_attention_ref
from tests.unit.kernels.bf16 import bf16_ulps

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels need AVX2 and a C++ compiler")


def make(context_lens, q_heads, kv_heads, head_dim, block_size=16, num_blocks=None, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // block_size) for n in context_lens))
    num_blocks = num_blocks or width * len(context_lens) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * spread
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)[: width * len(context_lens)].view(len(context_lens), width)
    for i, n in enumerate(context_lens):
        ids[i, -(-n // block_size):] = 0  # padding, as the model runner writes it
    query = torch.randn(len(context_lens), q_heads, head_dim, generator=gen)
    return query, key_cache, value_cache, ids.to(torch.int32), torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("context_lens", [[1], [15, 16, 17], [0, 5, 0], [33, 1, 64, 8, 100, 2]])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (6, 2, 32)])
def test_matches_reference(context_lens, q_heads, kv_heads, head_dim):
    args = make(context_lens, q_heads, kv_heads, head_dim)
    expected = paged_decode_attention_ref(*args, head_dim**-0.5)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(*args, head_dim**-0.5), expected,
                               atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("context_lens", [[1], [15, 16, 17], [0, 5, 0], [33, 1, 64, 8, 100, 2]])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (8, 1, 128), (6, 2, 32)])
@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 5.0)])
def test_bf16_within_one_ulp_of_reference(context_lens, q_heads, kv_heads, head_dim, window, softcap):
    """bf16 query and cache, fp32 scores, softmax and sums, the output rounded once: within one bf16 ulp of the
    reference (fp32 math, then bf16), or within fp32 rounding of it where a sum nearly cancels."""
    query, *rest = make(context_lens, q_heads, kv_heads, head_dim, spread=3.0)
    args = (query.bfloat16(), rest[0].bfloat16(), rest[1].bfloat16(), *rest[2:])
    expected = paged_decode_attention_ref(*args, head_dim**-0.5, window, softcap)
    out = cpu_attention.paged_decode_attention(*args, head_dim**-0.5, window, softcap)
    assert out.dtype == torch.bfloat16
    far = (bf16_ulps(out, expected) > 1) & ((out.float() - expected.float()).abs() > 2e-6)
    assert not far.any(), (out[far], expected[far])
    assert cpu_attention.supports(args[0], args[1]) and not cpu_attention.supports(args[0], args[1].float())
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.paged_decode_attention(args[0], args[1].float(), args[2].float(), *rest[2:], 1.0)


def attention_float64(query, key_cache, value_cache, block_tables, context_lens, scale):
    out = torch.zeros_like(query, dtype=torch.float64)
    group = query.shape[1] // key_cache.shape[2]
    for i, n in enumerate(context_lens.tolist()):
        k = key_cache[block_tables[i].long()].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        v = value_cache[block_tables[i].long()].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,nhd->hn", query[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


def test_long_context_and_peaked_scores():
    """2,000 tokens with large logits (most e^(s - max) underflow): no NaN, and no further from the float64
    answer than the fp32 reference is (its rounding differs: sums in another order)."""
    args = make([2000, 700], 9, 3, 64, spread=8.0, seed=3)
    out = cpu_attention.paged_decode_attention(*args, 0.125)
    assert torch.isfinite(out).all()
    exact = attention_float64(*args, 0.125)
    ref_error = (paged_decode_attention_ref(*args, 0.125).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * ref_error + 1e-6


def test_bad_arguments_raise():
    query, k, v, tables, lens = make([5], 9, 3, 64)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_attention.paged_decode_attention(query, k, v, tables, torch.tensor([10_000], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_attention.paged_decode_attention(query[:, :8], k, v, tables, lens, 1.0)
    assert not cpu_attention.supports(query.double(), k.double())


def test_bad_block_ids_and_zero_kv_heads_raise():
    query, key_cache, value_cache, tables, lens = make([16, 3], 4, 2, 16)
    for bad in (key_cache.shape[0], -5, 2**30):
        wrong = tables.clone()
        wrong[1, 0] = bad
        with pytest.raises(RuntimeError, match="block id"):
            cpu_attention.paged_decode_attention(query, key_cache, value_cache, wrong, lens, 0.25)
    empty = torch.zeros(4, 16, 0, 16)
    with pytest.raises(RuntimeError, match="KV heads"):
        cpu_attention.paged_decode_attention(query, empty, empty.clone(), tables, lens, 0.25)


@pytest.mark.heavy  # (a second build of the whole extension: about a minute of gcc)
def test_avx2_build_matches_reference_too():
    """Built for AVX2 + FMA alone (TANDEM_CPU_ARCH=x86-64-v3, as the Docker image builds it)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TANDEM_CPU_ARCH="x86-64-v3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "test_matches_reference or long_context or bf16 or quantized"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("kv_quant", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype, window, softcap", [(torch.float32, None, None), (torch.float32, 20, 5.0),
                                                    (torch.bfloat16, None, None)], ids=str)
def test_quantized_kv_matches_reference(kv_quant, dtype, window, softcap):
    """Quantized caches (uint8 rows of codes, int8's + fp32 scale) read in place, the fp8 codes decoded by bit
    manipulation, against the reference that dequantizes them; subnormal and negative codes included (the keys
    spread over 2^-12 .. 2^4 of their row's absmax)."""
    from tandem.kernels.kv_quant import quantize

    query, k, v, tables, lens = make([1, 15, 16, 17, 0, 100], 9, 3, 64, spread=3.0)
    k = k * torch.logspace(-12, 0, 64, base=2.0)
    qk, qv = quantize(k, kv_quant), quantize(v, kv_quant)
    query = query.to(dtype)
    expected = paged_decode_attention_ref(query, qk, qv, tables, lens, 0.125, window, softcap, kv_quant)
    out = cpu_attention.paged_decode_attention(query, qk, qv, tables, lens, 0.125, window, softcap, kv_quant)
    assert out.dtype == dtype and cpu_attention.supports(query, qk, kv_quant)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    else:
        assert bf16_ulps(out, expected).max() <= 1
