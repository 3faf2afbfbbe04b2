"""The dense CPU GEMM (kernels/cpu/dense_gemm.cpp) against torch's matmul on the default model's linear shapes,
fp32 and bf16, over rows of x from a decode step's to a prefill chunk's, with the copy bandwidth measured in the
same run (the floor of a weight-bound call: its weight bytes over that bandwidth).

    python -m tandem.benchmarks.dense_gemm [--kernel-threads 2] [--torch-threads 1,2] [--rows 1,4,...,512]
                                           [--dtypes float32,bfloat16]

Per shape, dtype and M: the kernel's time per call (the best of --repeats), the weight bytes it reads per second,
its GFLOP/s; for bf16 where the packed path runs (kernels/cpu/dense_gemm_packed.cpp, from 6 rows), the per-row
kernel's GFLOP/s too; torch's F.linear's GFLOP/s on each of --torch-threads, and torch's time (on the first) over
the kernel's. The engine runs torch on one thread and the kernel on its tier's kernel threads: the first of the
default --torch-threads compares what a decode engine runs, the second what oneDNN would do with both cores.
"""
from __future__ import annotations

import argparse
import time

import torch

from tandem.benchmarks.model_shapes import memory_bandwidth_gb_s
from tandem.kernels import cpu_dense, cpu_ext

# (name, N, K) of SmolLM2-135M's linears: fused q/k/v, o_proj, fused gate/up, down_proj, the LM head
SHAPES = [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536),
          ("lm_head", 49152, 576)]


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel-threads", type=int, default=2)
    parser.add_argument("--torch-threads", default="1,2", help="torch's thread counts, each timed (the first: the "
                        "torch/kernel ratio)")
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not cpu_ext.available():
        raise SystemExit("the CPU kernels are not available here (see the warning above)")
    torch_threads = [int(t) for t in args.torch_threads.split(",")]
    bandwidth = memory_bandwidth_gb_s(args.kernel_threads)
    cpu_ext.set_num_threads(args.kernel_threads)
    print(f"copy bandwidth {bandwidth} GB/s ({args.kernel_threads} threads); kernel on {args.kernel_threads} "
          f"threads, torch on {args.torch_threads}; GFLOP/s (per-row: bf16's per-row kernel where the packed path "
          f"runs, {cpu_dense.has_packed_bf16()} here)")
    print(f"{'linear':13} {'dtype':8} {'M':>4} {'kernel us':>10} {'GB/s':>6} {'kernel':>7} {'per-row':>7} "
          + " ".join(f"{f'torch x{t}':>8}" for t in torch_threads) + f" {'torch/kernel':>12}")
    g = torch.Generator().manual_seed(0)
    ext = cpu_ext.extension()  # (the kernel at every M, past MAX_ROWS too)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, n, k in SHAPES:
            weight = torch.randn(n, k, generator=g).to(dtype)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=g).to(dtype)
                gflop = 2 * m * n * k / 1e3  # (over us: GFLOP/s)
                ours = best_us(lambda: ext.dense_gemm(x, weight, None), args.repeats)
                per_row = "-"
                if dtype == torch.bfloat16 and cpu_dense.has_packed_bf16():
                    rows_us = best_us(lambda: ext.dense_gemm(x, weight, None, packed=False), args.repeats)
                    per_row = f"{gflop / rows_us:.0f}"
                theirs = []
                for t in torch_threads:
                    torch.set_num_threads(t)
                    theirs.append(best_us(lambda: torch.nn.functional.linear(x, weight), args.repeats))
                gb_s = weight.numel() * weight.element_size() / ours / 1e3
                print(f"{name:13} {str(dtype)[6:]:8} {m:4} {ours:10.0f} {gb_s:6.1f} {gflop / ours:7.0f} {per_row:>7} "
                      + " ".join(f"{gflop / us:8.0f}" for us in theirs) + f" {theirs[0] / ours:12.2f}")
    print("kernel used by the engine up to M =", {str(d)[6:]: r or "any" for d, r in cpu_dense.MAX_ROWS.items()})


if __name__ == "__main__":
    main()
