"""The CPU quantized GEMM (kernels/cpu/qgemm.cpp) against its pure-torch references, and the quantized layers'
CPU forward (kernel for small M, dequantize + matmul otherwise) against the layers' own dequantized weights."""

import pytest
import torch

from kernels import cpu_ext, cpu_qgemm
from kernels.int4_format import pack_int4
from shared.quant.layers import CPU_KERNEL_MAX_M, WeightOnlyInt4Linear, WeightOnlyInt8Linear

pytestmark = pytest.mark.skipif(not cpu_qgemm.available(), reason="the CPU kernel needs AVX2 and a C++ compiler")
# Sums of K products of size ~1 in fp32 with another summation order.
ATOL, RTOL = 1e-4, 1e-4
# M covers the M == 1 kernel, every tail of the 6-row (AVX-512) and 3-row (AVX2) blocks, and large M; N covers
# a tail of the 4-row tiles; num_groups > 1 and == 1 (per channel); a large N catches index overflow in tiles.
SHAPES = [(0, 8, 64), (1, 64, 96), (2, 36, 64), (3, 40, 128), (5, 20, 256), (7, 68, 96), (13, 8, 64), (32, 130, 192),
          (70, 4, 576)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("group_size", [32, None], ids=["g32", "per-channel"])
def test_int8_gemm_matches_reference(M, N, K, group_size):
    G = group_size or K
    qweight = torch.randint(-128, 128, (N, K), generator=_gen(0), dtype=torch.int8)
    scales = torch.rand(N, K // G, generator=_gen(1)) * 0.02 + 0.001
    x = torch.randn(M, K, generator=_gen(2))
    torch.testing.assert_close(cpu_qgemm.int8_gemm(x, qweight, scales, G),
                               cpu_qgemm.int8_gemm_ref(x, qweight, scales, G), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_gemm_matches_reference(M, N, K, group_size):
    if K % group_size:
        pytest.skip("group does not divide K")
    qweight = pack_int4(torch.randint(0, 16, (N, K), generator=_gen(0)))
    scales = torch.rand(N, K // group_size, generator=_gen(1)) * 0.2 + 0.01
    zeros = torch.rand(N, K // group_size, generator=_gen(2)) * 15
    x = torch.randn(M, K, generator=_gen(3))
    y = cpu_qgemm.int4_gemm(x, cpu_qgemm.repack_int4(qweight), scales, zeros * scales, group_size)
    torch.testing.assert_close(y, cpu_qgemm.int4_gemm_ref(x, qweight, scales, zeros, group_size),
                               atol=ATOL, rtol=RTOL)


def test_large_n_tiles_cover_every_row():
    N, K = 49152 + 3, 64  # the LM head's N, plus a tail
    qweight = torch.randint(-128, 128, (N, K), generator=_gen(0), dtype=torch.int8)
    scales = torch.rand(N, 2, generator=_gen(1)) * 0.02 + 0.001  # (products of size ~1, as ATOL assumes)
    x = torch.randn(2, K, generator=_gen(2))
    torch.testing.assert_close(cpu_qgemm.int8_gemm(x, qweight, scales, 32),
                               cpu_qgemm.int8_gemm_ref(x, qweight, scales, 32), atol=ATOL, rtol=RTOL)


def test_repack_int4_order():
    q = torch.arange(64).remainder(16).view(1, 64)  # k -> k % 16
    codes = cpu_qgemm.repack_int4(pack_int4(q))
    # byte j of each 32-chunk holds k = j (low nibble) and k = j + 16 (high nibble)
    chunks = codes.view(1, 2, 16)
    assert torch.equal(torch.stack((chunks & 0xF, chunks >> 4), dim=-2).view(1, 64), q.to(torch.uint8))


@pytest.mark.parametrize("bad", ["dtype", "k", "scales"])
def test_bad_arguments_raise_value_error(bad):
    x = torch.randn(2, 64, dtype=torch.float64 if bad == "dtype" else torch.float32)
    qweight = torch.zeros(8, 48 if bad == "k" else 64, dtype=torch.int8)
    scales = torch.ones(8, 3 if bad == "scales" else 2)
    if bad == "k":
        x = torch.randn(2, 48)
    with pytest.raises(ValueError):
        cpu_qgemm.int8_gemm(x, qweight, scales, 32)


@pytest.mark.parametrize("M", [1, 4, CPU_KERNEL_MAX_M + 1])
@pytest.mark.parametrize("kind", ["int8", "int8-g32", "int4-g32", "int4-g128-padded"])
@pytest.mark.parametrize("kernel_threads", [1, 2])
def test_layers_forward_matches_their_dequantized_weight(M, kind, kernel_threads, monkeypatch):
    K = 576 if kind.endswith("padded") else 128
    linear = torch.nn.Linear(K, 48, bias=False)
    torch.nn.init.normal_(linear.weight, generator=_gen(0))
    if kind.startswith("int8"):
        layer = WeightOnlyInt8Linear.from_float(linear)
        if kind == "int8-g32":  # per group of 32, as GGUF Q8_0 and `tandem quantize --group-size 32` write
            g = WeightOnlyInt8Linear(K, 48, group_size=32)
            w = linear.weight.detach().view(48, -1, 32)
            s = w.abs().amax(-1) / 127
            layer = g.load_quantized((w / s[..., None]).round().to(torch.int8).view(48, K), s)
    else:
        layer = WeightOnlyInt4Linear.from_float(linear, group_size=128 if kind.endswith("padded") else 32)
    x = torch.randn(M, K, generator=_gen(1))
    calls = []
    for name in ("int8_gemm", "int4_gemm"):
        monkeypatch.setattr(cpu_qgemm, name, lambda *a, f=getattr(cpu_qgemm, name): calls.append(1) or f(*a))
    cpu_ext.set_num_threads(kernel_threads)
    try:
        torch.testing.assert_close(layer(x), x @ layer.dequantize().T, atol=ATOL, rtol=RTOL)
    finally:
        cpu_ext.set_num_threads(1)
    # on one thread the kernel for small M, dequantize + matmul above; on more, the kernel for any M
    assert len(calls) == (M <= CPU_KERNEL_MAX_M or kernel_threads > 1)


def test_avx2_build_matches_reference_too():
    """The kernel built for AVX2 + FMA alone (TANDEM_CPU_ARCH=x86-64-v3, as the Docker image builds it) passes the
    reference comparisons above; this machine's default build uses AVX-512 where the CPU has it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TANDEM_CPU_ARCH="x86-64-v3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "gemm_matches_reference or large_n"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
