"""Weight-only quantized GEMM: y = x @ dequant(qweight).T with the weight dequantized in registers.

INT8: symmetric, one scale per output channel, applied once to the fp32 accumulator (as in gpt-fast's
WeightOnlyInt8Linear). INT4: asymmetric, one scale and zero point per group of group_size input channels
(GPTQ/AWQ-style grouping), two 4-bit values per byte. The tiling is the standard Triton blocked matmul with
grouped program order for L2 reuse; small M (decode) uses a 16-row tile so the weight read dominates.
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor, dot_dtype, dot_precision
from tandem.kernels.int4_format import unpack_int4


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row tiles share each column tile while it is hot in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _w8a16_kernel(
    y_ptr, x_ptr, w_ptr, scales_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)  # [BK, BN] int8
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    scales = tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y = acc * scales[None, :]
    y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w4a16_kernel(
    y_ptr, x_ptr, w_ptr, scales_ptr, zeros_ptr, M, N, K, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Each packed byte holds k = 2j (low nibble) and k = 2j + 1 (high nibble); the tile multiplies the even
    # and odd columns of x with the low and high nibbles separately, so no interleave is needed.
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_j = tl.arange(0, BLOCK_K // 2)  # packed column within the tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        k_even = k0 + 2 * offs_j  # [BK/2]
        mask_k = k_even < K
        x_mask = mask_m[:, None] & mask_k[None, :]
        x_even = tl.load(x_rows + k_even[None, :], mask=x_mask, other=0.0)  # [BM, BK/2]
        x_odd = tl.load(x_rows + k_even[None, :] + 1, mask=x_mask, other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        packed = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k_even // 2)[:, None],
                         mask=w_mask, other=0).to(tl.int32)  # [BK/2, BN]
        if GROUP_ALIGNED:  # the whole tile lies in one group
            g = k0 // group_size
            s_even = tl.load(scales_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z_even = tl.load(zeros_ptr + offs_n * stride_zn + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            s_odd, z_odd = s_even, z_even
        else:
            g_even = (k_even // group_size)[:, None]
            g_odd = ((k_even + 1) // group_size)[:, None]
            s_even = tl.load(scales_ptr + offs_n[None, :] * stride_sn + g_even, mask=w_mask, other=0.0).to(tl.float32)
            z_even = tl.load(zeros_ptr + offs_n[None, :] * stride_zn + g_even, mask=w_mask, other=0.0).to(tl.float32)
            s_odd = tl.load(scales_ptr + offs_n[None, :] * stride_sn + g_odd, mask=w_mask, other=0.0).to(tl.float32)
            z_odd = tl.load(zeros_ptr + offs_n[None, :] * stride_zn + g_odd, mask=w_mask, other=0.0).to(tl.float32)
        w_even = (((packed & 0xF).to(tl.float32) - z_even) * s_even).to(DOT_DTYPE)  # [BK/2, BN]
        w_odd = (((packed >> 4).to(tl.float32) - z_odd) * s_odd).to(DOT_DTYPE)
        acc += tl.dot(x_even.to(DOT_DTYPE), w_even, input_precision=DOT_PRECISION)
        acc += tl.dot(x_odd.to(DOT_DTYPE), w_odd, input_precision=DOT_PRECISION)
    y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tile_config(M: int, K: int, group_size: int | None = None) -> dict:
    """Tile sizes: a 16-row tile with a long K step for decode-sized M, 64x64x64 tiles otherwise.

    For INT4, BLOCK_K shrinks to divide a power-of-two group_size so that each tile lies in one group.
    """
    # NOTE: BLOCK_K >= 32, since the INT4 kernel multiplies half-width K tiles and tl.dot needs K >= 16.
    block_k = (128 if M <= 16 else 64) if K >= 64 else max(32, triton.next_power_of_2(K))
    if group_size is not None and group_size >= 32 and group_size & (group_size - 1) == 0:
        block_k = min(block_k, group_size)
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8)


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y = x @ (qweight * scales[:, None]).T, the weight dequantized in registers.

    Args:
        x: [M, K] fp16/bf16/fp32.
        qweight: [N, K] int8, symmetric per output channel.
        scales: [N] fp16/bf16/fp32.
    Returns:
        [M, N] in x's dtype (fp32 accumulation).
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("qweight", qweight, 2, (torch.int8,))
    check_tensor("scales", scales, 1, FLOAT_DTYPES)
    M, K = x.shape
    N = qweight.shape[0]
    check_shape("qweight", qweight, (N, K))
    check_shape("scales", scales, (N,))
    check_devices(x=x, qweight=qweight, scales=scales)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = _tile_config(M, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a16_kernel[grid](
        y, x, qweight, scales, M, N, K, x.stride(0), qweight.stride(0), y.stride(0),
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype), **cfg,
    )
    return y


def w4a16_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """y = x @ w.T with w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G], dequantized in registers.

    Args:
        x: [M, K] fp16/bf16/fp32.
        qweight: [N, K // 2] uint8, packed as kernels.int4_format.pack_int4 does (low nibble = even k, high
            nibble = odd k).
        scales, zeros: [N, K // group_size] fp16/bf16/fp32; zeros in quantized units (asymmetric).
        group_size: input channels per group; K % group_size == 0 and K even.
    Returns:
        [M, N] in x's dtype (fp32 accumulation).
    Raises:
        ValueError: on bad shapes, dtypes, strides, devices or group_size.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("qweight", qweight, 2, (torch.uint8,))
    check_tensor("scales", scales, 2, FLOAT_DTYPES)
    check_tensor("zeros", zeros, 2, FLOAT_DTYPES)
    M, K = x.shape
    N = qweight.shape[0]
    if group_size <= 0 or K % group_size != 0 or K % 2 != 0:
        raise ValueError(f"K ({K}) must be even and a multiple of group_size ({group_size})")
    check_shape("qweight", qweight, (N, K // 2))
    check_shape("scales", scales, (N, K // group_size))
    check_shape("zeros", zeros, (N, K // group_size))
    check_devices(x=x, qweight=qweight, scales=scales, zeros=zeros)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = _tile_config(M, K, group_size)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w4a16_kernel[grid](
        y, x, qweight, scales, zeros, M, N, K, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
        GROUP_ALIGNED=group_size % cfg["BLOCK_K"] == 0,
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype), **cfg,
    )
    return y


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain-torch w8a16_gemm (fp32 math)."""
    w = qweight.float() * scales.float()[:, None]
    return (x.float() @ w.T).to(x.dtype)


def w4a16_gemm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Plain-torch w4a16_gemm (fp32 math)."""
    if group_size <= 0 or x.shape[1] % group_size != 0:
        raise ValueError(f"K ({x.shape[1]}) must be a multiple of group_size ({group_size})")
    q = unpack_int4(qweight).float()  # [N, K]
    scales = scales.float().repeat_interleave(group_size, dim=1)
    zeros = zeros.float().repeat_interleave(group_size, dim=1)
    return (x.float() @ ((q - zeros) * scales).T).to(x.dtype)
