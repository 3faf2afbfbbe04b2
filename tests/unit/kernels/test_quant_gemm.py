"""w8a16_gemm / w4a16_gemm (Triton; interpreted on CPU, or compiled on CUDA) against their references, and the
int4 packing."""

import pytest
import torch

from tandem.kernels.int4_format import pack_int4, unpack_int4
from tandem.kernels.quant_gemm import w4a16_gemm, w4a16_gemm_ref, w8a16_gemm, w8a16_gemm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Outputs are sums of K products of size ~1; fp16/bf16 tolerances scale with the output magnitude.
GEMM_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 5e-3), torch.bfloat16: (1e-1, 2e-2)}


def _close(actual, expected):
    atol, rtol = GEMM_TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=atol, rtol=rtol)


def _int8_weight(N, K, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    scales = torch.rand(N, generator=gen) * 0.02 + 0.001
    return qweight.to(device), scales.to(device)


def _int4_weight(N, K, group_size, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=gen)
    scales = torch.rand(N, K // group_size, generator=gen) * 0.2 + 0.01
    zeros = torch.rand(N, K // group_size, generator=gen) * 15
    return pack_int4(q).to(device), scales.to(device), zeros.to(device)


def _x(M, K, dtype, device, seed=1):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, N, K", [(1, 96, 256), (5, 64, 96), (16, 80, 128), (70, 130, 192)])
def test_w8a16_matches_reference(device, M, N, K, dtype):
    qweight, scales = _int8_weight(N, K, device)
    x = _x(M, K, dtype, device)
    y = w8a16_gemm(x, qweight, scales.to(dtype))
    assert y.dtype == dtype and y.shape == (M, N) and y.device == x.device
    _close(y, w8a16_gemm_ref(x, qweight, scales.to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, N, K, group_size", [
    (1, 96, 256, 32),  # decode, one group per K tile
    (3, 64, 256, 128),
    (16, 80, 192, 64),
    (70, 130, 256, 128),  # prefill-sized M, several row tiles
    (2, 64, 96, 24),  # group size not a power of two: groups change inside a tile
    (40, 48, 48, 48),  # K smaller than a tile
])
def test_w4a16_matches_reference(device, M, N, K, group_size, dtype):
    qweight, scales, zeros = _int4_weight(N, K, group_size, device)
    x = _x(M, K, dtype, device)
    y = w4a16_gemm(x, qweight, scales, zeros, group_size)
    assert y.dtype == dtype and y.shape == (M, N) and y.device == x.device
    _close(y, w4a16_gemm_ref(x, qweight, scales, zeros, group_size))


def test_w4a16_reference_dequantizes_by_group(device):
    # One row, K = 4, group_size = 2: w = (q - zero) * scale per group, low nibble first.
    q = torch.tensor([[1, 2, 15, 0]], device=device)
    scales = torch.tensor([[0.5, 2.0]], device=device)
    zeros = torch.tensor([[1.0, 8.0]], device=device)
    x = torch.eye(4, device=device)
    expected = torch.tensor([[0.0], [0.5], [14.0], [-16.0]], device=device)
    torch.testing.assert_close(w4a16_gemm_ref(x, pack_int4(q), scales, zeros, 2), expected)
    torch.testing.assert_close(w4a16_gemm(x, pack_int4(q), scales, zeros, 2), expected)


def test_pack_int4_layout_and_round_trip(device):
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], device=device)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.device == q.device
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]  # low nibble = even k
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))


@pytest.mark.parametrize("q", [torch.tensor([[16, 0]]), torch.tensor([[-1, 0]]), torch.tensor([[1, 2, 3]])])
def test_pack_int4_rejects_bad_values(on_device, q):
    with pytest.raises(ValueError):
        pack_int4(on_device(q))


def test_w8a16_bad_arguments_raise(device):
    qweight, scales = _int8_weight(32, 64, device)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="shape"):
        w8a16_gemm(_x(2, 32, torch.float32, device), qweight, scales)
    with pytest.raises(ValueError, match="int8"):
        w8a16_gemm(x, qweight.to(torch.uint8), scales)
    with pytest.raises(ValueError, match="shape"):
        w8a16_gemm(x, qweight, scales[:16])
    with pytest.raises(ValueError, match="dtype"):
        w8a16_gemm(x.long(), qweight, scales)
    with pytest.raises(ValueError, match="stride"):
        w8a16_gemm(_x(64, 2, torch.float32, device).T, qweight, scales)


def test_w4a16_bad_arguments_raise(device):
    qweight, scales, zeros = _int4_weight(32, 64, 32, device)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_gemm(x, qweight, scales, zeros, 48)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_gemm_ref(x, qweight, scales, zeros, 48)
    with pytest.raises(ValueError, match="uint8"):
        w4a16_gemm(x, qweight.to(torch.int8), scales, zeros, 32)
    with pytest.raises(ValueError, match="shape"):
        w4a16_gemm(x, qweight, scales, zeros[:, :1], 32)
    with pytest.raises(ValueError, match="shape"):
        w4a16_gemm(x, torch.cat([qweight, qweight], 1), scales, zeros, 32)
