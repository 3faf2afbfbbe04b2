"""Time each Triton kernel against its torch reference on CUDA: `python -m tandem.kernels.bench`.

Prints time, achieved memory bandwidth (GB/s) and compute (TFLOP/s) beside the device's peak, and the
largest difference from the reference. Takes about a minute (mostly compilation); without CUDA it prints a
message and exits 0.
"""

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import triton

from tandem.kernels.int4_format import pack_int4
from tandem.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from tandem.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from tandem.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tandem.kernels.quant_gemm import w4a16_gemm, w4a16_gemm_ref, w8a16_gemm, w8a16_gemm_ref
from tandem.kernels.rmsnorm import rms_norm, rms_norm_ref

# Dense bf16 peaks: (HBM bytes/s, FLOP/s), matched against torch.cuda.get_device_name().
DEVICE_PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100": (3.35e12, 989e12),
    "A100": (2.0e12, 312e12),
    "L40S": (0.864e12, 362e12),
    "L4": (0.3e12, 121e12),
}


@dataclass(frozen=True)
class Case:
    name: str
    kernel: Callable[[], object]
    ref: Callable[[], object]
    bytes_moved: float  # minimum HBM traffic of one call
    flops: float


def _paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, device):
    blocks = [triton.cdiv(n, block_size) for n in context_lens]
    total = sum(blocks)
    ids = torch.randperm(total, device=device).int()
    tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = ids[start:start + n]
        start += n
    shape = (total, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device), tables


def _decode_case(num_seqs, context_len, heads: tuple[int, int, int], dtype, device) -> Case:
    num_q_heads, num_kv_heads, head_dim = heads
    lens = [context_len] * num_seqs
    k, v, tables = _paged_kv(lens, 16, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(num_seqs, num_q_heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (q, k, v, tables, context_lens, head_dim ** -0.5)
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * k.element_size()
    return Case(f"decode seqs={num_seqs} ctx={context_len} heads={num_q_heads}/{num_kv_heads} d={head_dim}",
                lambda: paged_decode_attention(*args), lambda: paged_decode_attention_ref(*args),
                kv_bytes + 2 * q.numel() * q.element_size(), 4 * num_seqs * num_q_heads * context_len * head_dim)


def _prefill_case(num_seqs, query_len, context_len, heads: tuple[int, int, int], dtype, device) -> Case:
    num_q_heads, num_kv_heads, head_dim = heads
    k, v, tables = _paged_kv([context_len] * num_seqs, 16, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(num_seqs * query_len, num_q_heads, head_dim, dtype=dtype, device=device)
    starts = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * query_len
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    args = (q, k, v, tables, starts, context_lens, head_dim ** -0.5)
    prefix = context_len - query_len
    visible = query_len * prefix + query_len * (query_len + 1) / 2  # causal (query, key) pairs per head
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * k.element_size()
    return Case(f"prefill seqs={num_seqs} q={query_len} ctx={context_len} heads={num_q_heads}/{num_kv_heads}",
                lambda: paged_prefill_attention(*args), lambda: paged_prefill_attention_ref(*args),
                kv_bytes + 2 * q.numel() * q.element_size(), 4 * num_seqs * num_q_heads * visible * head_dim)


def _write_case(num_tokens, num_kv_heads, head_dim, dtype, device) -> Case:
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    caches = [torch.zeros(num_tokens // 16 + 1, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
              for _ in range(4)]
    slots = torch.randperm(caches[0].shape[0] * 16, device=device)[:num_tokens]

    def run(fn, key_cache, value_cache):
        fn(key, value, key_cache, value_cache, slots)
        return key_cache, value_cache

    return Case(f"write_kv_cache tokens={num_tokens} heads={num_kv_heads} d={head_dim}",
                lambda: run(write_kv_cache, *caches[:2]), lambda: run(write_kv_cache_ref, *caches[2:]),
                4 * key.numel() * key.element_size(), 0.0)


def _w8_case(M, N, K, dtype, device) -> Case:
    x = torch.randn(M, K, dtype=dtype, device=device)
    qweight = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device)
    scales = torch.rand(N, dtype=dtype, device=device) / 100
    args = (x, qweight, scales)
    return Case(f"w8a16 M={M} N={N} K={K}", lambda: w8a16_gemm(*args), lambda: w8a16_gemm_ref(*args),
                N * K + 2 * (M * K + M * N) * x.element_size(), 2 * M * N * K)


def _w4_case(M, N, K, group_size, dtype, device) -> Case:
    x = torch.randn(M, K, dtype=dtype, device=device)
    qweight = pack_int4(torch.randint(0, 16, (N, K), device=device))
    scales = torch.rand(N, K // group_size, dtype=dtype, device=device) / 10
    zeros = torch.full((N, K // group_size), 8.0, dtype=dtype, device=device)
    args = (x, qweight, scales, zeros, group_size)
    meta_bytes = 2 * scales.numel() * scales.element_size()
    return Case(f"w4a16 M={M} N={N} K={K} g={group_size}", lambda: w4a16_gemm(*args),
                lambda: w4a16_gemm_ref(*args), N * K / 2 + meta_bytes + (M * K + M * N) * x.element_size(),
                2 * M * N * K)


def _rms_case(num_tokens, hidden_size, dtype, device) -> Case:
    x = torch.randn(num_tokens, hidden_size, dtype=dtype, device=device)
    residual, weight = torch.randn_like(x), torch.ones(hidden_size, dtype=dtype, device=device)
    return Case(f"rms_norm+residual tokens={num_tokens} hidden={hidden_size}",
                lambda: rms_norm(x, weight, 1e-5, residual), lambda: rms_norm_ref(x, weight, 1e-5, residual),
                4 * x.numel() * x.element_size(), 0.0)


def make_cases(device: str = "cuda", small: bool = False) -> list[Case]:
    """Benchmark cases: Llama-3-8B-like shapes (32/8 heads, d=128, 4096 hidden) and SmolLM2-135M decode.
    small=True shrinks every shape (a smoke run on CPU under TRITON_INTERPRET=1)."""
    dt = torch.bfloat16 if not small else torch.float32
    s = 16 if small else 1  # shape divisor
    llama8b, smollm = (32, 8, 128), (9, 3, 64)  # (query heads, KV heads, head dim)
    return [
        _write_case(4096 // s, 8, 128, dt, device),
        _decode_case(64 // s, 4096 // s, llama8b, dt, device),
        _decode_case(4 // min(s, 4), 8192 // s, llama8b, dt, device),  # few sequences: context splits
        _decode_case(32 // s, 1024 // s, smollm, dt, device),
        _prefill_case(4 // min(s, 4), 2048 // s, 2048 // s, llama8b, dt, device),
        _prefill_case(4 // min(s, 4), 512 // s, 4096 // s, llama8b, dt, device),
        _w8_case(1, 4096 // s, 4096 // s, dt, device),
        _w8_case(2048 // s, 4096 // s, 4096 // s, dt, device),
        _w4_case(1, 4096 // s, 4096 // s, 128, dt, device),
        _w4_case(16, 14336 // s, 4096 // s, 128, dt, device),
        _w4_case(2048 // s, 4096 // s, 4096 // s, 128, dt, device),
        _rms_case(4096 // s, 4096 // s, dt, device),
    ]


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over a tensor or a tuple of tensors."""
    if isinstance(a, tuple):
        return max(max_abs_diff(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()


def main() -> int:
    if not torch.cuda.is_available():
        print("tandem.kernels.bench: no CUDA device, nothing to time (the kernels are tested on CPU by "
              "tests/unit/kernels with TRITON_INTERPRET=1).")
        return 0
    from triton.testing import do_bench

    name = torch.cuda.get_device_name()
    peak_bw, peak_flops = next((p for key, p in DEVICE_PEAKS.items() if key in name), (None, None))
    print(f"device: {name}; peak {peak_bw / 1e9 if peak_bw else '?'} GB/s, "
          f"{peak_flops / 1e12 if peak_flops else '?'} TFLOP/s dense bf16")
    print(f"{'case':58} {'triton ms':>9} {'ref ms':>9} {'speedup':>7} {'GB/s':>7} {'%bw':>5} "
          f"{'TFLOP/s':>8} {'%flop':>5} {'max|diff|':>9}")
    torch.manual_seed(0)
    for case in make_cases():
        diff = max_abs_diff(case.kernel(), case.ref())
        ms = do_bench(case.kernel, warmup=10, rep=50)
        ref_ms = do_bench(case.ref, warmup=2, rep=20)
        gbs = case.bytes_moved / ms / 1e6
        tflops = case.flops / ms / 1e9
        pct_bw = f"{100 * gbs * 1e9 / peak_bw:5.1f}" if peak_bw else "    ?"
        pct_flops = f"{100 * tflops * 1e12 / peak_flops:5.1f}" if peak_flops and case.flops else "    -"
        print(f"{case.name:58} {ms:9.4f} {ref_ms:9.4f} {ref_ms / ms:7.1f} {gbs:7.0f} {pct_bw} "
              f"{tflops:8.1f} {pct_flops} {diff:9.2e}")
        del case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
