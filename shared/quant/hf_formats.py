"""Convert HF AWQ (GEMM) and HF GPTQ 4-bit checkpoints into the canonical INT4 layout (see layers.py).

HF AWQ, "quant_method": "awq", "version": "gemm" (AutoAWQ's WQLinear_GEMM), per linear:
    qweight int32 [K, N // 8]   8 output channels per int32; nibble i (bits 4i..4i+3) holds channel
                                8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  int32 [K // G, N // 8]  same packing; the integer zero point as is
    scales  fp16  [K // G, N]   w[n, k] = (q - zero) * scale of group k // G
HF GPTQ, "quant_method": "gptq" (AutoGPTQ / GPTQModel, 4 bits), per linear:
    qweight int32 [K // 8, N]   8 input channels per int32; nibble i holds k = 8r + i
    qzeros  int32 [K // G, N // 8]  nibble i holds channel 8c + i; classic ("gptq", v1) format stores
                                zero - 1, "checkpoint_format": "gptq_v2" stores the zero itself
    scales  fp16  [K // G, N];  g_idx int32 [K] group of each input channel
Both transpose to [N, K]. A g_idx other than k // G (act-order checkpoints) cannot be expressed in the
canonical layout and is refused. Float tensors (norms, embeddings, Qwen2's q/k/v biases) pass through by name;
Phi-3's fused qkv_proj / gate_up_proj keep their names here and are split into rows when applied.
"""
from __future__ import annotations

import torch

from tandem.kernels.int4_format import INT4_GROUP_SIZES, pack_int4, padded_in_features
from tandem.shared.quant.config import QuantConfig
from tandem.shared.quant.modules import canonical_fused_name, canonical_name

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..., C, ...] -> uint8 with dim grown 8x; nibble i of each word becomes element 8c + i along dim."""
    packed = packed.to(torch.int32).movedim(dim, -1)
    nibbles = (packed[..., None] >> _SHIFTS) & 0xF  # [..., C, 8]
    return nibbles.reshape(*packed.shape[:-1], -1).to(torch.uint8).movedim(-1, dim)


def convert_hf_awq(state: dict[str, torch.Tensor], qc: dict) -> tuple[dict[str, torch.Tensor], QuantConfig]:
    """HF AWQ GEMM state dict + quantization_config -> (canonical state dict, QuantConfig).

    Raises ValueError for bits != 4, a version other than "gemm", zero_point False or an unsupported group size.
    """
    group_size = _check_common(qc)
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"only AWQ version 'gemm' is supported, got {qc.get('version')!r}")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points are not supported")
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))  # channel j sits in nibble inverse[j]

    def unpack_awq(packed: torch.Tensor) -> torch.Tensor:  # [R, N // 8] -> [R, N], channels in order
        nib = unpack_int32_nibbles(packed, dim=1).view(packed.shape[0], -1, 8)
        return nib[..., inverse].reshape(packed.shape[0], -1)

    def convert(prefix: str) -> dict[str, torch.Tensor]:
        codes = unpack_awq(state[f"{prefix}.qweight"]).T  # [N, K]
        zeros = unpack_awq(state[f"{prefix}.qzeros"]).T.float()  # [N, K // G]
        return _canonical(prefix, codes, state[f"{prefix}.scales"].T.float(), zeros, group_size)

    out = _convert_all(state, convert, ("qweight", "qzeros", "scales"))
    return out, QuantConfig(bits=4, group_size=group_size, method="awq")


def convert_hf_gptq(state: dict[str, torch.Tensor], qc: dict) -> tuple[dict[str, torch.Tensor], QuantConfig]:
    """HF GPTQ 4-bit state dict + quantization_config -> (canonical state dict, QuantConfig).

    Raises ValueError for bits != 4, an unsupported group size, or a g_idx other than k // G.
    """
    group_size = _check_common(qc)
    zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1

    def convert(prefix: str) -> dict[str, torch.Tensor]:
        codes = unpack_int32_nibbles(state[f"{prefix}.qweight"], dim=0).T  # [N, K]
        k = codes.shape[1]
        g_idx = state.get(f"{prefix}.g_idx")
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
            raise ValueError(f"{prefix}: g_idx is not k // group_size (act-order checkpoint); not supported")
        zeros = unpack_int32_nibbles(state[f"{prefix}.qzeros"], dim=1).T.float() + zero_offset  # [N, K // G]
        return _canonical(prefix, codes, state[f"{prefix}.scales"].T.float(), zeros, group_size)

    out = _convert_all(state, convert, ("qweight", "qzeros", "scales", "g_idx"))
    return out, QuantConfig(bits=4, group_size=group_size, method="gptq")


def _check_common(qc: dict) -> int:
    if qc.get("bits") != 4:
        raise ValueError(f"only 4-bit {qc.get('quant_method')} checkpoints are supported, got bits={qc.get('bits')}")
    group_size = qc.get("group_size")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    return group_size


def _canonical(prefix: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int) -> dict[str, torch.Tensor]:
    """codes [N, K] (K possibly already padded), scales/zeros [N, groups] -> canonical padded tensors."""
    n, k = codes.shape
    k_pad = scales.shape[1] * group_size
    if k_pad != padded_in_features(k, group_size) or zeros.shape != scales.shape or scales.shape[0] != n:
        raise ValueError(f"{prefix}: codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and zeros "
                         f"{tuple(zeros.shape)} disagree for group_size {group_size}")
    if k_pad != k:
        pad_codes = torch.round(zeros[:, -1:]).clamp(0, 15).to(torch.uint8).expand(n, k_pad - k)
        codes = torch.cat([codes, pad_codes], dim=1)
    return {"qweight": pack_int4(codes), "scales": scales.contiguous(), "zeros": zeros.contiguous()}


def _convert_all(state: dict[str, torch.Tensor], convert, quant_names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Convert every "<prefix>.qweight" linear; pass the other (float) tensors through unchanged."""
    prefixes = [key[: -len(".qweight")] for key in state if key.endswith(".qweight")]
    out = {}
    for prefix in prefixes:
        canon = canonical_name(prefix) or canonical_fused_name(prefix)  # (fused: split by apply_quantized_state)
        if canon is None:
            raise ValueError(f"quantized tensor {prefix!r} is not an attention/MLP projection (q/k/v/o_proj, "
                             f"gate/up/down_proj, or Phi-3's fused qkv_proj, gate_up_proj)")
        out.update({f"{canon}.{name}": t for name, t in convert(prefix).items()})
    skip = {f"{p}.{name}" for p in prefixes for name in quant_names}
    out.update({key: t for key, t in state.items() if key not in skip})
    return out
