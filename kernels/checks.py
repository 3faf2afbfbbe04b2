"""Argument checks shared by the kernel wrappers.

Every public wrapper in kernels/ validates its inputs here before launching a Triton kernel, so bad shapes,
dtypes or devices raise ValueError with a clear message instead of a kernel fault.
"""

import os

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1, read at triton import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_devices(**tensors: torch.Tensor) -> None:
    """All tensors on one device, which Triton can run on: CUDA, or CPU under TRITON_INTERPRET=1."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    device = next(iter(devices.values()))
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreter_enabled():
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}; "
        "use the *_ref function on CPU"
    )


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple) -> None:
    """Rank, dtype and a unit stride on the last dim (the kernels load rows with vector loads)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 on its last dim, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """Exact shape match; None in expected matches any size."""
    ok = len(t.shape) == len(expected) and all(e is None or e == s for s, e in zip(t.shape, expected))
    if not ok:
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {shown}, got {tuple(t.shape)}")


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype for tl.dot.

    NOTE: the Triton 3.x CPU interpreter computes bf16 tl.dot wrongly, so under TRITON_INTERPRET=1 bf16
    operands are upcast to fp32; on CUDA the operands keep the input dtype.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if interpreter_enabled() else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """input_precision for tl.dot: exact fp32 ("ieee") for fp32 operands, so results match the references."""
    return "ieee" if dot_dtype(dtype) == tl.float32 else "tf32"


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
