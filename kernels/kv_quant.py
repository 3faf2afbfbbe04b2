"""The quantized KV cache formats (--kv-dtype fp8_e4m3 | fp8_e5m2 | int8), shared by the engine (shared/), the
attention paths, the C++ CPU kernel (kernels/cpu/attention.cpp) and the Triton kernels.

A quantized pool keeps the shape of a float one, [num_layers, 2, num_blocks, block_size, num_kv_heads, row], in
torch.uint8:
- fp8 (e4m3fn, e5m2): row = head_dim codes, one byte per element and no scale (vLLM's fp8 KV cache with its
  default per-tensor scale of 1.0): code = fp8(clamp(x, -qmax, qmax)), x ~= code. A row is exactly a quarter of
  an fp32 one, so a transferred prompt is too. fp8's exponent carries each value's magnitude, so a scale buys
  little (measured: KL against fp32 KV moves 0.0087-0.0092 for per-tensor scales from 1/16 to 4, and 0.0057 with
  a scale per token and head, which costs 4 bytes a row: 0.266 of fp32 instead of 0.25; docs/quantization.md).
  Values past +-qmax saturate (448 for e4m3, 57344 for e5m2).
- int8: row = head_dim codes, then the fp32 scale of that token and head (little-endian, packed at the end of
  the row): scale = absmax / qmax computed as the KV is written (an all-zero row gets scale 0 and codes 0);
  code = round(x / scale) clamped to [-127, 127] (two's complement in the byte); x ~= code * scale. An integer
  code has no exponent, so without its scale it could not hold both a key's outliers and its small values.
Either way a block's bytes are self-contained: block copies, KV transfer and tier offload move raw bytes and need
no side tensor. Rounding is to nearest even (OCP FP8 casts; torch.round for int8).

Method: vLLM's fp8 KV cache (per-tensor scales, here 1.0); int8 scaled per token and head as KIVI / QServe-style
per-token key scales, so no calibration is needed.
A leaf module. It imports torch only inside the functions that need it, so shared/config.py (which the client
CLI loads without torch) takes the names and row sizes from here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}  # largest code magnitude of each format
KV_QUANT_DTYPES = tuple(QMAX)  # the quantized --kv-dtype names
SCALE_BYTES = 4  # the fp32 scale at the end of each row of a scaled format
ROW_SCALED = ("int8",)  # the formats whose rows carry a scale (fp8 rows are codes alone)
# Integer ids the kernels take (0: a float cache)
KV_QUANT_IDS = {None: 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}


def is_quantized(kv_dtype: str | None) -> bool:
    return kv_dtype in QMAX


def row_size(head_dim: int, kv_dtype: str | None) -> int:
    """Elements of one token's row of one KV head in the pool: head_dim for float KV and fp8 (bytes), head_dim +
    SCALE_BYTES bytes for int8."""
    return head_dim + SCALE_BYTES if kv_dtype in ROW_SCALED else head_dim


def check_head_dim(head_dim: int, kv_dtype: str) -> None:
    """ValueError unless a quantized cache can hold rows of head_dim (int8's scale is read as an aligned fp32)."""
    if kv_dtype in ROW_SCALED and head_dim % 4:
        raise ValueError(f"--kv-dtype {kv_dtype} needs a head_dim that is a multiple of 4, got {head_dim}")


def _fp8_dtype(kv_dtype: str):
    import torch

    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]


def quantize(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x [..., head_dim] float -> rows [..., row_size(head_dim, kv_dtype)] uint8: fp8 codes, or int8 codes then
    the fp32 scale of each row. ValueError for an unknown format."""
    import torch

    if not is_quantized(kv_dtype):
        raise ValueError(f"{kv_dtype!r} is not a quantized KV dtype; expected one of {list(KV_QUANT_DTYPES)}")
    qmax = QMAX[kv_dtype]
    x = x.float()
    if kv_dtype not in ROW_SCALED:
        return x.clamp(-qmax, qmax).to(_fp8_dtype(kv_dtype)).view(torch.uint8)
    scale = x.abs().amax(-1, keepdim=True) / qmax  # [..., 1]
    codes = (x / torch.where(scale > 0, scale, 1.0)).clamp(-qmax, qmax).round().to(torch.int8).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, kv_dtype: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """rows [..., row] uint8 (quantize's) -> [..., head_dim] in dtype (default fp32): fp8 codes widened to fp32,
    int8 code * scale computed in fp32; then rounded to dtype once."""
    import torch

    if kv_dtype not in ROW_SCALED:
        out = rows.view(_fp8_dtype(kv_dtype)).float()
        return out if dtype is None or dtype == torch.float32 else out.to(dtype)
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes, scale = rows[..., :head_dim], rows[..., head_dim:]
    aligned = scale.storage_offset() % SCALE_BYTES == 0 and all(s % SCALE_BYTES == 0 for s in scale.stride()[:-1])
    if scale.stride(-1) != 1 or not aligned:
        scale = scale.contiguous()
    scale = scale.view(torch.float32)  # [..., 1]
    out = codes.view(torch.int8).float() * scale
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)
