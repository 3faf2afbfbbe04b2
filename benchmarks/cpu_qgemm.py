"""The CPU GEMMs of the quantized layers on the default model's shapes, in milliseconds per call (best of 3):
the integer kernel (gemm_vnni, AVX-512 VNNI only), the float kernel (int8_gemm / int4_gemm) and an fp32 matmul
on a dense weight of the same shape, at decode (M = 1, 8, 32) and prefill (M = 512) row counts, on 1 and 2
kernel threads (torch on 1 thread).

    python -m tandem.benchmarks.cpu_qgemm [--kernel-threads 1,2] [--rows 1,8,32,512]

Shapes: fused gate/up [3072, 576], down [576, 1536] and fused QKV [960, 576] in int4 per group of 32 (GGUF
Q4_1's layout), and the LM head [49152, 576] in int8 per group of 32 (Q8_0), each with random codes.
"""
from __future__ import annotations

import argparse
import time

import torch

from tandem.kernels import cpu_ext, cpu_qgemm
from tandem.kernels.int4_format import pack_int4

SHAPES = [("gate_up int4", 3072, 576, True), ("down int4", 576, 1536, True), ("qkv int4", 960, 576, True),
          ("lm_head int8", 49152, 576, False)]
GROUP_SIZE = 32


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def kernels_for(n: int, k: int, int4: bool):
    """(integer kernel or None, float kernel) calls on one random weight."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.05
    if int4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zeros = torch.rand(n, k // GROUP_SIZE, generator=gen) * 15
        repacked, zero_scales = cpu_qgemm.repack_int4(pack_int4(codes)), zeros * scales
        float_kernel = lambda x: cpu_qgemm.int4_gemm(x, repacked, scales, zero_scales, GROUP_SIZE)  # noqa: E731
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        zeros = None
        float_kernel = lambda x: cpu_qgemm.int8_gemm(x, codes, scales, GROUP_SIZE)  # noqa: E731
    if not cpu_qgemm.has_vnni():
        return None, float_kernel
    packed = cpu_qgemm.pack_vnni(codes, scales, zeros, GROUP_SIZE)
    return (lambda x: cpu_qgemm.gemm_vnni(x, packed)), float_kernel


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel-threads", default="1,2", help="comma list")
    parser.add_argument("--rows", default="1,8,32,512", help="comma list of M")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_qgemm.available():
        raise SystemExit("the CPU kernels are not available here (see kernels/cpu_ext.py)")
    print(f"integer kernel: {'yes' if cpu_qgemm.has_vnni() else 'no (this CPU has no AVX-512 VNNI)'}")
    print(f"{'threads':>7}  {'shape':<13} {'M':>4}  {'integer':>8}  {'float kern':>10}  {'fp32 mm':>8}")
    for threads in (int(t) for t in args.kernel_threads.split(",")):
        cpu_ext.set_num_threads(threads)
        for name, n, k, int4 in SHAPES:
            integer, float_kernel = kernels_for(n, k, int4)
            dense = torch.randn(n, k)
            for m in (int(r) for r in args.rows.split(",")):
                if n > 10000 and m > 32:
                    continue  # the LM head only sees the rows that are sampled
                x = torch.randn(m, k)
                repeats = 20 if m < 100 else 2
                times = [best_ms(lambda f=f: f(x), repeats) if f is not None else float("nan")
                         for f in (integer, float_kernel, lambda x: x @ dense.T)]
                print(f"{threads:>7}  {name:<13} {m:>4}  {times[0]:>8.3f}  {times[1]:>10.3f}  {times[2]:>8.3f}",
                      flush=True)
    cpu_ext.set_num_threads(1)


if __name__ == "__main__":
    main()
