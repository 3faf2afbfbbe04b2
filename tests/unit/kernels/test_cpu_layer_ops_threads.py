"""The C++ layer ops (kernels/cpu/layer_ops.cpp) on a prefill chunk's rows, which they split over the kernels'
threads: on 2 threads bit-identical to 1 thread (rows are independent) and as close to the torch references as
test_cpu_layer_ops.py holds one thread's, in fp32 and bf16, for row counts that do not divide into the chunks."""
import pytest
import torch

from tandem.kernels import cpu_ext
from tandem.kernels import cpu_layer_ops as ops
from tests.unit.kernels.bf16 import bf16_ulps

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels need AVX2 and a C++ compiler")


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def on_threads(fn, threads: int):
    before = cpu_ext.num_threads()
    cpu_ext.set_num_threads(threads)
    try:
        return fn()
    finally:
        cpu_ext.set_num_threads(before)


def close(out: torch.Tensor, expected: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        assert bf16_ulps(out, expected).max() <= 1
    else:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=3e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [512, 301])
def test_norms_split_over_threads(dtype, tokens):
    x, residual = randn(tokens, 576, dtype=dtype), randn(tokens, 576, seed=1, dtype=dtype)
    w = randn(576, seed=2, dtype=dtype)
    one, two = (on_threads(lambda: ops.rms_norm(x, w, 1e-5), n) for n in (1, 2))
    assert torch.equal(one, two)
    close(two, ops.rms_norm_ref(x, w, 1e-5))
    expected_x, expected_residual = ops.fused_add_rms_norm_ref(x, residual, w, 1e-5)
    results = [on_threads(lambda: ops.fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-5), n) for n in (1, 2)]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[1][1], expected_residual)
    close(results[1][0], expected_x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [512, 301])
def test_rope_write_kv_and_silu_split_over_threads(dtype, tokens):
    q_heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    qkv = randn(tokens, q_heads + 2 * kv_heads, head_dim, dtype=dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.arange(tokens).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    num_blocks = tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:tokens]
    caches = {n: [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
              for n in ("ref", 1, 2)}  # fmt: skip
    expected = ops.rope_write_kv_ref(qkv, cos, sin, *caches["ref"], slots, q_heads)
    for n in (1, 2):
        q = on_threads(lambda: ops.rope_write_kv(qkv, cos, sin, *caches[n], slots, q_heads), n)
        assert torch.equal(q, expected)
        assert all(torch.equal(c, r) for c, r in zip(caches[n], caches["ref"]))
    gate_up = randn(tokens, 2 * 1536, seed=4, dtype=dtype) * 4
    one, two = (on_threads(lambda: ops.silu_and_mul(gate_up), n) for n in (1, 2))
    assert torch.equal(one, two)
    close(two, ops.silu_and_mul_ref(gate_up))
