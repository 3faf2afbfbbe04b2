"""Round-to-nearest (RTN) weight quantization: the baseline GPTQ and AWQ improve on, and their inner step.

INT8: symmetric per output channel, scale = max|w_n| / 127, q in [-127, 127] (gpt-fast's int8 scheme), or the
same per group of 32/64 input channels (finer scales; it follows checkpoints whose weights came from 32-wide
block formats such as GGUF Q4_1).
INT4: asymmetric per group of G input channels; each group's [min, max] maps onto [0, 15] with a float zero
point (AWQ's min/max scheme, Lin et al. 2023, without rounding the zero to an integer). A G that does not divide
K pads K to a multiple of G; the padded columns' quantized values are irrelevant (their inputs are zero) and
do not enter any group's min/max.
"""
from __future__ import annotations

import torch

from tandem.kernels.int4_format import pack_int4, padded_in_features

INT4_MAX = 15
INT8_MAX = 127


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight int8 [N, K], scales in w's dtype): [N] per channel, or [N, K // G] per group
    of G input channels (K % G == 0); w ~= qweight * scale."""
    n, k = w.shape
    if group_size is None:
        scales = int8_scales(w)
        q = torch.round(w.float() / scales.float()[:, None])
    else:
        if k % group_size:
            raise ValueError(f"int8 group_size {group_size} must divide in_features {k}")
        scales = int8_scales(w.reshape(n * k // group_size, group_size)).view(n, k // group_size)
        q = torch.round(w.float().view(n, -1, group_size) / scales.float()[..., None]).view(n, k)
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N]: max|w| / 127 per row, 1.0 for an all-zero row."""
    amax = w.detach().abs().amax(dim=1)
    return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))


def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale and float zero point of w [N, K]: ([N, K_pad // G], [N, K_pad // G]), K_pad as in int4_format.

    scale = (max - min) / 15, zero = -min / scale, so min -> q = 0 and max -> q = 15 exactly. A constant group
    c gets scale |c| (or 1 for c = 0) and zero -sign(c), so q = 0 reproduces c.
    """
    n, k = w.shape
    pad = padded_in_features(k, group_size) - k
    wf = w.detach().float()
    wmin = torch.nn.functional.pad(wf, (0, pad), value=float("inf")).view(n, -1, group_size).amin(-1)
    wmax = torch.nn.functional.pad(wf, (0, pad), value=float("-inf")).view(n, -1, group_size).amax(-1)
    scales = (wmax - wmin) / INT4_MAX
    flat = scales == 0
    scales[flat] = torch.where(wmin[flat] != 0, wmin[flat].abs(), torch.ones_like(wmin[flat]))
    zeros = -wmin / scales
    return scales.to(w.dtype), zeros.to(w.dtype)


def quantize_with_params(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         max_q: int = INT4_MAX) -> torch.Tensor:
    """Integer codes of w [N, K] for given per-group params [N, K_pad // G] -> uint8 [N, K_pad] in [0, max_q].

    The padded columns come out as round(zero), the code closest to a zero weight.
    """
    n, k = w.shape
    pad = padded_in_features(k, group_size) - k
    wf = torch.nn.functional.pad(w.detach().float(), (0, pad)).view(n, -1, group_size)
    q = torch.round(wf / scales.float()[..., None] + zeros.float()[..., None]).clamp_(0, max_q)
    return q.view(n, -1).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q uint8 [N, K_pad] in [0, 15] (unpacked), scales, zeros [N, K_pad // G])."""
    scales, zeros = int4_params(w, group_size)
    return quantize_with_params(w, scales, zeros, group_size), scales, zeros


def fake_quantize(w: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Quantize then dequantize w [N, K] with the RTN scheme for bits (4 or 8); same shape and dtype as w.

    AWQ's scale search and the tests use this; it matches what the packed layers compute.
    """
    if bits == 8:
        q, scales = quantize_int8(w, group_size)
        s = scales.float()[:, None] if group_size is None else scales.float().repeat_interleave(group_size, dim=1)
        return (q.float() * s).to(w.dtype)
    n, k = w.shape
    q, scales, zeros = quantize_int4(w, group_size)
    wq = (q.view(n, -1, group_size).float() - zeros.float()[..., None]) * scales.float()[..., None]
    return wq.view(n, -1)[:, :k].to(w.dtype)


def canonical_tensors(bits: int, codes: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Integer codes + params -> the tensors a quantized layer stores (see layers.py).

    bits 8: codes int8 [N, K], scales [N] -> {"qweight", "scales"}.
    bits 4: codes [N, K_pad] in [0, 15], scales/zeros [N, K_pad // G] -> {"qweight" (packed), "scales", "zeros"}.
    """
    if bits == 8:
        return {"qweight": codes.to(torch.int8).contiguous(), "scales": scales.contiguous()}
    return {"qweight": pack_int4(codes).contiguous(), "scales": scales.contiguous(), "zeros": zeros.contiguous()}


def rtn_tensors(w: torch.Tensor, bits: int, group_size: int | None) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of one weight [N, K] into canonical layer tensors."""
    if bits == 8:
        return canonical_tensors(8, *quantize_int8(w, group_size))
    return canonical_tensors(4, *quantize_int4(w, group_size))
