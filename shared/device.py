"""Device policy: whether work on a tensor goes through the Triton kernels (kernels/) or torch ops.

The one place the engine asks; attention (shared/attention.py) and the quantized linears (shared/quant/layers.py)
both call use_triton(). A leaf module: torch and shared.envs only.
"""
import torch

from tandem.shared import envs

# NOTE: read once, at import: TANDEM_TRITON_ON_CPU=1 only works with TRITON_INTERPRET=1, which triton itself
# reads once when first imported, so changing either later in a process would not take effect consistently.
TRITON_ON_CPU: bool = envs.TANDEM_TRITON_ON_CPU


def use_triton(t: torch.Tensor) -> bool:
    """True when work on tensor t goes through the Triton kernels: always for CUDA tensors; for CPU tensors only
    with TANDEM_TRITON_ON_CPU=1, which needs TRITON_INTERPRET=1 set before triton is imported (the interpreter then
    runs the GPU code path on the CPU, slowly: tests use it to check that path end to end without a GPU)."""
    return t.is_cuda or TRITON_ON_CPU
