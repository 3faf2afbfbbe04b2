"""The batched LoRA delta in Triton: Punica's SGMV shrink and expand kernels (Chen et al. 2023, arXiv 2310.18547;
S-LoRA, Sheng et al. 2023), each beside its pure-torch reference, and add_lora_sgmv, which kernels/lora.py add_lora
runs on CUDA (and on CPU tensors under TRITON_INTERPRET=1 when the caller asks for Triton).

- sgmv_shrink: h [T, R] fp32 = x[rows of s] @ lora_a[slot s].T per segment s. A program computes one tile of
  BLOCK_M rows of one segment by BLOCK_R ranks, looping over K (tl.dot, fp32 accumulation).
- sgmv_expand: y[rows of s] += (h[rows of s] @ lora_b[slot s].T) rounded once to y's dtype (as add_lora_ref does).
  A program computes one tile of BLOCK_M rows by BLOCK_N columns, looping over R.
The grid is (segments, row tiles of the longest segment, rank or column tiles); a program past its segment's end
returns at once, so a decode batch of one-row segments (a BGMV) runs one row tile per segment.

Segments come as CPU int64 tensors (kernels/lora.py add_lora's contract): they are checked on the CPU and copied to
the device once per call. Offsets are int64 (row * row stride, slot * slot stride), so large T or L cannot wrap.
"""

import torch
import triton
import triton.language as tl

from tandem.kernels.checks import FLOAT_DTYPES, check_devices, check_shape, check_tensor, dot_dtype, dot_precision
from tandem.kernels.lora import check_segments


@triton.jit
def _rounded(v, DTYPE: tl.constexpr):
    """fp32 v rounded to nearest even in DTYPE, as fp32 (so a later cast to DTYPE is exact). bf16 by integer ops,
    as torch rounds (NaN kept): the interpreter's fp32 -> bf16 cast truncates."""
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        return v.to(DTYPE).to(tl.float32)


@triton.jit
def _sgmv_shrink_kernel(
    h_ptr, x_ptr, a_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    K, R, stride_hm, stride_xm, stride_al, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_r = tl.program_id(2)
    length = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= length:
        return
    start = tl.load(seg_starts_ptr + seg)  # int64: the row offsets below are int64
    slot = tl.load(seg_slots_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = start + offs_m
    mask_m = offs_m < length
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = a_ptr + slot * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None]  # [BLOCK_K, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, h_ptr, b_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    N, R, stride_ym, stride_hm, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    length = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= length:
        return
    start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = start + offs_m
    mask_m = offs_m < length
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
    b_ptrs = b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None]  # [BLOCK_R, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        mask_r = offs_r < R - r0
        h = tl.load(h_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_R
        b_ptrs += BLOCK_R
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    # the delta rounded once to y's dtype, then added in fp32 and rounded again: torch's `y += delta.to(y.dtype)`
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptrs, _rounded(y.to(tl.float32) + _rounded(acc, dtype), dtype).to(dtype), mask=mask)


def _block_m(max_len: int) -> int:
    """Rows per program: 16 (tl.dot's least) for decode's short segments, up to 64 for prefill's."""
    return min(64, max(16, triton.next_power_of_2(max_len)))


def _block_r(rank: int) -> int:
    return min(64, max(16, triton.next_power_of_2(rank)))


def _segments(device: torch.device, seg_starts, seg_lens, seg_slots) -> tuple[torch.Tensor, ...]:
    """The segment tensors on the kernels' device (one copy of the three)."""
    return tuple(torch.stack((seg_starts, seg_lens, seg_slots)).to(device))


def _check_segment_tensors(seg_starts, seg_lens, seg_slots) -> None:
    for name, t in (("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        check_tensor(name, t, 1, (torch.int64,))
        check_shape(name, t, tuple(seg_starts.shape))
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (the segments are checked there), got {t.device}")


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor) -> torch.Tensor:
    """h [T, R] fp32: for each segment s, h[rows of s] = x[rows of s] @ lora_a[seg_slots[s]].T (fp32 accumulation
    of exact products); rows in no segment are 0.

    x [T, K] and lora_a [L, R, K] of one dtype of FLOAT_DTYPES (unit stride on the last dim); seg_starts, seg_lens,
    seg_slots [S] int64 on the CPU (kernels/lora.py add_lora's segments). ValueError on bad shapes, dtypes, strides,
    devices or segments."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("lora_a", lora_a, 3, (x.dtype,))
    check_shape("lora_a", lora_a, (None, None, x.shape[1]))
    _check_segment_tensors(seg_starts, seg_lens, seg_slots)
    check_devices(x=x, lora_a=lora_a)
    num_tokens, (num_slots, rank, _) = x.shape[0], lora_a.shape
    max_len = check_segments(num_tokens, num_slots, seg_starts, seg_lens, seg_slots)
    h = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if max_len == 0 or rank == 0:
        return h
    _shrink(h, x, lora_a, _segments(x.device, seg_starts, seg_lens, seg_slots), max_len)
    return h


def sgmv_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
                seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """In place: for each segment s, y[rows of s] += (h[rows of s] @ lora_b[seg_slots[s]].T).to(y.dtype) (fp32
    products and sums, the delta rounded once to y's dtype, then added).

    y [T, N] of one dtype of FLOAT_DTYPES (any row stride: a column slice of a fused output is fine), h [T, R] fp32,
    lora_b [L, N, R] of y's dtype; segments as sgmv_shrink's. ValueError on bad shapes, dtypes, strides, devices or
    segments."""
    check_tensor("y", y, 2, FLOAT_DTYPES)
    check_tensor("h", h, 2, (torch.float32,))
    check_tensor("lora_b", lora_b, 3, (y.dtype,))
    check_shape("h", h, (y.shape[0], lora_b.shape[2]))
    check_shape("lora_b", lora_b, (None, y.shape[1], None))
    _check_segment_tensors(seg_starts, seg_lens, seg_slots)
    check_devices(y=y, h=h, lora_b=lora_b)
    max_len = check_segments(y.shape[0], lora_b.shape[0], seg_starts, seg_lens, seg_slots)
    if max_len == 0 or y.shape[1] == 0:
        return
    _expand(y, h, lora_b, _segments(y.device, seg_starts, seg_lens, seg_slots), max_len)


def add_lora_sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """kernels/lora.py add_lora with the two kernels: sgmv_shrink, then sgmv_expand (the segments checked and
    copied to the device once). Arguments and ValueErrors as theirs."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("y", y, 2, (x.dtype,))
    check_tensor("lora_a", lora_a, 3, (x.dtype,))
    check_tensor("lora_b", lora_b, 3, (x.dtype,))
    num_slots, rank = lora_a.shape[:2]
    check_shape("y", y, (x.shape[0], None))
    check_shape("lora_a", lora_a, (num_slots, rank, x.shape[1]))
    check_shape("lora_b", lora_b, (num_slots, y.shape[1], rank))
    _check_segment_tensors(seg_starts, seg_lens, seg_slots)
    check_devices(y=y, x=x, lora_a=lora_a, lora_b=lora_b)
    max_len = check_segments(x.shape[0], num_slots, seg_starts, seg_lens, seg_slots)
    if max_len == 0 or rank == 0 or y.shape[1] == 0:
        return
    segments = _segments(x.device, seg_starts, seg_lens, seg_slots)
    h = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)  # (rows in no segment: never read)
    _shrink(h, x, lora_a, segments, max_len)
    _expand(y, h, lora_b, segments, max_len)


def _shrink(h, x, lora_a, segments, max_len: int) -> None:
    block_m, block_r = _block_m(max_len), _block_r(lora_a.shape[1])
    grid = (segments[0].shape[0], triton.cdiv(max_len, block_m), triton.cdiv(lora_a.shape[1], block_r))
    _sgmv_shrink_kernel[grid](
        h, x, lora_a, *segments, x.shape[1], lora_a.shape[1], h.stride(0), x.stride(0), lora_a.stride(0),
        lora_a.stride(1), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64,
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
    )


def _expand(y, h, lora_b, segments, max_len: int) -> None:
    block_m, block_r = _block_m(max_len), _block_r(lora_b.shape[2])
    grid = (segments[0].shape[0], triton.cdiv(max_len, block_m), triton.cdiv(y.shape[1], 64))
    _sgmv_expand_kernel[grid](
        y, h, lora_b, *segments, y.shape[1], lora_b.shape[2], y.stride(0), h.stride(0), lora_b.stride(0),
        lora_b.stride(1), BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=block_r,
        # (operands in fp32, h being fp32: exact for fp32 inputs; 3xTF32 for 16-bit ones, about fp32's accuracy on
        # tensor cores, so that their delta rounds as the reference's does)
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32x3",
    )


def sgmv_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                    seg_slots: torch.Tensor) -> torch.Tensor:
    """The reference of sgmv_shrink, in fp32."""
    h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        h[start:start + length] = x[start:start + length].float() @ lora_a[slot].float().T
    return h


def sgmv_expand_ref(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
                    seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """The reference of sgmv_expand: the delta in fp32, rounded once to y's dtype, added in place."""
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        y[start:start + length] += (h[start:start + length] @ lora_b[slot].float().T).to(y.dtype)
