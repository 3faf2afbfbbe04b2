"""The INT4 weight format shared by the quantized layers (shared/quant/) and the W4A16 kernel
(kernels/quant_gemm.py): two 4-bit codes per byte, low nibble = even k, high nibble = odd k, and K padded to a
multiple of the group size.

A leaf module: it imports torch only (never triton), so CPU-only code can use the format without the kernels.
"""
import torch

INT4_GROUP_SIZES = (32, 64, 128)


def padded_in_features(in_features: int, group_size: int) -> int:
    """K rounded up to a multiple of group_size."""
    return -(-in_features // group_size) * group_size


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [0, 15] (K even) -> [N, K // 2] uint8, low nibble = even k, high nibble = odd k.

    ValueError on another shape or on values outside [0, 15]."""
    if q.dim() != 2 or q.shape[1] % 2 != 0:
        raise ValueError(f"q must be [N, K] with K even, got shape {tuple(q.shape)}")
    not_integral = q.is_floating_point() and not torch.equal(q, q.round())
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15 or not_integral):
        raise ValueError("q must hold integers in [0, 15]")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] uint8 in [0, 15] (inverse of pack_int4)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
