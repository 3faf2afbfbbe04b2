"""CPU matmul choices for the quantized layers: dequantize-then-matmul (what layers.py does) against torch's
packed weight-only ops, with the fp32 matmul as the baseline. Run: python -m tandem.benchmarks.quant_cpu_ops

torch's packed CPU ops and their conventions (checked against the reference in tests):
    _weight_int8pack_mm(x [M, K] float, w int8 [N, K], scales [N]) = x @ (w * scales[:, None]).T
    _convert_weight_to_int4pack_for_cpu(q int32 [N, K] in [0, 15], inner_k_tiles) -> packed uint8 [N, K // 2]
    _weight_int4pack_mm_for_cpu(x, packed, G, scale_and_zero [K // G, N, 2]) with
        w = (q - 8) * scale + zero'  -> from our (q - zero) * scale: zero' = (8 - zero) * scale

Measured on the shared 2-core AVX2 development machine (torch 2.13 CPU, 1 thread, group_size 128, best of runs,
microseconds; the machine was loaded, so treat single numbers as +-30%):

    N     K     M    fp32   int8 dequant  int8 packed  int4 dequant  int4 packed
    1536  576   1     116        186         1471          1002         2677
    1536  576   256  6346*     10987       243926          6921       560239
    576   1536  1     102        169         1142           717         1895
    576   1536  256  6064       5982       233263          7093       498910
    (* from a quieter run; the loaded run read 17732)

The packed ops lose at every M (their cost grows about linearly with M: a per-row path on this CPU), so the
layers never use them: up to 128 rows they call our own kernel (kernels/cpu_qgemm.py, not timed here; at M = 1
on [1536, 576] int8 0.05 ms and int4 0.08 ms against fp32 0.13 ms), above that they dequantize and call the float
matmul, which this table times.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tandem.kernels.int4_format import unpack_int4
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear


def to_int4pack_cpu(layer: WeightOnlyInt4Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical INT4 tensors -> (packed weight, scale_and_zero [K_pad // G, N, 2] float32) for the CPU op."""
    q = unpack_int4(layer.qweight).to(torch.int32)  # [N, K_pad]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales, zeros = layer.scales.float(), layer.zeros.float()
    scale_and_zero = torch.stack([scales, (8 - zeros) * scales], dim=-1).transpose(0, 1).contiguous()
    return packed, scale_and_zero


def int4pack_linear(layer: WeightOnlyInt4Linear, x: torch.Tensor, packed: torch.Tensor,
                    scale_and_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] through _weight_int4pack_mm_for_cpu (x zero-padded to K_pad)."""
    x = F.pad(x, (0, layer.padded_in_features - layer.in_features))
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, layer.group_size, scale_and_zero)


def _time_us(fn, min_seconds: float = 0.3) -> float:
    """Best-of-runs wall time of fn() in microseconds (the minimum filters out other users' load)."""
    for _ in range(2):
        fn()
    times, end = [], time.perf_counter() + min_seconds
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


@torch.no_grad()
def benchmark(shapes=((1536, 576), (576, 1536)), ms=(1, 256), group_size: int = 128) -> list[dict]:
    """Time fp32, our INT8/INT4 CPU forward and the packed ops for each weight shape (N, K) and M."""
    rows = []
    for n, k in shapes:
        linear = torch.nn.Linear(k, n, bias=False)
        int8 = WeightOnlyInt8Linear.from_float(linear)
        int4 = WeightOnlyInt4Linear.from_float(linear, group_size)
        packed, scale_and_zero = to_int4pack_cpu(int4)
        for m in ms:
            x = torch.randn(m, k)
            rows.append({
                "N": n, "K": k, "M": m,
                "fp32_us": _time_us(lambda: linear(x)),
                "int8_dequant_us": _time_us(lambda: int8(x)),
                "int8_packed_us": _time_us(lambda: torch.ops.aten._weight_int8pack_mm(x, int8.qweight, int8.scales)),
                "int4_dequant_us": _time_us(lambda: int4(x)),
                "int4_packed_us": _time_us(lambda: int4pack_linear(int4, x, packed, scale_and_zero)),
            })
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    for row in benchmark():
        print("  ".join(f"{key}={value:.0f}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in row.items()))
