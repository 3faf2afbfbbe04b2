"""The dense CPU GEMM (kernels/cpu/dense_gemm.cpp) against torch's matmul on the default model's linear shapes,
fp32 and bf16, over rows of x from a decode step's to a prefill chunk's, with the copy bandwidth measured in the
same run (the floor of a weight-bound call: its weight bytes over that bandwidth).

    python -m tandem.benchmarks.dense_gemm [--kernel-threads 2] [--torch-threads 1,2] [--rows 1,4,...,512]
                                           [--dtypes float32,bfloat16] [--step-rows 1,8,16,22,32]

Per shape, dtype and M: the kernel's time per call (the best of --repeats), the weight bytes it reads per second,
its GFLOP/s; where the packed path is built (kernels/cpu/dense_gemm_packed.cpp, from 22 rows) the per-row kernel's
GFLOP/s and the packed one's; torch's F.linear's GFLOP/s on each of --torch-threads, and torch's time (on the
first) over the kernel's. The engine runs torch on one thread and the kernel on its tier's kernel threads: the
first of the default --torch-threads compares what a decode engine runs, the second what oneDNN would do with both
cores. One weight per shape is called again and again, so it is read from the caches.

Then a decode step's linears as a decode runs them (--step-rows; an empty value skips it): every layer's weights
and the LM head, distinct tensors (hundreds of MB), so that they stream from memory, each called once per pass in
the model's order; per dtype and M, ms per pass (the best of 5) through the per-row path and through the packed
one. This is what PACKED_MIN_ROWS in kernels/cpu/dense_gemm.cpp is chosen by.
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
NUM_LAYERS = 30  # SmolLM2-135M's


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
    parser.add_argument("--step-rows", default="1,8,16,22,32", help="rows of the decode-step table ('': none)")
    args = parser.parse_args(argv)
    if not cpu_ext.available():
        raise SystemExit("the CPU kernels are not available here (see the warning above)")
    torch_threads = [int(t) for t in args.torch_threads.split(",")]
    bandwidth = memory_bandwidth_gb_s(args.kernel_threads)
    cpu_ext.set_num_threads(args.kernel_threads)
    print(f"copy bandwidth {bandwidth} GB/s ({args.kernel_threads} threads); kernel on {args.kernel_threads} "
          f"threads, torch on {args.torch_threads}; GFLOP/s (per-row and packed: each path, where the packed one is "
          f"built: fp32 {cpu_dense.has_packed(torch.float32)}, bf16 {cpu_dense.has_packed(torch.bfloat16)} here)")
    print(f"{'linear':13} {'dtype':8} {'M':>4} {'kernel us':>10} {'GB/s':>6} {'kernel':>7} {'per-row':>7} "
          f"{'packed':>7} " + " ".join(f"{f'torch x{t}':>8}" for t in torch_threads) + f" {'torch/kernel':>12}")
    g = torch.Generator().manual_seed(0)
    ext = cpu_ext.extension()  # (the kernel at every M, past MAX_ROWS too)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, n, k in SHAPES:
            weight = torch.randn(n, k, generator=g).to(dtype)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=g).to(dtype)
                gflop = 2 * m * n * k / 1e3  # (over us: GFLOP/s)
                ours = best_us(lambda: ext.dense_gemm(x, weight, None), args.repeats)
                per_row = packed = "-"
                if cpu_dense.has_packed(dtype):
                    rows_us = best_us(lambda: ext.dense_gemm(x, weight, None, packed=False), args.repeats)
                    packed_us = best_us(lambda: ext.dense_gemm(x, weight, None, packed=True), args.repeats)
                    per_row, packed = f"{gflop / rows_us:.0f}", f"{gflop / packed_us:.0f}"
                theirs = []
                for t in torch_threads:
                    torch.set_num_threads(t)
                    theirs.append(best_us(lambda: torch.nn.functional.linear(x, weight), args.repeats))
                gb_s = weight.numel() * weight.element_size() / ours / 1e3
                print(f"{name:13} {str(dtype)[6:]:8} {m:4} {ours:10.0f} {gb_s:6.1f} {gflop / ours:7.0f} {per_row:>7} "
                      f"{packed:>7} " + " ".join(f"{gflop / us:8.0f}" for us in theirs) + f" {theirs[0] / ours:12.2f}")
    print("kernel used by the engine up to M =", {str(d)[6:]: r or "any" for d, r in cpu_dense.MAX_ROWS.items()})
    if args.step_rows:
        step_linears(args.dtypes, [int(r) for r in args.step_rows.split(",")])


def step_linears(dtypes: str, rows: list[int]) -> None:
    """The decode-step table (see the module's docstring)."""
    ext, g = cpu_ext.extension(), torch.Generator().manual_seed(1)
    print("\na decode step's linears, the weights streaming from memory: ms per pass (best of 5)")
    print(f"{'dtype':8} {'M':>4} {'per-row':>8} {'packed':>8} {'GB/s':>6} {'GFLOP/s':>8}")
    shapes = [(n, k) for _, n, k in SHAPES[:-1]] * NUM_LAYERS + [SHAPES[-1][1:]]
    for dtype in (getattr(torch, d) for d in dtypes.split(",")):
        weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in shapes]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        flop_per_row = sum(2 * w.numel() for w in weights)
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, k in shapes}}
            times = {}
            for path in ((False, True) if cpu_dense.has_packed(dtype) else (False,)):
                def one_pass():
                    for w in weights:
                        ext.dense_gemm(xs[w.shape[1]], w, None, packed=path)
                times[path] = best_us(one_pass, 5) / 1e3
            best = min(times.values())
            print(f"{str(dtype)[6:]:8} {m:4} {times[False]:8.2f} {times.get(True, float('nan')):8.2f} "
                  f"{nbytes / best / 1e6:6.1f} {flop_per_row * m / best / 1e6:8.1f}")


if __name__ == "__main__":
    main()
