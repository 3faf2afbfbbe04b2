"""The quantized KV cache format (--kv-dtype fp8_e4m3 | fp8_e5m2 | int8), shared by the engine (shared/), the
attention paths, the C++ CPU kernel (kernels/cpu/attention.cpp) and the Triton kernels.

A quantized pool keeps the shape of a float one, [num_layers, 2, num_blocks, block_size, num_kv_heads, row], in
torch.uint8, with row = head_dim + SCALE_BYTES: each token's row of one KV head holds head_dim codes, then the
fp32 scale of that token and head (little-endian, packed at the end of the row). Scales are computed as the KV is
written (per token and head: scale = absmax / qmax; an all-zero row gets scale 0 and codes 0), so a block's bytes
are self-contained: block copies, KV transfer and tier offload move raw bytes and need no side tensor.

    code = fp8(x / scale) (round to nearest even, OCP FP8: e4m3fn, qmax 448; e5m2, qmax 57344)
         | round(x / scale) clamped to [-127, 127] as int8 (two's complement in the byte)
    x ~= code * scale

Method: vLLM's fp8 KV cache (which scales per tensor; here per token and head, as KIVI / QServe-style
per-token key scales, so no calibration is needed).
A leaf module. It imports torch only inside the functions that need it, so shared/config.py (which the client
CLI loads without torch) takes the names and row sizes from here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}  # largest code magnitude of each format
KV_QUANT_DTYPES = tuple(QMAX)  # the quantized --kv-dtype names
SCALE_BYTES = 4  # the fp32 scale at the end of each row
# Integer ids the kernels take (0: a float cache)
KV_QUANT_IDS = {None: 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}


def is_quantized(kv_dtype: str | None) -> bool:
    return kv_dtype in QMAX


def row_size(head_dim: int, kv_dtype: str | None) -> int:
    """Elements of one token's row of one KV head in the pool: head_dim for float KV, head_dim + SCALE_BYTES bytes
    for a quantized one."""
    return head_dim + SCALE_BYTES if is_quantized(kv_dtype) else head_dim


def check_head_dim(head_dim: int, kv_dtype: str) -> None:
    """ValueError unless a quantized cache can hold rows of head_dim (the scale is read as an aligned fp32)."""
    if is_quantized(kv_dtype) and head_dim % 4:
        raise ValueError(f"--kv-dtype {kv_dtype} needs a head_dim that is a multiple of 4, got {head_dim}")


def _fp8_dtype(kv_dtype: str):
    import torch

    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]


def quantize(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x [..., head_dim] float -> rows [..., head_dim + SCALE_BYTES] uint8 (codes, then the fp32 scale of each
    row). ValueError for an unknown format."""
    import torch

    if not is_quantized(kv_dtype):
        raise ValueError(f"{kv_dtype!r} is not a quantized KV dtype; expected one of {list(KV_QUANT_DTYPES)}")
    qmax = QMAX[kv_dtype]
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / qmax  # [..., 1]
    y = (x / torch.where(scale > 0, scale, 1.0)).clamp(-qmax, qmax)
    if kv_dtype == "int8":
        codes = y.round().to(torch.int8).view(torch.uint8)
    else:
        codes = y.to(_fp8_dtype(kv_dtype)).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, kv_dtype: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """rows [..., head_dim + SCALE_BYTES] uint8 (quantize's) -> [..., head_dim] in dtype (default fp32): code *
    scale computed in fp32, then rounded to dtype once."""
    import torch

    head_dim = rows.shape[-1] - SCALE_BYTES
    codes, scale = rows[..., :head_dim], rows[..., head_dim:]
    aligned = scale.storage_offset() % SCALE_BYTES == 0 and all(s % SCALE_BYTES == 0 for s in scale.stride()[:-1])
    if scale.stride(-1) != 1 or not aligned:
        scale = scale.contiguous()
    scale = scale.view(torch.float32)  # [..., 1]
    if kv_dtype == "int8":
        values = codes.view(torch.int8).float()
    else:
        values = codes.view(_fp8_dtype(kv_dtype)).float()
    out = values * scale
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)
