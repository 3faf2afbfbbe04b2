"""Weight-only quantized linear layers: INT8 (symmetric, per output channel or per group) and INT4 (asymmetric,
per group along K).

Storage (the canonical layout every loader in this package converts into; kernels/quant_gemm.py reads it; the
INT4 packing lives in kernels/int4_format.py, which both sides import):

- WeightOnlyInt8Linear: qweight int8 [N, K]; scales float [N] (per channel, group_size None) or
  [N, K // G] (per group, used for GGUF Q8_0); w = qweight * scale.
- WeightOnlyInt4Linear: qweight uint8 [N, K_pad // 2], low nibble = even k, high nibble = odd k;
  scales and zeros float [N, K_pad // G]; w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G].
  zeros are in quantized units and may be fractional (GGUF Q4_1 stores a float minimum).

NOTE: a group_size that does not divide K (576 / 128 on SmolLM2) is handled by padding: K_pad = ceil(K / G) * G,
the last group holds only K % G real columns, and the padded columns are multiplied by zero-padded inputs, so
they never contribute. The stored tensors are [N, K_pad // 2] and [N, K_pad // G]; dequantize() returns [N, K].

Forward: CUDA calls the Triton kernels in kernels/quant_gemm.py (imported lazily; shared.device.use_triton
decides, as for attention). CPU with fp32 activations calls the C++ kernels in kernels/cpu_qgemm.py:
- with AVX-512 VNNI, gemm_vnni at any M: activations quantized to int16 per 32 columns, exact int32 dot products
  with the codes (2-4x the float kernel; quality against fp32 weights unchanged, docs/performance.md);
- else, up to CPU_KERNEL_MAX_M rows (any number on more than one kernel thread, kernels/cpu_ext.py
  set_num_threads), the float kernel, which reads the codes once and dequantizes in registers (at M = 1 on
  [1536, 576]: int8 2.6x and int4 1.7x faster than fp32); otherwise (prefill chunks, other dtypes, shapes the
  kernels do not take) dequantize + a float matmul, which beats torch's packed CPU ops
  (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) on this machine (benchmarks/quant_cpu_ops.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_ext, cpu_qgemm
from tandem.kernels.int4_format import INT4_GROUP_SIZES, pack_int4, padded_in_features, unpack_int4
from tandem.shared.device import use_triton
from tandem.shared.quant.rtn import quantize_int4, quantize_int8

# Rows (tokens) up to which the CPU kernel on one thread beats dequantize + float matmul on one torch thread here
# (measured M = 1..128). On 2 kernel threads it beats it at any M (a 512-row chunk: 31-37 vs 46 ms per layer).
CPU_KERNEL_MAX_M = 128


def _cpu_rows(x: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor | None:
    """x as [M, K] when it is fp32 on CPU and the CPU kernels take the shape (else None)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not cpu_qgemm.supports(in_features, group_size):
        return None
    return x.reshape(-1, x.shape[-1])


def _cpu_kernel_rows(x: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor | None:
    """x as [M, K] fp32 when the fp32-activation CPU kernel takes it (else None)."""
    x2 = _cpu_rows(x, in_features, group_size)
    if x2 is None or not cpu_qgemm.available() or (x2.shape[0] > CPU_KERNEL_MAX_M and cpu_ext.num_threads() == 1):
        return None
    return x2


def _vnni_rows(x: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor | None:
    """x as [M, K] fp32 when the integer kernel (cpu_qgemm.gemm_vnni) takes it: fp32 on a CPU with AVX-512 VNNI
    (else None)."""
    return _cpu_rows(x, in_features, group_size) if cpu_qgemm.has_vnni() else None


class WeightOnlyInt8Linear(nn.Module):
    """y = x @ (qweight * scales).T (+ bias); int8 weights, float activations (int16 inside the VNNI kernel).

    With outlier columns (LLM.int8()'s decomposition, Dettmers et al. 2022, applied to the weights; see
    tools/quant/outliers.py): y = x[:, ~O] @ (qweight * scales)[:, ~O].T + x[:, O] @ outlier_weight.T, where O
    (outlier_idx) are the input channels whose activations are large. qweight holds zero codes in O's columns,
    so every INT8 kernel path runs unchanged and one small float matmul adds the outlier part.

    Args:
        in_features, out_features: K, N.
        group_size: None for one scale per output channel (scales [N]); G for one scale per G input channels
            (scales [N, K // G], K % G == 0), which GGUF Q8_0 needs.
    Buffers (besides qweight, scales, bias): outlier_idx int64 [num_outliers] (sorted, distinct) and
    outlier_weight float [N, num_outliers], or None for a plain INT8 layer.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int | None = None, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if group_size is not None and in_features % group_size:
            raise ValueError(f"int8 group_size {group_size} must divide in_features {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(scale_shape, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)
        self.register_buffer("outlier_idx", None)
        self.register_buffer("outlier_weight", None)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> WeightOnlyInt8Linear:
        """Round-to-nearest, symmetric per output channel: scale = max|w_n| / 127."""
        qweight, scales = quantize_int8(linear.weight.detach())
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    dtype=linear.weight.dtype)
        layer.load_quantized(qweight, scales, linear.bias)
        return layer

    def load_quantized(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                       outlier_idx: torch.Tensor | None = None, outlier_weight: torch.Tensor | None = None):
        """Copy canonical tensors in (shapes checked; scales cast to the layer's float dtype). outlier_idx
        (integer [num_outliers], sorted, distinct, < K) and outlier_weight ([N, num_outliers]) come together;
        ValueError otherwise."""
        _copy_checked(self, "qweight", qweight)
        _copy_checked(self, "scales", scales)
        if bias is not None:
            _copy_checked(self, "bias", bias)
        if (outlier_idx is None) != (outlier_weight is None):
            raise ValueError("outlier_idx and outlier_weight come together")
        if outlier_idx is not None:
            if outlier_idx.dim() != 1 or outlier_idx.is_floating_point() or outlier_idx.dtype == torch.bool:
                raise ValueError(f"outlier_idx must be a 1-D integer tensor, got {outlier_idx.dtype} "
                                 f"{tuple(outlier_idx.shape)}")
            if not outlier_weight.is_floating_point():
                raise ValueError(f"outlier_weight must be float, got {outlier_weight.dtype}")
            idx = outlier_idx.detach().to(torch.long)
            if idx.numel() and (idx.min() < 0 or idx.max() >= self.in_features or not bool((idx.diff() > 0).all())):
                raise ValueError(f"outlier_idx must be sorted distinct input channels < {self.in_features}")
            if tuple(outlier_weight.shape) != (self.out_features, idx.numel()):
                raise ValueError(f"outlier_weight: expected shape {(self.out_features, idx.numel())}, "
                                 f"got {tuple(outlier_weight.shape)}")
            if bool(self.qweight[:, idx.to(self.qweight.device)].any()):
                raise ValueError("qweight must hold zero codes in the outlier columns (they are outlier_weight's)")
            self.outlier_idx = idx.to(self.qweight.device)
            self.outlier_weight = outlier_weight.detach().to(self.qweight.device, self.scales.dtype).clone()
        return self

    def dequantize(self) -> torch.Tensor:
        """Reference path: [N, K] float weight in the scales' dtype (outlier columns included)."""
        if self.group_size is None:
            w = self.qweight.to(self.scales.dtype) * self.scales[:, None]
        else:
            q = self.qweight.to(self.scales.dtype).view(self.out_features, -1, self.group_size)
            w = (q * self.scales[..., None]).view(self.out_features, self.in_features)
        if self.outlier_idx is not None:
            w[:, self.outlier_idx] = self.outlier_weight
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size is None and use_triton(x):
            from tandem.kernels.quant_gemm import w8a16_gemm

            y = w8a16_gemm(x.reshape(-1, self.in_features).contiguous(), self.qweight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.scales.dtype == torch.float32 and (
                x2 := _vnni_rows(x, self.in_features, self.group_size or self.in_features)) is not None:
            y = cpu_qgemm.gemm_vnni(x2, self._packed_vnni()).view(*x.shape[:-1], self.out_features)
        elif self.scales.dtype == torch.float32 and (
                x2 := _cpu_kernel_rows(x, self.in_features, self.group_size or self.in_features)) is not None:
            scales = self.scales.view(self.out_features, -1)  # per channel: one group of K
            y = cpu_qgemm.int8_gemm(x2.contiguous(), self.qweight, scales, self.group_size or self.in_features)
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.group_size is None:  # the per-channel scale commutes with the matmul
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype))
        if self.outlier_idx is not None and self.outlier_idx.numel():  # qweight is zero in these columns
            y = y + F.linear(x.index_select(-1, self.outlier_idx), self.outlier_weight.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _packed_vnni(self) -> cpu_qgemm.VnniWeight:
        """The weight in gemm_vnni's layout, made on first use and kept until the buffers change."""
        scales = self.scales.view(self.out_features, -1)  # per channel: one group of K
        return _derived(self, "_vnni_weight", (self.qweight, self.scales), lambda: cpu_qgemm.pack_vnni(
            self.qweight, scales, None, self.group_size or self.in_features))

    def extra_repr(self) -> str:
        outliers = "" if self.outlier_idx is None else f", num_outliers={self.outlier_idx.numel()}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
                + outliers)


class WeightOnlyInt4Linear(nn.Module):
    """y = x @ ((q - zeros) * scales).T (+ bias); 4-bit weights, asymmetric per group of group_size along K.

    GPTQ (Frantar et al. 2022) and AWQ (Lin et al. 2023) both produce this format; see the module docstring
    for the layout and the padding rule when group_size does not divide K.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        k_pad = padded_in_features(in_features, group_size)
        self.register_buffer("qweight", torch.zeros(out_features, k_pad // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, k_pad // group_size, dtype=dtype))
        self.register_buffer("zeros", torch.zeros(out_features, k_pad // group_size, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)

    @property
    def padded_in_features(self) -> int:
        return padded_in_features(self.in_features, self.group_size)

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 128) -> WeightOnlyInt4Linear:
        """Round-to-nearest with each group's [min, max] mapped onto [0, 15] (float zero point)."""
        q, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        layer = cls(linear.in_features, linear.out_features, group_size, bias=linear.bias is not None,
                    dtype=linear.weight.dtype)
        layer.load_quantized(pack_int4(q), scales, zeros, linear.bias)
        return layer

    def load_quantized(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bias: torch.Tensor | None = None):
        """Copy canonical tensors in: qweight uint8 [N, K_pad // 2], scales/zeros [N, K_pad // G]."""
        _copy_checked(self, "qweight", qweight)
        _copy_checked(self, "scales", scales)
        _copy_checked(self, "zeros", zeros)
        if bias is not None:
            _copy_checked(self, "bias", bias)
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reference path: [N, K] float weight (padded columns dropped), in dtype or the scales' dtype."""
        dtype = dtype or self.scales.dtype
        n, num_groups = self.scales.shape
        # Writing both nibbles straight into a float buffer avoids an extra uint8 copy (about 2x on CPU).
        w = torch.empty(n, num_groups, self.group_size, dtype=dtype, device=self.qweight.device)
        pairs = w.view(n, -1, 2)  # [N, K_pad // 2, 2]
        pairs[..., 0] = self.qweight & 0xF
        pairs[..., 1] = self.qweight >> 4
        w.sub_(self.zeros.to(dtype)[..., None]).mul_(self.scales.to(dtype)[..., None])
        return w.view(n, -1)[:, : self.in_features]

    def _cpu_kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes in the CPU kernel's order, zeros * scales), made on first use and kept until the buffers change."""
        return _derived(self, "_cpu_weights", (self.qweight, self.scales, self.zeros), lambda: (
            cpu_qgemm.repack_int4(self.qweight), (self.zeros * self.scales).contiguous()))

    def _packed_vnni(self) -> cpu_qgemm.VnniWeight:
        """The weight in gemm_vnni's layout, made on first use and kept until the buffers change."""
        return _derived(self, "_vnni_weight", (self.qweight, self.scales, self.zeros), lambda: cpu_qgemm.pack_vnni(
            unpack_int4(self.qweight), self.scales, self.zeros, self.group_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from tandem.kernels.quant_gemm import w4a16_gemm

            x2 = x.reshape(-1, self.in_features)
            if self.padded_in_features != self.in_features:
                x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
            y = w4a16_gemm(x2.contiguous(), self.qweight, self.scales, self.zeros, self.group_size)
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.scales.dtype == torch.float32 and (
                x2 := _vnni_rows(x, self.padded_in_features, self.group_size)) is not None:
            if self.padded_in_features != self.in_features:
                x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
            y = cpu_qgemm.gemm_vnni(x2, self._packed_vnni()).view(*x.shape[:-1], self.out_features)
        elif self.scales.dtype == torch.float32 and (
                x2 := _cpu_kernel_rows(x, self.padded_in_features, self.group_size)) is not None:
            if self.padded_in_features != self.in_features:
                x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
            codes, zero_scales = self._cpu_kernel_weights()
            y = cpu_qgemm.int4_gemm(x2.contiguous(), codes, self.scales, zero_scales, self.group_size)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class ConcatLinear(nn.Module):
    """Linears of different formats that read one input, behind one output: y = cat([layer(x), ...], -1).
    concat_linears returns it when the layers cannot share one weight (a mixed-precision checkpoint that keeps
    k_proj in float and q_proj in INT4): each layer runs its own kernel."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.in_features, self.out_features = layers[0].in_features, sum(layer.out_features for layer in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


def concat_linears(layers: list[nn.Module]) -> nn.Module:
    """One layer whose output is the layers' outputs concatenated on the last dim (fused QKV, fused gate/up).

    Layers of one type (nn.Linear, WeightOnlyInt8Linear or WeightOnlyInt4Linear) with one group size, bias
    presence and outlier channels have their weights (codes, scales, zeros, biases, outlier columns) stacked
    along N: each output element is the same dot product as before the fusion. Other mixes (mixed precision)
    come back as a ConcatLinear. ValueError if the layers' in_features differ.
    """
    first = layers[0]
    kind = type(first)
    if len({layer.in_features for layer in layers}) != 1:
        raise ValueError(f"fused layers need one in_features, got {[layer.in_features for layer in layers]}")
    has_bias = [layer.bias is not None for layer in layers]
    outliers = [getattr(layer, "outlier_idx", None) for layer in layers]
    same_outliers = all(o is None for o in outliers) or (
        all(o is not None for o in outliers) and all(torch.equal(o, outliers[0]) for o in outliers))
    if (any(type(layer) is not kind for layer in layers)
            or kind not in (nn.Linear, WeightOnlyInt8Linear, WeightOnlyInt4Linear)
            or len({getattr(layer, "group_size", None) for layer in layers}) != 1
            or any(has_bias) != all(has_bias) or not same_outliers):
        return ConcatLinear(layers)
    out_features = sum(layer.out_features for layer in layers)

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(layer, name).detach() for layer in layers])

    if kind is nn.Linear:
        weight = cat("weight")
        fused = nn.Linear(first.in_features, out_features, bias=all(has_bias), device=weight.device,
                          dtype=weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(weight)
            if fused.bias is not None:
                fused.bias.copy_(cat("bias"))
        return fused
    bias = cat("bias") if all(has_bias) else None
    if kind is WeightOnlyInt8Linear:
        fused = WeightOnlyInt8Linear(first.in_features, out_features, first.group_size, bias=bias is not None,
                                     dtype=first.scales.dtype)
        outlier_weight = None if outliers[0] is None else cat("outlier_weight")
        return fused.to(first.qweight.device).load_quantized(cat("qweight"), cat("scales"), bias, outliers[0],
                                                             outlier_weight)
    fused = WeightOnlyInt4Linear(first.in_features, out_features, first.group_size, bias=bias is not None,
                                 dtype=first.scales.dtype)
    return fused.to(first.qweight.device).load_quantized(cat("qweight"), cat("scales"), cat("zeros"), bias)


def _derived(module: nn.Module, name: str, sources: tuple[torch.Tensor, ...], make):
    """module.<name>, a kernel layout derived from the sources (not saved), made again whenever a source was
    replaced (load_state_dict(assign=True)) or changed in place (load_quantized, a state dict copied in): keyed
    on each tensor's storage and version counter."""
    key = tuple((t.data_ptr(), t._version) for t in sources)
    cached = getattr(module, name, None)
    if cached is None or cached[0] != key:
        cached = (key, make())
        setattr(module, name, cached)
    return cached[1]


def _copy_checked(module: nn.Module, name: str, value: torch.Tensor) -> None:
    buf = getattr(module, name)
    if buf is None or tuple(buf.shape) != tuple(value.shape):
        shape = None if buf is None else tuple(buf.shape)
        raise ValueError(f"{type(module).__name__}.{name}: expected shape {shape}, got {tuple(value.shape)}")
    if buf.dtype in (torch.int8, torch.uint8) and value.dtype != buf.dtype:
        raise ValueError(f"{type(module).__name__}.{name}: expected {buf.dtype}, got {value.dtype}")
    buf.copy_(value.detach())
