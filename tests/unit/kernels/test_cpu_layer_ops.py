"""The C++ elementwise layer ops (kernels/cpu/layer_ops.cpp) against their pure-torch references in
kernels/cpu_layer_ops.py: RMSNorm alone and fused with the residual add (in place), RoPE with the KV-cache write
(exact: the same products and sums as torch), SiLU-and-mul over the whole range of its exp; in fp32 and in bf16
(within one bf16 ulp where the roundings may differ, the order of a sum or an e^x; exact where they must not: the
residual add, RoPE, and the bf16 rounding itself at ties, subnormals and overflow); widths that are not multiples
of the SIMD width (the scalar tails); bad arguments; and the AVX2 build."""
import pytest
import torch

from tandem.kernels import cpu_ext
from tandem.kernels import cpu_layer_ops as ops
from tests.unit.kernels.bf16 import bf16_ulps

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels need AVX2 and a C++ compiler")


def randn(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("tokens, hidden", [(1, 576), (7, 64), (33, 2048), (2, 37)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rms_norm_matches_reference(tokens, hidden, scale):
    x, w = randn(tokens, hidden, scale=scale), randn(hidden, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5), atol=0, rtol=3e-6)


def test_fused_add_rms_norm_updates_both_in_place():
    x, residual, w = randn(5, 576), randn(5, 576, seed=1), randn(576, seed=2)
    expected_x, expected_residual = ops.fused_add_rms_norm_ref(x, residual, w, 1e-5)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    out_x, out_residual = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    assert out_x.data_ptr() == x_ptr and out_residual.data_ptr() == residual_ptr
    assert torch.equal(out_residual, expected_residual)  # the add is one rounding either way
    torch.testing.assert_close(out_x, expected_x, atol=0, rtol=3e-6)


@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim",
                         [(1, 9, 3, 64), (6, 4, 4, 32), (17, 8, 1, 128), (3, 2, 1, 8), (2, 4, 2, 54)])
def test_rope_write_kv_equals_reference(tokens, q_heads, kv_heads, head_dim):
    num_blocks, block_size = 9, 4
    qkv = randn(tokens, q_heads + 2 * kv_heads, head_dim)
    positions = torch.randperm(500)[:tokens].float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    caches = [randn(num_blocks, block_size, kv_heads, head_dim, seed=s) for s in (1, 2)]
    expected_caches = [c.clone() for c in caches]
    expected_q = ops.rope_write_kv_ref(qkv, cos, sin, *expected_caches, slots, q_heads)
    q = ops.rope_write_kv(qkv, cos, sin, *caches, slots, q_heads)
    assert torch.equal(q, expected_q)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])
    with pytest.raises(RuntimeError, match="slot"):
        ops.rope_write_kv(qkv, cos, sin, *caches, torch.full_like(slots, num_blocks * block_size), q_heads)


@pytest.mark.parametrize("tokens, inter", [(1, 1536), (5, 16), (3, 4096), (2, 21)])
def test_silu_and_mul_matches_reference(tokens, inter):
    gate_up = randn(tokens, 2 * inter, scale=8.0)
    gate_up[0, :4] = torch.tensor([-100.0, -87.5, 60.0, 0.0])  # the exp's clamps, and silu(0) = 0
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ops.silu_and_mul_ref(gate_up), atol=1e-30, rtol=2e-6)


def test_bad_arguments_raise():
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(randn(2, 64), randn(32), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_and_mul(randn(2, 64).double())
    with pytest.raises(RuntimeError, match="residual"):
        ops.fused_add_rms_norm(randn(2, 64), randn(3, 64), randn(64), 1e-5)
    x = randn(4, 64)
    with pytest.raises(RuntimeError, match="overlap"):
        ops.fused_add_rms_norm(x, x, randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="overlap"):
        ops.fused_add_rms_norm(x.view(-1)[:128].view(2, 64), x.view(-1)[64:192].view(2, 64), randn(64), 1e-5)


def test_silu_and_mul_treats_every_column_alike_at_infinities():
    gate_up = torch.zeros(1, 2 * 40)
    gate_up[0, 40:] = 1.0
    gate_up[0, [0, 19, 39]] = float("-inf")  # a vector lane and scalar-tail lanes (AVX2 and AVX-512 widths)
    out = ops.silu_and_mul(gate_up)[0]
    assert out[0].item() == out[19].item() == out[39].item() == float("-inf")


@pytest.mark.parametrize("tokens, hidden", [(1, 576), (7, 64), (33, 2048), (2, 37)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rms_norm_bf16_within_one_ulp_of_reference(tokens, hidden, scale):
    """HF LlamaRMSNorm in bf16: normalized in fp32, rounded, times the bf16 weight, rounded again."""
    x, w = randn(tokens, hidden, scale=scale, dtype=torch.bfloat16), randn(hidden, seed=1, dtype=torch.bfloat16)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    assert bf16_ulps(out, ops.rms_norm_ref(x, w, 1e-5)).max().item() <= 1


def test_fused_add_rms_norm_bf16_rounds_the_sum_then_norms():
    x, residual = randn(5, 576, dtype=torch.bfloat16), randn(5, 576, seed=1, dtype=torch.bfloat16)
    w = randn(576, seed=2, dtype=torch.bfloat16)
    expected_x, expected_residual = ops.fused_add_rms_norm_ref(x, residual, w, 1e-5)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    out_x, out_residual = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    assert out_x.data_ptr() == x_ptr and out_residual.data_ptr() == residual_ptr
    assert torch.equal(out_residual, expected_residual)  # one rounding of the fp32 sum either way
    assert bf16_ulps(out_x, expected_x).max().item() <= 1


def rope_tables(tokens, head_dim):
    positions = torch.randperm(500, generator=torch.Generator().manual_seed(7))[:tokens].float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim", [(1, 9, 3, 64), (17, 8, 1, 128), (2, 4, 2, 54)])
def test_rope_write_kv_bf16_equals_reference(tokens, q_heads, kv_heads, head_dim):
    """bf16 qkv and caches, fp32 cos and sin: the rotation in fp32, rounded once to bf16 (as shared/model.py's
    torch path), bit for bit."""
    num_blocks, block_size = 9, 4
    qkv = randn(tokens, q_heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16)
    cos, sin = rope_tables(tokens, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    caches = [randn(num_blocks, block_size, kv_heads, head_dim, seed=s, dtype=torch.bfloat16) for s in (1, 2)]
    expected_caches = [c.clone() for c in caches]
    expected_q = ops.rope_write_kv_ref(qkv, cos, sin, *expected_caches, slots, q_heads)
    q = ops.rope_write_kv(qkv, cos, sin, *caches, slots, q_heads)
    assert q.dtype == torch.bfloat16 and torch.equal(q, expected_q)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rope_write_kv(qkv, cos, sin, caches[0].float(), caches[1].float(), slots, q_heads)


def test_bf16_rounding_is_torchs_at_ties_subnormals_and_overflow():
    """RoPE of ones with sin = 0 is cos rounded to bf16: the kernels' vector and scalar rounding against torch's
    cast, on fp32 values chosen to be hard (halfway ties both ways, subnormals, past the largest bf16, infinities)."""
    hard = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 1e-39, -1e-39, 1e-45, 3.4e38,
                         -3.4e38, float("inf"), -float("inf"), 0.0, -0.0, 65504.0, 2**-126, 2**-133])
    tokens, half = 4, 36  # per half: a vector loop (16 or 8 lanes) up to 32, then a scalar tail of 4
    cos = randn(tokens, 2 * half)
    for t in range(tokens):  # (each hard value lands in a vector lane and, in some row, in the tail)
        cos[t, half - 16 : half] = cos[t, 2 * half - 16 :] = hard.roll(4 * t)
    sin = torch.zeros_like(cos)
    qkv = torch.ones(tokens, 3, 2 * half, dtype=torch.bfloat16)
    caches = [torch.zeros(1, tokens, 1, 2 * half, dtype=torch.bfloat16) for _ in range(2)]
    q = ops.rope_write_kv(qkv, cos, sin, *caches, torch.arange(tokens), 1)
    expected = ops.rope_write_kv_ref(qkv, cos, sin, *[c.clone() for c in caches], torch.arange(tokens), 1)
    assert torch.equal(q.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(q[:, 0, :half].view(torch.int16), cos[:, :half].bfloat16().view(torch.int16))
    nan = ops.rope_write_kv(qkv, torch.full_like(cos, float("nan")), sin, *caches, torch.arange(tokens), 1)
    assert nan.isnan().all()


@pytest.mark.parametrize("tokens, inter", [(1, 1536), (5, 16), (3, 4096), (2, 21)])
def test_silu_and_mul_bf16_within_one_ulp_of_reference(tokens, inter):
    """silu(gate) rounded to bf16, then times up, rounded: within one ulp (torch's e^x and simd.h's may round the
    SiLU apart); where e^-gate overflows (gate < -87) both are about 0."""
    gate_up = randn(tokens, 2 * inter, scale=8.0)
    gate_up[0, :4] = torch.tensor([-100.0, -87.5, 60.0, 0.0])
    gate_up = gate_up.bfloat16()
    out, expected = ops.silu_and_mul(gate_up), ops.silu_and_mul_ref(gate_up)
    assert out.dtype == torch.bfloat16
    assert bf16_ulps(out, expected).flatten()[2:].max().item() <= 1
    assert out[0, :2].abs().max().item() < 1e-30 and expected[0, :2].abs().max().item() < 1e-30


def test_bf16_and_fp32_do_not_mix():
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(randn(2, 64, dtype=torch.bfloat16), randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.fused_add_rms_norm(randn(2, 64, dtype=torch.bfloat16), randn(2, 64, seed=1), randn(64).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(randn(2, 64).half())
    assert ops.supports(randn(2, 64, dtype=torch.bfloat16)) and not ops.supports(randn(2, 64).half())


@pytest.mark.heavy  # (a second build of the whole extension: about a minute of gcc)
def test_avx2_build_matches_reference_too():
    """Built for AVX2 + FMA alone (TANDEM_CPU_ARCH=x86-64-v3, as the Docker image builds it)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TANDEM_CPU_ARCH="x86-64-v3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not avx2"], env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("rows, vocab", [(1, 1), (1, 15), (3, 16), (8, 49152), (33, 1001)])
def test_argmax_rows_equals_torch_argmax(rows, vocab):
    """The first of equal largest values, NaN rows (the first NaN, torch's rule), infinities and all -inf rows,
    the vector loop's tail; the same indices as torch.argmax(-1)."""
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).round(decimals=1)  # (many ties)
    specials = [(float("nan"), 2), (float("inf"), 3), (float("-inf"), 1), (float("nan"), 1)]
    for r in range(min(rows, 4)):
        value, count = specials[r]
        logits[r, torch.randint(vocab, (count,), generator=gen)] = value
    if rows > 5:
        logits[5] = float("-inf")
        logits[4, vocab // 2:] = logits[4].max() + 1  # equal maxima from the middle to the tail
    assert ops.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(logits.bfloat16())
