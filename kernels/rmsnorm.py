"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add, as in Llama decoder layers.

One program normalizes one row; with a residual the kernel also writes x + residual, the next layer's
residual stream, so the sum is read and written once.

NOTE: not used by the engine yet: shared/model.py's RMSNorm runs torch ops on every device, and the fused residual
form needs a decoder layer that carries the residual stream separately (a later fused decoder layer). It is tested
and benchmarked against rms_norm_ref like the kernels in use.
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor


@triton.jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    stride_o, stride_ro, stride_x, stride_r, hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    # fp32 math, rounded to the input dtype where torch's bf16/fp16 ops round (the Triton interpreter
    # cannot do bf16 arithmetic itself).
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden_size + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)  # rounded before the weight, like HF's LlamaRMSNorm
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out = weight * x / sqrt(mean(x**2) + eps), over the last dim, fp32 statistics.

    Args:
        x: [num_tokens, hidden_size] fp16/bf16/fp32.
        weight: [hidden_size], x's dtype.
        eps: added to the mean square.
        residual: optional [num_tokens, hidden_size], x's dtype; when given, x + residual is normalized.
    Returns:
        out [num_tokens, hidden_size] in x's dtype; with a residual, (out, x + residual).
    Raises:
        ValueError: on bad shapes, dtypes, strides or devices.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, (x.dtype,))
    check_shape("weight", weight, (x.shape[1],))
    tensors = dict(x=x, weight=weight)
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,))
        check_shape("residual", residual, tuple(x.shape))
        tensors["residual"] = residual
    check_devices(**tensors)
    num_tokens, hidden_size = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_tokens > 0:
        _rms_norm_kernel[(num_tokens,)](
            out, residual_out, x, residual if residual is not None else x, weight,
            out.stride(0), residual_out.stride(0), x.stride(0),
            residual.stride(0) if residual is not None else 0, hidden_size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden_size),
        )
    return out if residual is None else (out, residual_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch rms_norm (HF LlamaRMSNorm numerics)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return out if residual is None else (out, x)
