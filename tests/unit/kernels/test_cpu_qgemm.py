"""The CPU quantized GEMM (kernels/cpu/qgemm.cpp) against its pure-torch references, and the quantized layers'
CPU forward (kernel for small M, dequantize + matmul otherwise) against the layers' own dequantized weights."""

import pytest
import torch

from tandem.kernels import cpu_ext, cpu_qgemm
from tandem.kernels.int4_format import pack_int4
from tandem.shared.quant.layers import CPU_KERNEL_MAX_M, WeightOnlyInt4Linear, WeightOnlyInt8Linear

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
    for name in ("int8_gemm", "int4_gemm", "gemm_vnni"):
        monkeypatch.setattr(cpu_qgemm, name, lambda *a, f=getattr(cpu_qgemm, name), n=name: calls.append(n) or f(*a))
    # with VNNI the activations are quantized to int16 first (gemm_vnni_ref)
    expected = (cpu_qgemm.gemm_vnni_ref(x, layer.dequantize()) if cpu_qgemm.has_vnni() else x @ layer.dequantize().T)
    cpu_ext.set_num_threads(kernel_threads)
    try:
        torch.testing.assert_close(layer(x), expected, atol=ATOL, rtol=RTOL)
    finally:
        cpu_ext.set_num_threads(1)
    if cpu_qgemm.has_vnni():  # the integer kernel for any M
        assert calls == ["gemm_vnni"]
    else:  # on one thread the kernel for small M, dequantize + matmul above; on more, the kernel for any M
        assert len(calls) == (M <= CPU_KERNEL_MAX_M or kernel_threads > 1)


@pytest.mark.heavy  # (a second build of the whole extension: about a minute of gcc)
def test_avx2_build_matches_reference_too():
    """The kernels built for AVX2 + FMA alone (TANDEM_CPU_ARCH=x86-64-v3, as the Docker image builds it) pass the
    reference comparisons above, the dense GEMM's (test_cpu_dense.py) and the decoder stack's against the Python
    layers (tests/unit/test_decoder_stack.py: bf16 past 16 rows on torch's linear there); this machine's default
    build uses AVX-512 where the CPU has it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TANDEM_CPU_ARCH="x86-64-v3")
    dense = os.path.join(os.path.dirname(__file__), "test_cpu_dense.py")
    stack = os.path.join(os.path.dirname(__file__), "..", "test_decoder_stack.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, dense, stack,
                          "-k", "gemm_matches_reference or large_n or match_python"], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


# --- the integer kernel (kernels/cpu/qgemm_vnni.cpp) ---

vnni = pytest.mark.skipif(not cpu_qgemm.has_vnni(), reason="gemm_vnni needs AVX-512 VNNI")


def _vnni_weight(kind: str, N: int, K: int, G: int, seed: int = 0):
    """(packed weight, its dequantized fp32 [N, K]) with random codes, scales and zero points."""
    # (int8 scales keep |w| below about 1, products of size ~1 as ATOL assumes)
    scales = torch.rand(N, K // G, generator=_gen(seed)) * (0.05 if kind == "int4" else 0.005) + 0.001
    if kind == "int4":
        codes = torch.randint(0, 16, (N, K), generator=_gen(seed + 1), dtype=torch.uint8)
        zeros = torch.rand(N, K // G, generator=_gen(seed + 2)) * 15
        dequantized = (codes.float().view(N, -1, G) - zeros[..., None]) * scales[..., None]
    else:
        codes = torch.randint(-128, 128, (N, K), generator=_gen(seed + 1), dtype=torch.int8)
        zeros = None
        dequantized = codes.float().view(N, -1, G) * scales[..., None]
    return cpu_qgemm.pack_vnni(codes, scales, zeros, G), dequantized.view(N, K)


@vnni
@pytest.mark.parametrize("M, N, K", SHAPES)
@pytest.mark.parametrize("kind, group_size", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", None)])
def test_gemm_vnni_matches_reference(M, N, K, kind, group_size):
    G = group_size or K
    if K % G:
        pytest.skip("group does not divide K")
    weight, dequantized = _vnni_weight(kind, N, K, G)
    x = torch.randn(M, K, generator=_gen(3))
    y = cpu_qgemm.gemm_vnni(x, weight)
    torch.testing.assert_close(y, cpu_qgemm.gemm_vnni_ref(x, dequantized), atol=ATOL, rtol=RTOL)
    # against fp32 activations: each x[m, k] moves at most half a step, dx / 2, so y[m, n] at most
    # sum_k |w[n, k]| dx[m, k // 32] / 2 (plus float rounding)
    _, dx = cpu_qgemm.quantize_activations_ref(x)
    bound = (dx.repeat_interleave(32, 1) / 2) @ dequantized.abs().T
    assert torch.all((y - x @ dequantized.T).abs() <= bound + ATOL)


def test_activation_quantization_reference():
    x = torch.tensor([[1.0, -2.0, 0.5, 2.0] + [0.0] * 28 + [0.0] * 32])
    qx, dx = cpu_qgemm.quantize_activations_ref(x)
    assert qx[0, :4].tolist() == [16384, -32767, 8192, 32767]  # 16383.5 rounds half to even
    assert dx[0, 0] == torch.tensor(2.0) / 32767 and dx[0, 1] == 0 and not qx[0, 32:].any()  # a zero block: 0, 0


@vnni
def test_gemm_vnni_quantizes_activations_exactly_as_the_reference():
    """Through an identity weight y = dx * qx: the kernel's codes and scales are the reference's, bit for bit."""
    K = 128
    weight = cpu_qgemm.pack_vnni(torch.eye(K, dtype=torch.int8), torch.ones(K, 1), None, K)
    x = torch.randn(300, K, generator=_gen(6))
    x[7, :32] = 0
    qx, dx = cpu_qgemm.quantize_activations_ref(x)
    assert torch.equal(cpu_qgemm.gemm_vnni(x, weight), (qx.float().view(300, -1, 32) * dx[..., None]).view(300, K))


@vnni
def test_gemm_vnni_rows_do_not_depend_on_the_batch_or_threads():
    """Each output element sums exact int32 block products in block order: bitwise the same for a row alone, in
    a batch of 37 rows, and on two kernel threads."""
    weight, _ = _vnni_weight("int4", 100, 576, 32)
    x = torch.randn(37, 576, generator=_gen(4))
    x[5, 64:96] = 0  # an all-zero block
    batch = cpu_qgemm.gemm_vnni(x, weight)
    for m in (0, 5, 36):
        assert torch.equal(cpu_qgemm.gemm_vnni(x[m:m + 1], weight), batch[m:m + 1])
    cpu_ext.set_num_threads(2)
    try:
        assert torch.equal(cpu_qgemm.gemm_vnni(x, weight), batch)
    finally:
        cpu_ext.set_num_threads(1)


@vnni
def test_gemm_vnni_large_n_and_extreme_values():
    weight, dequantized = _vnni_weight("int8", 49152 + 3, 64, 32)  # the LM head's N, plus a tail
    x = torch.randn(2, 64, generator=_gen(5))
    x[1] *= 1e6  # the activation scale follows each block's range
    y, expected = cpu_qgemm.gemm_vnni(x, weight), cpu_qgemm.gemm_vnni_ref(x, dequantized)
    torch.testing.assert_close(y[0], expected[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(y[1] / 1e6, expected[1] / 1e6, atol=ATOL, rtol=RTOL)


@vnni
def test_pack_vnni_and_gemm_vnni_refuse_bad_arguments():
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    with pytest.raises(ValueError):
        cpu_qgemm.pack_vnni(codes, torch.ones(16, 2), None, 32)  # int4 codes without zero points
    with pytest.raises(ValueError):
        cpu_qgemm.pack_vnni(codes.view(torch.int8), torch.ones(16, 2), torch.zeros(16, 2), 32)  # int8 with zeros
    with pytest.raises(ValueError):
        cpu_qgemm.pack_vnni(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 2), None, 24)  # K % 32
    weight = cpu_qgemm.pack_vnni(codes, torch.ones(16, 2), torch.zeros(16, 2), 32)
    with pytest.raises(ValueError, match="K=96"):
        cpu_qgemm.gemm_vnni(torch.randn(2, 96), weight)
    with pytest.raises(ValueError):
        cpu_qgemm.gemm_vnni(torch.randn(2, 64, dtype=torch.float64), weight)


@vnni
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("panels", [False, True], ids=["tiles", "panels"])
def test_gemm_vnni_keeps_a_non_finite_row_non_finite(bad, panels):
    """A NaN or infinity in a row makes that row's outputs non-finite (so the engine's check of the logits still
    sees it), as with float activations; the other rows are unchanged. On both paths."""
    weight, dequantized = _vnni_weight("int4", 40, 128, 32)
    x = torch.randn(3, 128, generator=_gen(7))
    clean = cpu_qgemm.gemm_vnni(x, weight, panels=panels)
    x[1, 70] = bad
    y = cpu_qgemm.gemm_vnni(x, weight, panels=panels)
    assert not torch.isfinite(y[1]).any() and not torch.isfinite(cpu_qgemm.gemm_vnni_ref(x, dequantized)[1]).any()
    assert torch.equal(y[[0, 2]], clean[[0, 2]])


# M: under and at the panel path's threshold, tails of its row tiles (3 and 4 rows) and row blocks; N: a tail of
# a 16-row tile, whole groups of 3 and 4 tiles and a group's tail, one tile; K: one block, two, 18 (the model's)
PANEL_SHAPES = [(1, 40, 64), (9, 48, 32), (10, 64, 576), (11, 100, 64), (13, 16, 96), (37, 200, 576), (70, 40, 128),
                (130, 112, 64)]


@vnni
@pytest.mark.parametrize("M, N, K", PANEL_SHAPES)
@pytest.mark.parametrize("kind, group_size", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", None)])
@pytest.mark.parametrize("kernel_threads", [1, 2])
def test_gemm_vnni_panels_give_the_tile_paths_bits(M, N, K, kind, group_size, kernel_threads):
    """The many-row path (register tiles of several weight tiles x rows) does each output element's arithmetic in
    the tile path's order: the same bits at every M, N and thread count, and what gemm_vnni picks by M is one of
    them."""
    G = group_size or K
    if K % G:
        pytest.skip("group does not divide K")
    weight, _ = _vnni_weight(kind, N, K, G)
    x = torch.randn(M, K, generator=_gen(9)) * torch.logspace(-3, 3, K)  # blocks of very different scales
    x[M // 2, :32] = 0  # an all-zero block
    tiles = cpu_qgemm.gemm_vnni(x, weight, panels=False)
    cpu_ext.set_num_threads(kernel_threads)
    try:
        assert torch.equal(cpu_qgemm.gemm_vnni(x, weight, panels=True), tiles)
        assert torch.equal(cpu_qgemm.gemm_vnni(x, weight), tiles)
    finally:
        cpu_ext.set_num_threads(1)


@vnni
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_gemm_vnni_panel_rows_do_not_depend_on_the_batch(kind):
    """A row through the panel path (in batches of 10 to 517 rows, on 1 and 2 threads) gives the bits it gives
    alone (through the tile path: M = 1)."""
    weight, _ = _vnni_weight(kind, 960, 576, 32)
    x = torch.randn(517, 576, generator=_gen(10))
    alone = torch.cat([cpu_qgemm.gemm_vnni(x[m:m + 1], weight) for m in (0, 9, 516)])
    for kernel_threads in (1, 2):
        cpu_ext.set_num_threads(kernel_threads)
        try:
            for batch in (10, 32, 517):
                rows = [m for m in (0, 9, 516) if m < batch]
                y = cpu_qgemm.gemm_vnni(x[:batch], weight)
                assert torch.equal(y[rows], alone[:len(rows)])
        finally:
            cpu_ext.set_num_threads(1)


@vnni
def test_gemm_vnni_edge_values():
    """A block below 2^-100 counts as zero (its scale would overflow); int8 rows of huge values stay finite."""
    K = 32
    identity = cpu_qgemm.pack_vnni(torch.eye(K, dtype=torch.int8), torch.ones(K, 1), None, K)
    tiny = torch.full((1, K), 1e-35)
    assert not cpu_qgemm.gemm_vnni(tiny, identity).any() and not cpu_qgemm.gemm_vnni_ref(tiny, torch.eye(K)).any()
    ones = cpu_qgemm.pack_vnni(torch.ones(1, K, dtype=torch.int8), torch.full((1, 1), 1e-3), None, K)
    torch.testing.assert_close(cpu_qgemm.gemm_vnni(torch.full((1, K), 2e37), ones), torch.tensor([[6.4e35]]))
    with pytest.raises(ValueError):
        cpu_qgemm.pack_vnni(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), None, 0)
    with pytest.raises(ValueError):  # an int4 code out of range
        cpu_qgemm.pack_vnni(torch.full((4, 64), 17, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 2), 32)
    with pytest.raises(ValueError):  # zero points shaped unlike the scales
        cpu_qgemm.pack_vnni(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 1), 32)
    with pytest.raises(RuntimeError, match="group_size"):  # the C++ entry point checks it too
        cpu_ext.extension().gemm_vnni(torch.randn(2, 64), identity.codes, identity.scales, identity.zero_scales,
                                      K, 0, False)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_layer_kernel_weights_follow_their_buffers(kind):
    """The kernels' derived weight layouts are made again when the buffers change after a forward: in place, or
    replaced by load_state_dict."""
    make = ((lambda: WeightOnlyInt8Linear.from_float(torch.nn.Linear(64, 16, bias=False))) if kind == "int8"
            else (lambda: WeightOnlyInt4Linear.from_float(torch.nn.Linear(64, 16, bias=False), group_size=32)))
    a, b = make(), make()
    x = torch.randn(2, 64, generator=_gen(8))
    before = a(x)
    a.load_state_dict(b.state_dict())
    torch.testing.assert_close(a(x), b(x))
    with torch.no_grad():
        a.scales.mul_(2)
    torch.testing.assert_close(a(x), 2 * b(x), atol=ATOL, rtol=RTOL)  # w = (q - z) * s: twice the scales
    a.load_state_dict(b.state_dict(), assign=True)
    torch.testing.assert_close(a(x), b(x))
    assert not torch.equal(before, b(x))
