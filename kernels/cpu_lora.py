"""The batched LoRA delta on x86-64 CPUs: the C++ kernel of kernels/cpu/lora.cpp (Punica's SGMV: a shrink to rank
R, then an expand, per segment of rows), and the rule for when it runs. The reference is kernels/lora.py
add_lora_ref; kernels/lora.py add_lora dispatches here for the CPU tensors supports() takes.

Both phases run on the CPU kernels' own threads (cpu_ext.set_num_threads): decode batches (many one-row segments,
each its own adapter: a BGMV) spread over segments x blocks of output columns, prefill segments (hundreds of rows)
over blocks of rows x blocks of columns. fp32 arithmetic, the delta rounded once to y's dtype and added, as the
reference does.

Batch invariance: each output element (fp32 and bf16) is summed in one order that depends neither on how many rows
share its adapter, nor on the row's place in the batch, nor on the kernel threads (kernels/cpu/lora.cpp: a fixed
reduction order per output element, kept by its dot-product and its packed paths alike), as cpu_dense's kernel is.

Built and loaded by kernels/cpu_ext.py (with the other CPU kernels).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_ext

DTYPES = (torch.float32, torch.bfloat16)


def supports(y: torch.Tensor, x: torch.Tensor) -> bool:
    """True when add_lora(y, x, ...) runs the kernel: 2-D CPU tensors of one dtype of DTYPES with unit column
    stride (any row stride: y may be a column slice of a fused output), and the kernels built. Any K, N and rank."""
    return (x.device.type == "cpu" and y.device.type == "cpu" and x.dtype in DTYPES and y.dtype == x.dtype
            and x.dim() == 2 and y.dim() == 2 and (x.shape[1] <= 1 or x.stride(1) == 1)
            and (y.shape[1] <= 1 or y.stride(1) == 1) and cpu_ext.available())  # fmt: skip


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """y [T, N] += the LoRA delta of each segment, in place: kernels/lora.py add_lora's contract, for tensors that
    supports(y, x) takes (lora_a [L, R, K] and lora_b [L, N, R] are made contiguous if they are not: a copy).

    The kernel checks the rest itself: ValueError for shapes or dtypes that do not fit, segments outside [0, T) or
    overlapping, or slots outside [0, L), before it writes anything."""
    cpu_ext.extension().add_lora(y, x, lora_a.contiguous(), lora_b.contiguous(), seg_starts.contiguous(),
                                 seg_lens.contiguous(), seg_slots.contiguous())
