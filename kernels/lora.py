"""The batched LoRA delta of a mixed-adapter batch: each segment of rows adds its adapter's low-rank update.

A step's flat batch holds requests of different adapters (and of the base model, which add nothing). Each
adapter-carrying request's rows form one segment; the delta of a linear is, per segment s with slot a_s:

    y[rows of s] += (x[rows of s] @ lora_a[a_s].T) @ lora_b[a_s].T     (shrink to rank R, then expand)

lora_a / lora_b are the stacks of the adapters resident in the batch's slots, zero-padded to the stack's rank R,
with the adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into lora_b at load. Method: Punica's
SGMV (Chen et al. 2023, arXiv 2310.18547) and S-LoRA (Sheng et al. 2023): one shrink and one expand per segment.

add_lora_ref is the pure-torch reference; add_lora dispatches to the fastest implementation that takes the
tensors: the C++ kernel (kernels/cpu_lora.py, kernels/cpu/lora.cpp) for fp32 and bf16 CPU tensors, the Triton
kernels (kernels/lora_sgmv.py: sgmv_shrink, sgmv_expand) for CUDA tensors, the reference otherwise. The C++
kernel is batch invariant: a row's delta is the same bits whatever the batch around it and the kernel threads.
Torch only: nothing here imports triton (kernels/lora_sgmv.py is imported when Triton runs) or shared/.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_lora

LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_lora_args(y, x, lora_a, lora_b, seg_starts, seg_lens, seg_slots) -> None:
    """ValueError unless the tensors have the shapes, dtypes and devices add_lora documents (the segments' values
    are checked where they are read: check_segments, or the C++ kernel)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x [T, K] and y [T, N] must be 2-D with one T, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype not in LORA_DTYPES or not x.dtype == y.dtype == lora_a.dtype == lora_b.dtype:
        raise ValueError(f"x, y, lora_a and lora_b must share one of {LORA_DTYPES}, got {x.dtype}, {y.dtype}, "
                         f"{lora_a.dtype}, {lora_b.dtype}")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(f"lora_a [L, R, K] and lora_b [L, N, R] must be 3-D, got {tuple(lora_a.shape)} and "
                         f"{tuple(lora_b.shape)}")
    (num_slots, rank, k), n = lora_a.shape, y.shape[1]
    if k != x.shape[1] or lora_b.shape != (num_slots, n, rank):
        raise ValueError(f"lora_a must be [L, R, {x.shape[1]}] and lora_b [L, {n}, R], got {tuple(lora_a.shape)} "
                         f"and {tuple(lora_b.shape)}")
    for name, t in (("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        if t.dtype != torch.int64 or t.dim() != 1 or t.shape != seg_starts.shape:
            raise ValueError(f"{name} must be [S] int64 like seg_starts, got {t.dtype} {tuple(t.shape)}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got {t.device}")
    if not x.device == y.device == lora_a.device == lora_b.device:
        raise ValueError(f"x, y, lora_a and lora_b must be on one device, got {x.device}, {y.device}, "
                         f"{lora_a.device}, {lora_b.device}")


def check_segments(num_tokens: int, num_slots: int, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                   seg_slots: torch.Tensor) -> int:
    """The longest segment's length; ValueError unless every segment lies inside the num_tokens rows, names a slot
    in [0, num_slots), and no two (of length > 0) overlap."""
    starts, lens, slots = seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()
    for s, (start, length, slot) in enumerate(zip(starts, lens, slots)):
        if start < 0 or length < 0 or start + length > num_tokens:
            raise ValueError(f"segment {s} (rows {start} + {length}) is not inside the {num_tokens} rows of x")
        if not 0 <= slot < num_slots:
            raise ValueError(f"segment {s} names slot {slot}, not in [0, {num_slots})")
    spans = sorted((start, start + length) for start, length in zip(starts, lens) if length > 0)
    for (start0, end0), (start1, end1) in zip(spans, spans[1:]):
        if end0 > start1:
            raise ValueError(f"segments overlap: rows {start0}..{end0} and {start1}..{end1}")
    return max(lens, default=0)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """The reference of add_lora: per segment, the shrink and the expand in fp32, the delta rounded once to y's
    dtype and added (in y's dtype, as PEFT adds lora_B(lora_A(x)) * scaling to the base output)."""
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        rows = slice(start, start + length)
        h = x[rows].float() @ lora_a[slot].float().T  # [length, R]
        y[rows] += (h @ lora_b[slot].float().T).to(y.dtype)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, *,
             use_triton: bool | None = None) -> None:
    """y [T, N] += the LoRA delta of each segment, in place.

    x [T, K] and y [T, N]: the linear's input and base output, one dtype of LORA_DTYPES. lora_a [L, R, K] and
    lora_b [L, N, R] (x's dtype): the stacks of L adapter slots at rank R (zero-padded; lora_b holds the scaling).
    seg_starts, seg_lens, seg_slots [S] int64 (CPU): segment s is rows seg_starts[s] .. + seg_lens[s] of x and y,
    adapter slot seg_slots[s] in [0, L). Rows in no segment (base-model requests) are left as they are; segments
    do not overlap. ValueError for shapes, dtypes or devices that do not fit (check_lora_args; each kernel checks
    the same), and for segments outside the T rows, overlapping, or naming a slot outside [0, L) (before y is
    written).

    use_triton: run the Triton kernels (kernels/lora_sgmv.py); None (the default): for CUDA tensors. A caller that
    follows shared.device.use_triton passes use_triton=use_triton(x), so that TANDEM_TRITON_ON_CPU=1 (with
    TRITON_INTERPRET=1) runs them on CPU tensors too. Otherwise CPU tensors take the C++ kernel where
    kernels/cpu_lora.supports (fp32, bf16), else (fp16, a CPU without AVX2) the reference.
    """
    # NOTE: the C++ kernel checks its arguments itself (ValueError), the Triton wrapper with kernels/checks.py:
    # check_lora_args on their paths too would double a decode call's time in Python.
    if use_triton if use_triton is not None else x.is_cuda:
        from tandem.kernels.lora_sgmv import add_lora_sgmv  # (imports triton)

        add_lora_sgmv(y, x, lora_a, lora_b, seg_starts, seg_lens, seg_slots)
    elif cpu_lora.supports(y, x):
        cpu_lora.add_lora(y, x, lora_a, lora_b, seg_starts, seg_lens, seg_slots)
    else:
        check_lora_args(y, x, lora_a, lora_b, seg_starts, seg_lens, seg_slots)
        check_segments(x.shape[0], lora_a.shape[0], seg_starts, seg_lens, seg_slots)
        add_lora_ref(y, x, lora_a, lora_b, seg_starts, seg_lens, seg_slots)
