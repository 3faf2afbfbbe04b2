"""Weight-only quantized GEMM on x86-64 CPUs: the C++/AVX2 kernel in kernels/cpu/qgemm.cpp, its pure-torch
references, and the wrappers that check arguments and lay out the input.

The kernel dequantizes a few output rows at a time into an L1/L2-resident fp32 buffer and multiplies them with
the activations in registers, so each call reads the int8/int4 bytes once: a decode step reads 4x (int8) or 8x
(int4) fewer weight bytes than fp32 (method: llama.cpp's ggml and gpt-fast, dequantize next to the FMA). It pays
for small M (decode batches); for large M (prefill chunks) a float GEMM on the dequantized weight is faster, and
the caller picks (shared/quant/layers.py).

On CPUs with AVX-512 VNNI, gemm_vnni (kernels/cpu/qgemm_vnni.cpp) does better at any M: it quantizes the
activations to int16 per 32 columns on the fly and multiplies them with the codes in exact int32 dot products
(one vpdpwssd is 32 multiply-adds), so codes are widened only to int16. pack_vnni makes its weight layout once
per layer; gemm_vnni_ref is its reference.

Built and loaded by kernels/cpu_ext.py (with the other CPU kernels).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import cpu_ext


def available() -> bool:
    """True when the C++ kernels are built (building them on first call) and this CPU can run them."""
    return cpu_ext.available()


def supports(in_features: int, group_size: int) -> bool:
    """Shapes the kernel takes: K and the group size multiples of 32 (the group dividing K)."""
    return in_features % 32 == 0 and group_size % 32 == 0 and in_features % group_size == 0


def repack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical int4 codes uint8 [N, K // 2] (kernels/int4_format.py: low nibble = even k) -> the kernel's order,
    same shape: in each 32-column chunk, byte j holds k = j (low nibble) and k = j + 16 (high nibble)."""
    from tandem.kernels.int4_format import unpack_int4

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
    from tandem.kernels.int4_format import unpack_int4

    n = qweight.shape[0]
    q = unpack_int4(qweight).float().view(n, -1, group_size)
    w = ((q - zeros[..., None]) * scales[..., None]).view(n, -1)
    return x @ w.T


# --- integer dot products (kernels/cpu/qgemm_vnni.cpp): AVX-512 VNNI only ---

VNNI_TILE = 16  # output rows per tile of the packed layout
ACTIVATION_BLOCK = 32  # columns sharing one activation scale
ACTIVATION_QMAX = 32767  # activations quantized to int16
ACTIVATION_MIN_AMAX = 2.0 ** -100  # a block whose largest |x| is smaller counts as zero
VNNI_PANEL_ROWS = (3, 256)  # gemm_vnni's panel path for M in [3, 256) (PANEL_MIN/MAX_ROWS, qgemm_vnni.cpp)


def has_vnni() -> bool:
    """True when gemm_vnni runs here: the kernels are built for a CPU with AVX-512 VNNI."""
    return available() and cpu_ext.extension().has_vnni()


@dataclass(frozen=True)
class VnniWeight:
    """A weight in gemm_vnni's layout (pack_vnni): codes uint8 [ceil(N / 16), K / 32, 8 (int4) or 16 (int8), 32];
    scales and zero_scales fp32 [ceil(N / 16), K / group_size, 16]."""
    codes: torch.Tensor
    scales: torch.Tensor
    zero_scales: torch.Tensor
    out_features: int
    group_size: int
    int4: bool


def pack_vnni(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int) -> VnniWeight:
    """A quantized weight w = (codes - zeros) * scales per group of group_size columns -> gemm_vnni's layout.

    codes: uint8 [N, K] in 0..15 (int4, with zeros fp32 [N, K / G] in code units) or int8 [N, K] (zeros None);
    scales fp32 [N, K / G]. Layout (kernels/cpu/qgemm_vnni.cpp): tiles of 16 rows, blocks of 32 columns, column
    pair p of the 16 rows as 32 consecutive codes; int4 folds pairs p and p + 8 into the low and high nibbles.
    ValueError on shapes or dtypes the kernel does not take."""
    n, k = codes.shape
    int4 = codes.dtype == torch.uint8
    if (codes.dtype not in (torch.uint8, torch.int8) or (zeros is None) == int4 or group_size <= 0
            or not supports(k, group_size) or tuple(scales.shape) != (n, k // group_size)
            or (int4 and (zeros.shape != scales.shape or (codes.numel() and int(codes.max()) > 15)))):
        raise ValueError(f"codes must be uint8 in 0..15 with zeros or int8 without, [N, K], and scales and zeros "
                         f"[N, K / {group_size}], "
                         f"K and the group multiples of 32; got {codes.dtype} {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    tiles = -(-n // VNNI_TILE)
    pad = tiles * VNNI_TILE - n
    c = torch.nn.functional.pad(codes.view(torch.uint8), (0, 0, 0, pad))
    c = c.view(tiles, VNNI_TILE, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [tile, block, pair, row, 2 columns]
    c = (c[:, :, :8] | (c[:, :, 8:] << 4)) if int4 else c

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))
        return t.view(tiles, VNNI_TILE, -1).transpose(1, 2).contiguous()

    zero_scales = torch.zeros_like(scales) if zeros is None else zeros * scales
    return VnniWeight(c.reshape(tiles, k // 32, -1, 32).contiguous(), per_tile(scales), per_tile(zero_scales), n,
                      group_size, int4)


def gemm_vnni(x: torch.Tensor, weight: VnniWeight, panels: bool | None = None) -> torch.Tensor:
    """y [M, N] fp32 = quantize_activations(x) @ W.T, W the packed weight dequantized: the rows of x quantized to
    int16 per 32 columns, exact int32 dot products with the codes, fp32 scales. A row's result does not depend on
    M or the thread count. panels: the panel path (register tiles of several weight tiles x rows) or the tile
    path; None picks by M (panels for M in VNNI_PANEL_ROWS); both give the same bits. ValueError on bad shapes;
    RuntimeError without AVX-512 VNNI (see has_vnni)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU [M, K] tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.shape[1] != weight.codes.shape[1] * 32:
        raise ValueError(f"x has K={x.shape[1]}, the weight {weight.codes.shape[1] * 32}")
    if not has_vnni():
        raise RuntimeError("gemm_vnni needs the CPU kernels built for AVX-512 VNNI")
    return cpu_ext.extension().gemm_vnni(x.contiguous(), weight.codes, weight.scales, weight.zero_scales,
                                         weight.out_features, weight.group_size, weight.int4, panels)


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch activation quantization of gemm_vnni: x fp32 [M, K] -> (qx int16 [M, K], dx fp32 [M, K / 32])
    with dx = max|x| / 32767 per block of 32 columns and qx = round-half-even(x * (32767 / max|x|)); 0 for a block
    with max|x| < 2^-100."""
    m, k = x.shape
    blocks = x.view(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(-1)
    amax = torch.where(amax < ACTIVATION_MIN_AMAX, torch.zeros_like(amax), amax)  # (NaN stays NaN)
    # (a true division: `scalar / tensor` in torch multiplies by the reciprocal, which rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, ACTIVATION_QMAX) / amax, torch.zeros_like(amax))
    qx = torch.round(blocks * inv[..., None]).clamp(-ACTIVATION_QMAX, ACTIVATION_QMAX).to(torch.int16).view(m, k)
    return qx, amax / torch.full_like(amax, ACTIVATION_QMAX)


def gemm_vnni_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Pure-torch gemm_vnni: x quantized and dequantized (quantize_activations_ref), then matmul with the
    dequantized weight [N, K] in fp32."""
    qx, dx = quantize_activations_ref(x)
    m, k = x.shape
    x_tilde = (qx.float().view(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK) * dx[..., None]).view(m, k)
    return x_tilde @ weight.float().T
