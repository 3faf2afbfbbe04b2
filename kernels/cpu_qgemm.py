"""Weight-only quantized GEMM on x86-64 CPUs: the C++/AVX2 kernel in kernels/cpu/qgemm.cpp, its pure-torch
references, and the wrappers that check arguments and lay out the input.

The kernel dequantizes a few output rows at a time into an L1/L2-resident fp32 buffer and multiplies them with
the activations in registers, so each call reads the int8/int4 bytes once: a decode step reads 4x (int8) or 8x
(int4) fewer weight bytes than fp32 (method: llama.cpp's ggml and gpt-fast, dequantize next to the FMA). It pays
for small M (decode batches); for large M (prefill chunks) a float GEMM on the dequantized weight is faster, and
the caller picks (shared/quant/layers.py).

Built and loaded by kernels/cpu_ext.py (with the other CPU kernels).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import torch

from kernels import cpu_ext


def available() -> bool:
    """True when the C++ kernels are built (building them on first call) and this CPU can run them."""
    return cpu_ext.available()


def supports(in_features: int, group_size: int) -> bool:
    """Shapes the kernel takes: K and the group size multiples of 32 (the group dividing K)."""
    return in_features % 32 == 0 and group_size % 32 == 0 and in_features % group_size == 0


def repack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical int4 codes uint8 [N, K // 2] (kernels/int4_format.py: low nibble = even k) -> the kernel's order,
    same shape: in each 32-column chunk, byte j holds k = j (low nibble) and k = j + 16 (high nibble)."""
    from kernels.int4_format import unpack_int4

    n = qweight.shape[0]
    q = unpack_int4(qweight).view(n, -1, 2, 16)  # [N, chunks, half, j]
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, -1).contiguous()


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, packed_k: int) -> None:
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU [M, K] tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    k = x.shape[1]
    if not supports(k, group_size):
        raise ValueError(f"K={k} and group_size={group_size} must be multiples of 32, the group dividing K")
    n = qweight.shape[0]
    if qweight.dim() != 2 or qweight.shape[1] != packed_k:
        raise ValueError(f"qweight must be [N, {packed_k}], got {tuple(qweight.shape)}")
    if tuple(scales.shape) != (n, k // group_size) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [{n}, {k // group_size}], got {scales.dtype} {tuple(scales.shape)}")


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] fp32 @ (qweight int8 [N, K] * scales fp32 [N, K // group_size], per group).

    One scale per output channel is group_size == K. ValueError on bad shapes or dtypes; RuntimeError if the
    kernel is not available (check available() first)."""
    _check(x, qweight, scales, group_size, x.shape[1])
    if qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8, got {qweight.dtype}")
    ext = cpu_ext.extension()
    if ext is None:
        raise RuntimeError("the CPU quantized GEMM is not available on this machine")
    return ext.int8_gemm(x.contiguous(), qweight.contiguous(), scales.contiguous(), group_size)


def int4_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zero_scales: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] fp32 @ ((q - zeros) * scales).T with codes = repack_int4(qweight) uint8
    [N, K // 2], scales and zero_scales = zeros * scales fp32 [N, K // group_size]. K is the padded K (pad x
    with zeros). ValueError on bad shapes or dtypes; RuntimeError if the kernel is not available."""
    _check(x, codes, scales, group_size, x.shape[1] // 2)
    if codes.dtype != torch.uint8 or zero_scales.shape != scales.shape or zero_scales.dtype != torch.float32:
        raise ValueError("codes must be uint8 and zero_scales float32 shaped like scales")
    ext = cpu_ext.extension()
    if ext is None:
        raise RuntimeError("the CPU quantized GEMM is not available on this machine")
    return ext.int4_gemm(x.contiguous(), codes.contiguous(), scales.contiguous(), zero_scales.contiguous(),
                         group_size)


def int8_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pure-torch int8_gemm: dequantize in fp32, then matmul."""
    n, k = qweight.shape
    w = (qweight.float().view(n, k // group_size, group_size) * scales[..., None]).view(n, k)
    return x @ w.T


def int4_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """Pure-torch int4_gemm: unpack, dequantize per group in fp32, then matmul."""
    from kernels.int4_format import unpack_int4

    n = qweight.shape[0]
    q = unpack_int4(qweight).float().view(n, -1, group_size)
    w = ((q - zeros[..., None]) * scales[..., None]).view(n, -1)
    return x @ w.T
