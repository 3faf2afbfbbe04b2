"""Dense linears on x86-64 CPUs: the C++ kernel of kernels/cpu/dense_gemm.cpp (and, from 22 rows,
kernels/cpu/dense_gemm_packed.cpp), its pure-torch reference, and the rule for when it runs.

A decode step's linears multiply a handful of rows by the whole weight, so they are bound by reading the weight
(fp32 or bf16). The kernel streams each weight once per call on the CPU kernels' own threads (all of them, while
the engine runs torch on one) and widens bf16 to fp32 in registers, as the reference computes: fp32 products and
sums, one rounding to the output's type. Prefill chunks and larger decode batches are bound by arithmetic: there,
with AVX-512 (fp32) and AVX512-BF16 (bf16), a GEMM runs whose weight panels are repacked per call for FMA or
vdpbf16ps (register tiles of fp32 accumulators, as oneDNN's): bf16 as fast as oneDNN's bf16 GEMM on one thread, on
every kernel thread. Where torch's GEMM does better (bf16 past MAX_ROWS_UNPACKED_BF16 rows on a CPU without
AVX512-BF16) the caller uses it. CpuDenseLinear is the nn.Linear that runs it (a CPU model's float linears).

Built and loaded by kernels/cpu_ext.py (with the other CPU kernels).
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_ext

# rows of x up to which the kernel beats torch's matmul on the engine's one torch thread here (python -m
# tandem.benchmarks.dense_gemm): fp32 at every size (torch's fp32 GEMM, MKL's, runs without AVX-512 on this AMD
# CPU: about 100 GFLOP/s per thread, the kernel 170), bf16 at every size where the packed path is built (from 22
# rows: on one thread level with oneDNN's bf16 GEMM, about 540 GFLOP/s here, and it runs on every kernel thread)
MAX_ROWS = {torch.float32: None, torch.bfloat16: None}
# bf16 without AVX512-BF16 (a build for x86-64-v3): the per-row kernel while the weight's bytes bound it; past
# that, oneDNN's bf16 GEMM, its weight packed along N, does more per instruction than per-row dot products
MAX_ROWS_UNPACKED_BF16 = 16


@functools.cache
def has_packed(dtype: torch.dtype) -> bool:
    """True when the kernels are built with the packed GEMM for dtype: fp32 on a CPU with AVX-512, bf16 with
    AVX512-BF16."""
    return cpu_ext.available() and cpu_ext.extension().dense_gemm_packed_available(dtype == torch.bfloat16)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when linear(x, weight) runs the kernel: 2-D CPU tensors of one dtype of MAX_ROWS, at most its number
    of rows of x (bf16 without the packed path: MAX_ROWS_UNPACKED_BF16), in_features a multiple of 32, and the
    kernels built."""
    if x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in MAX_ROWS or x.dim() != 2:
        return False
    if x.shape[1] % 32 != 0 or not cpu_ext.available():
        return False
    limit = max_rows(x.dtype)
    return limit is None or x.shape[0] <= limit


def max_rows(dtype: torch.dtype) -> int | None:
    """Rows of x up to which linear() runs the kernel for dtype (fp32 or bf16) on this build (None: any number;
    bf16 without the packed path: MAX_ROWS_UNPACKED_BF16); past them the caller uses torch's linear."""
    limit = MAX_ROWS[dtype]
    if limit is None and dtype == torch.bfloat16 and not has_packed(torch.bfloat16):
        return MAX_ROWS_UNPACKED_BF16
    return limit


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K].T (+ bias [N]), all fp32 or all bf16 (y too); fp32 arithmetic.
    ValueError when supports(x, weight) is False or bias does not fit.

    Batch invariance: each y[m, n] is summed in an order that depends neither on the kernel threads nor on M or
    the row's place in the batch, with one exception: where the packed path is built it sums in one order up to
    21 rows and in another from 22, so a row's bits can differ between a batch of 21 and one of 22."""
    if not supports(x, weight):
        raise ValueError(f"the dense CPU kernel does not take x {x.dtype} {tuple(x.shape)} on {x.device} with "
                         f"weight {weight.dtype} {tuple(weight.shape)} (see kernels.cpu_dense.supports)")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {weight.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    return linear_supported(x, weight, bias)


def linear_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear() without its checks, for a caller that has asked supports(x, weight) (a layer's forward, whose
    bias has the weight's shape and dtype by construction): one check per call on the decode's hot path."""
    return cpu_ext.extension().dense_gemm(x.contiguous(), weight.contiguous(),
                                          None if bias is None else bias.contiguous())


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: products and sums in fp32, the bias added in fp32, one rounding to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class CpuDenseLinear(nn.Linear):
    """nn.Linear whose forward runs the kernel (linear_supported) where it takes the input, torch's F.linear
    elsewhere. shared/model.py's load_model turns a CPU model's float linears into these (same parameters, same
    names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if supports(x, self.weight):
            return linear_supported(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
