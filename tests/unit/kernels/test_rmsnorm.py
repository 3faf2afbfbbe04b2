"""rms_norm (Triton; interpreted on CPU, or compiled on CUDA) against rms_norm_ref."""

import pytest
import torch

from tandem.kernels.rmsnorm import rms_norm, rms_norm_ref


def _inputs(num_tokens, hidden_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    residual = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.rand(hidden_size, generator=gen) + 0.5).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden_size", [64, 576, 1000])
def test_matches_reference(close, device, hidden_size, dtype):
    x, residual, weight = _inputs(7, hidden_size, dtype, device)
    close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    out, residual_out = rms_norm(x, weight, 1e-5, residual)
    out_ref, residual_ref = rms_norm_ref(x, weight, 1e-5, residual)
    close(out, out_ref)
    close(residual_out, residual_ref)  # NOTE: the interpreter rounds fp32 -> bf16 toward zero


def test_bad_arguments_raise(device):
    x, residual, weight = _inputs(3, 64, torch.float32, device)
    with pytest.raises(ValueError, match="shape"):
        rms_norm(x, weight[:32], 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, weight.half(), 1e-5)
    with pytest.raises(ValueError, match="shape"):
        rms_norm(x, weight, 1e-5, residual[:2])
    with pytest.raises(ValueError, match="dims"):
        rms_norm(x[None], weight, 1e-5)
