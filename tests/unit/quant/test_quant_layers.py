"""WeightOnlyInt8Linear / WeightOnlyInt4Linear: forward vs an independent dequantize reference, the padding rule
for group sizes that do not divide K, RTN error bounds, and torch's packed CPU op conventions."""
import pytest
import torch

from tandem.benchmarks.quant_cpu_ops import int4pack_linear, to_int4pack_cpu
from tandem.kernels import cpu_qgemm
from tandem.kernels.int4_format import pack_int4, unpack_int4
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from tandem.shared.quant.rtn import fake_quantize, int4_params, quantize_int4


def int4_reference_weight(layer: WeightOnlyInt4Linear) -> torch.Tensor:
    """(q - zero) * scale written the slow obvious way, straight from the canonical tensors."""
    n, k, g = layer.out_features, layer.in_features, layer.group_size
    w = torch.empty(n, k)
    for col in range(k):
        byte = layer.qweight[:, col // 2].int()
        q = (byte & 0xF) if col % 2 == 0 else (byte >> 4)
        w[:, col] = (q.float() - layer.zeros[:, col // g]) * layer.scales[:, col // g]
    return w


def test_pack_unpack_round_trip_and_nibble_order():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[1 | 2 << 4, 15]]  # low nibble = even k, high nibble = odd k
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("k,group_size", [(256, 32), (256, 64), (576, 128), (96, 64), (1536, 128)])
def test_int4_forward_matches_reference(k, group_size):
    torch.manual_seed(k + group_size)
    linear = torch.nn.Linear(k, 48, bias=False)
    layer = WeightOnlyInt4Linear.from_float(linear, group_size)
    k_pad = -(-k // group_size) * group_size
    assert layer.qweight.shape == (48, k_pad // 2) and layer.scales.shape == (48, k_pad // group_size)
    ref_w = int4_reference_weight(layer)
    assert torch.allclose(layer.dequantize(), ref_w, atol=1e-6)
    x = torch.randn(2, 3, k)
    assert torch.allclose(layer(x), x @ ref_w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,group_size", [(576, 128), (96, 64), (200, 32)])
def test_group_size_not_dividing_k_pads_and_keeps_groups_exact(k, group_size):
    """The last group covers only the K % G real columns: its range comes from those columns alone."""
    torch.manual_seed(1)
    w = torch.randn(8, k)
    w[:, -1] = 50.0  # an outlier in the partial last group must not leak into the previous group
    layer = WeightOnlyInt4Linear.from_float(torch.nn.Linear(k, 8, bias=False).requires_grad_(False), group_size)
    layer.load_quantized(pack_int4(quantize_int4(w, group_size)[0]), *int4_params(w, group_size))
    deq = layer.dequantize()
    assert deq.shape == (8, k)
    last = (k // group_size) * group_size if k % group_size else k - group_size
    full_groups = w[:, :last].view(8, -1, group_size)
    step = (full_groups.amax(-1) - full_groups.amin(-1)) / 15
    err = (deq[:, :last] - w[:, :last]).abs().view(8, -1, group_size).amax(-1)
    assert torch.all(err <= step / 2 + 1e-5)
    assert torch.allclose(deq[:, -1], w[:, -1], atol=1e-4)  # the group max is exactly representable


def test_int4_rtn_error_bound_and_constant_groups():
    w = torch.randn(4, 128)
    w[0, :32] = 0.7  # constant group
    w[1, 32:64] = 0.0  # all-zero group
    deq = fake_quantize(w, 4, 32)
    s, _ = int4_params(w, 32)
    assert torch.all((deq - w).abs() <= s.repeat_interleave(32, 1) / 2 + 1e-6)
    assert torch.allclose(deq[0, :32], w[0, :32]) and torch.equal(deq[1, 32:64], w[1, 32:64])


@pytest.mark.parametrize("k", [64, 576])
def test_int8_forward_matches_reference(k):
    torch.manual_seed(k)
    linear = torch.nn.Linear(k, 40, bias=True)
    layer = WeightOnlyInt8Linear.from_float(linear)
    ref_w = layer.qweight.float() * layer.scales[:, None]
    assert torch.equal(layer.dequantize(), ref_w)
    assert torch.all((ref_w - linear.weight).abs() <= layer.scales[:, None] / 2 + 1e-7)
    x = torch.randn(5, k)
    assert torch.allclose(layer(x), x @ ref_w.T + linear.bias, atol=1e-4, rtol=1e-4)


def test_int8_grouped_matches_reference():
    layer = WeightOnlyInt8Linear(64, 8, group_size=32)
    q = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    scales = torch.rand(8, 2)
    layer.load_quantized(q, scales)
    ref_w = q.float() * scales.repeat_interleave(32, 1)
    x = torch.randn(3, 64)
    # the CPU kernels sum in another order; with AVX-512 VNNI they quantize x to int16 first (gemm_vnni_ref)
    expected = cpu_qgemm.gemm_vnni_ref(x, ref_w) if cpu_qgemm.has_vnni() else x @ ref_w.T
    assert torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-5)


def test_bad_group_size_and_shapes_raise_value_error():
    with pytest.raises(ValueError):
        WeightOnlyInt4Linear(64, 8, group_size=48)
    with pytest.raises(ValueError):
        WeightOnlyInt8Linear(100, 8, group_size=32)
    layer = WeightOnlyInt4Linear(64, 8, group_size=32)
    with pytest.raises(ValueError):
        layer.load_quantized(torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no packed int4 CPU op")
def test_packed_cpu_op_conventions_match_reference():
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 64, bias=False)
    int4 = WeightOnlyInt4Linear.from_float(linear, 128)
    x = torch.randn(3, 576)
    packed, scale_and_zero = to_int4pack_cpu(int4)
    assert torch.allclose(int4pack_linear(int4, x, packed, scale_and_zero), int4(x), atol=1e-3, rtol=1e-3)
    int8 = WeightOnlyInt8Linear.from_float(linear)
    packed8 = torch.ops.aten._weight_int8pack_mm(x, int8.qweight, int8.scales)
    assert torch.allclose(packed8, int8(x), atol=1e-4, rtol=1e-4)
