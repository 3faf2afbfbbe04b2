"""The dense CPU GEMM (kernels/cpu/dense_gemm.cpp, and dense_gemm_packed.cpp from 22 rows) against its pure-torch
reference, in fp32 and bf16, on one and two kernel threads, and CpuDenseLinear against nn.Linear
on both sides of the kernel's row limit."""

import pytest
import torch
from torch import nn

from tandem.kernels import cpu_dense, cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernel needs AVX2 and a C++ compiler")
# M covers every tail of the 6-row (AVX-512) and 2-row (AVX2) register blocks and more than one 96-row pass over
# the weight; N a tail of the 4-row tiles; K one and several 32-column chunks.
SHAPES = [(0, 8, 64), (1, 3, 32), (1, 64, 96), (2, 36, 64), (5, 20, 256), (7, 68, 96), (13, 9, 64), (100, 130, 192)]
# The packed path (fp32 where AVX-512 is built, bf16 where AVX512-BF16 is), called as such: M a tail of the 12-row
# register tiles and a split into row blocks (N one panel); N a tail of the 16-column vectors and the 32-column
# panels (and, at N = 130 and 72, panels with one two ahead to prefetch and without); K one, two and three K blocks
# (2,048 bf16 or 1,536 fp32 columns), the last one partial.
PACKED_SHAPES = [(6, 40, 64), (10, 40, 64), (17, 40, 64), (33, 130, 192), (100, 16, 2144), (512, 72, 96), (33, 24, 4160)]
# fp32: sums of K products of size ~1 in another order. bf16: the same fp32 sum rounded once to bf16 can land one
# bf16 step (2^-8 relative) either side.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=2**-7)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _kernel_at_every_m(monkeypatch, dtype):
    monkeypatch.setitem(cpu_dense.MAX_ROWS, dtype, None)
    monkeypatch.setattr(cpu_dense, "MAX_ROWS_UNPACKED_BF16", None)  # (without AVX512-BF16: the per-row path)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_dense_gemm_matches_reference(M, N, K, dtype, bias, kernel_threads, monkeypatch):
    _kernel_at_every_m(monkeypatch, dtype)
    x = torch.randn(M, K, generator=_gen(0)).to(dtype)
    weight = torch.randn(N, K, generator=_gen(1)).to(dtype)
    b = torch.randn(N, generator=_gen(2)).to(dtype) if bias else None
    y = cpu_dense.linear(x, weight, b)
    assert y.dtype == dtype and y.shape == (M, N)
    torch.testing.assert_close(y, cpu_dense.linear_ref(x, weight, b), **TOLERANCE[dtype])


def _skip_without_packed(dtype):
    if not cpu_dense.has_packed(dtype):
        pytest.skip(f"the packed {dtype} GEMM is not built here (fp32: AVX-512, bf16: AVX512-BF16)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, N, K", PACKED_SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_packed_matches_reference(M, N, K, dtype, bias, kernel_threads):
    _skip_without_packed(dtype)
    x = torch.randn(M, K, generator=_gen(0)).to(dtype)
    weight = torch.randn(N, K, generator=_gen(1)).to(dtype)
    b = torch.randn(N, generator=_gen(2)).to(dtype) if bias else None
    y = cpu_ext.extension().dense_gemm(x, weight, b, packed=True)
    torch.testing.assert_close(y, cpu_dense.linear_ref(x, weight, b), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_packed_path_runs_from_22_rows(dtype):
    """dense_gemm without `packed` takes the per-row path up to 21 rows and the packed one from 22. The two sum in
    different orders, which these values tell apart: 2^25 first, then ones (each lost against 2^25 in a sum over K
    in order, the packed path's; kept in the per-row path's other lanes), then -2^25."""
    _skip_without_packed(dtype)
    ext = cpu_ext.extension()
    x = torch.ones(22, 128, dtype=dtype)
    weight = torch.ones(8, 128, dtype=dtype)
    weight[:, 0], weight[:, -1] = 2.0**25, -(2.0**25)
    per_row, packed = ext.dense_gemm(x, weight, packed=False), ext.dense_gemm(x, weight, packed=True)
    assert not torch.equal(per_row, packed)
    assert torch.equal(ext.dense_gemm(x[:21], weight), per_row[:21])
    assert torch.equal(ext.dense_gemm(x, weight), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K", [192, 4160], ids=["one-k-block", "three-k-blocks"])
def test_packed_is_batch_invariant(K, dtype):
    """Each row of a batch of 100 equals, bit for bit, the row computed alone, within a batch of 33, and on one
    thread instead of two (the summation order is per output element, whatever M and the threads)."""
    _skip_without_packed(dtype)
    ext = cpu_ext.extension()
    x = torch.randn(100, K, generator=_gen(0)).to(dtype)
    weight = torch.randn(70, K, generator=_gen(1)).to(dtype)
    bias = torch.randn(70, generator=_gen(2)).to(dtype)
    before = cpu_ext.num_threads()
    try:
        cpu_ext.set_num_threads(2)
        y = ext.dense_gemm(x, weight, bias, packed=True)
        assert torch.equal(ext.dense_gemm(x[40:73], weight, bias, packed=True), y[40:73])
        for i in (0, 11, 12, 57, 99):
            assert torch.equal(ext.dense_gemm(x[i:i + 1], weight, bias, packed=True), y[i:i + 1])
        cpu_ext.set_num_threads(1)
        assert torch.equal(ext.dense_gemm(x, weight, bias, packed=True), y)
    finally:
        cpu_ext.set_num_threads(before)


@pytest.mark.parametrize("M", [3, 40], ids=["per-row", "packed"])
def test_bf16_weights_are_widened_exactly(M, monkeypatch):
    """Weights and inputs that are small integers: every product and sum is exact in fp32, so the kernel must
    equal the reference bit for bit (a bf16 -> fp32 widening, or a packed pair, off by one bit would show)."""
    _kernel_at_every_m(monkeypatch, torch.bfloat16)
    x = torch.randint(-8, 8, (M, 64), generator=_gen(0)).to(torch.bfloat16)
    weight = torch.randint(-8, 8, (40, 64), generator=_gen(1)).to(torch.bfloat16)
    assert torch.equal(cpu_dense.linear(x, weight), cpu_dense.linear_ref(x, weight))


def test_large_n_tiles_cover_every_row():
    N, K = 49152 + 3, 64  # the LM head's N, plus a tail
    x, weight = torch.randn(2, K, generator=_gen(0)), torch.randn(N, K, generator=_gen(1))
    torch.testing.assert_close(cpu_dense.linear(x, weight), cpu_dense.linear_ref(x, weight), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("bad", ["mixed-dtypes", "float64", "k-not-multiple-of-32", "bias-shape", "too-many-rows"])
def test_what_the_kernel_does_not_take_raises_value_error(bad, monkeypatch):
    monkeypatch.setitem(cpu_dense.MAX_ROWS, torch.bfloat16, 16)  # (a row limit, as without AVX512-BF16)
    dtype = torch.float64 if bad == "float64" else torch.bfloat16
    k = 48 if bad == "k-not-multiple-of-32" else 64
    m = 17 if bad == "too-many-rows" else 2
    x = torch.randn(m, k).to(torch.float32 if bad == "mixed-dtypes" else dtype)
    weight = torch.randn(8, k).to(dtype)
    bias = torch.randn(7).to(dtype) if bad == "bias-shape" else None
    assert cpu_dense.supports(x, weight) == (bad == "bias-shape")
    with pytest.raises(ValueError):
        cpu_dense.linear(x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_dense_linear_equals_nn_linear_on_both_sides_of_the_row_limit(dtype):
    from tandem.kernels.cpu_dense import CpuDenseLinear

    linear = nn.Linear(64, 40, bias=True).to(dtype)
    fast = nn.Linear(64, 40, bias=True).to(dtype)
    fast.load_state_dict(linear.state_dict())
    fast.__class__ = CpuDenseLinear
    for m in (1, (cpu_dense.MAX_ROWS[dtype] or 64) + 1):
        x = torch.randn(m, 64, generator=_gen(m)).to(dtype)
        torch.testing.assert_close(fast(x), linear(x), **TOLERANCE[dtype])
    x = torch.randn(2, 3, 64).to(dtype)  # (3-D input: torch's path)
    torch.testing.assert_close(fast(x), linear(x), **TOLERANCE[dtype])
