"""The integer GEMM of the quantized layers (gemm_vnni, kernels/cpu/qgemm_vnni.cpp, AVX-512 VNNI) on the default
model's shapes: its two paths (the panel path, which runs from 3 to 255 rows, and the tile path) and the packed
bf16 GEMM (kernels/cpu/dense_gemm_packed.cpp) on a bf16 weight of the same shape, in GFLOP/s, at decode and
prefill row counts, on 1 and 2 kernel threads (torch on 1).

    python -m tandem.benchmarks.cpu_qgemm [--kernel-threads 1,2] [--rows 1,10,32,64,256,512] [--rounds 7]
                                          [--float-kernels] [--step-rows 1,8,16,32]

The machine is shared and noisy: the calls of one case run in turns, --rounds times (each turn about 20 ms of
calls), and each column is the median of its turns; the ratios compare medians of the same run. The two integer
paths are checked to give the same bits. --float-kernels adds the fp32-activation kernels (int8_gemm / int4_gemm,
kernels/cpu/qgemm.cpp) and torch's fp32 matmul.

Shapes: fused gate/up [3072, 576], down [576, 1536], fused QKV [960, 576] and o_proj [576, 576] in int4 per group
of 32 (GGUF Q4_1's layout), and the LM head [49152, 576] in int8 per group of 32 (Q8_0), each with random codes.

Then (--step-rows; an empty value skips it) a decode step's integer linears as a decode runs them: 30 layers of
those four and the LM head, distinct weights (about 140 MB with their scales), so that they stream from memory,
each called once per pass in the model's order through gemm_vnni's path for that M, on the last of
--kernel-threads; ms per pass, the best of 5.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.kernels import cpu_dense, cpu_ext, cpu_qgemm
from tandem.kernels.int4_format import pack_int4

SHAPES = [("gate_up int4", 3072, 576, True), ("down int4", 576, 1536, True), ("qkv int4", 960, 576, True),
          ("o_proj int4", 576, 576, True), ("lm_head int8", 49152, 576, False)]
GROUP_SIZE = 32
TURN_S = 0.02  # calls per turn: about this long


def median_seconds(calls: dict, rounds: int) -> dict:
    """{name: median seconds per call} over `rounds` turns of each call, the calls alternating."""
    reps = {}
    for name, fn in calls.items():
        fn()
        start = time.perf_counter()
        fn()
        reps[name] = max(1, int(TURN_S / max(time.perf_counter() - start, 1e-7)))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            times[name].append((time.perf_counter() - start) / reps[name])
    return {name: statistics.median(t) for name, t in times.items()}


def weights_for(n: int, k: int, int4: bool, float_kernels: bool):
    """(packed integer weight, bf16 weight, fp32-activation kernel or None, dense fp32 weight or None)."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.05
    if int4:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zeros = torch.rand(n, k // GROUP_SIZE, generator=gen) * 15
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        zeros = None
    packed = cpu_qgemm.pack_vnni(codes, scales, zeros, GROUP_SIZE)
    bf16 = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    if not float_kernels:
        return packed, bf16, None, None
    if int4:
        repacked, zero_scales = cpu_qgemm.repack_int4(pack_int4(codes)), zeros * scales
        float_kernel = lambda x: cpu_qgemm.int4_gemm(x, repacked, scales, zero_scales, GROUP_SIZE)  # noqa: E731
    else:
        float_kernel = lambda x: cpu_qgemm.int8_gemm(x, codes, scales, GROUP_SIZE)  # noqa: E731
    return packed, bf16, float_kernel, torch.randn(n, k, generator=gen)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel-threads", default="1,2", help="comma list")
    parser.add_argument("--rows", default="1,10,32,64,256,512", help="comma list of M")
    parser.add_argument("--rounds", type=int, default=7, help="turns of each call per case (medians)")
    parser.add_argument("--shapes", default=",".join(s[0].split()[0] for s in SHAPES),
                        help="comma list of: " + ", ".join(s[0].split()[0] for s in SHAPES))
    parser.add_argument("--float-kernels", action="store_true", help="also the fp32-activation kernels and torch")
    parser.add_argument("--step-rows", default="1,8,16,32", help="rows of the decode-step table ('': none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_qgemm.has_vnni():
        raise SystemExit("gemm_vnni needs the CPU kernels built for AVX-512 VNNI (see kernels/cpu_ext.py)")
    bf16_packed = cpu_dense.has_packed(torch.bfloat16)
    wanted = args.shapes.split(",")
    lo, hi = cpu_qgemm.VNNI_PANEL_ROWS
    print(f"GFLOP/s, median of {args.rounds} turns; tiles / panels: gemm_vnni's two paths (the engine runs panels "
          f"for {lo} to {hi - 1} rows), bf16: the packed bf16 GEMM "
          f"({'built' if bf16_packed else 'not built here'})")
    extra = f"  {'float kern':>10}  {'fp32 mm':>8}" if args.float_kernels else ""
    print(f"{'threads':>7}  {'shape':<13} {'M':>4}  {'tiles':>6}  {'panels':>6}  {'panels/tiles':>12}  {'bf16':>6}  "
          f"{'panels/bf16':>11}{extra}")
    for threads in (int(t) for t in args.kernel_threads.split(",")):
        cpu_ext.set_num_threads(threads)
        for name, n, k, int4 in (s for s in SHAPES if s[0].split()[0] in wanted):
            packed, bf16, float_kernel, dense = weights_for(n, k, int4, args.float_kernels)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                xb = x.to(torch.bfloat16)
                tiles = cpu_qgemm.gemm_vnni(x, packed, panels=False)
                if not torch.equal(cpu_qgemm.gemm_vnni(x, packed, panels=True), tiles):
                    raise SystemExit(f"{name} M={m}: the panel path's bits differ from the tile path's")
                calls = {"tiles": lambda: cpu_qgemm.gemm_vnni(x, packed, panels=False),
                         "panels": lambda: cpu_qgemm.gemm_vnni(x, packed, panels=True)}
                if bf16_packed:
                    calls["bf16"] = lambda: cpu_ext.extension().dense_gemm(xb, bf16, None, True)
                if args.float_kernels:
                    calls["float"] = lambda: float_kernel(x)
                    calls["fp32"] = lambda: x @ dense.T
                gflop = 2 * m * n * k / 1e9
                rate = {c: gflop / s for c, s in median_seconds(calls, args.rounds).items()}
                b = rate.get("bf16", float("nan"))
                extra = f"  {rate['float']:>10.0f}  {rate['fp32']:>8.0f}" if args.float_kernels else ""
                print(f"{threads:>7}  {name:<13} {m:>4}  {rate['tiles']:>6.0f}  {rate['panels']:>6.0f}  "
                      f"{rate['panels'] / rate['tiles']:>12.2f}  {b:>6.0f}  {rate['panels'] / b:>11.2f}{extra}",
                      flush=True)
    if args.step_rows:
        step_linears([int(r) for r in args.step_rows.split(",")])
    cpu_ext.set_num_threads(1)


def step_linears(rows: list[int], num_layers: int = 30) -> None:
    """The decode-step table (see the module's docstring)."""
    gen = torch.Generator().manual_seed(1)
    layers = [s for s in SHAPES if s[3]] * num_layers + [s for s in SHAPES if not s[3]]
    weights = []
    for _, n, k, int4 in layers:
        scales = torch.rand(n, k // GROUP_SIZE, generator=gen) * 0.05
        codes = (torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8) if int4
                 else torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8))
        zeros = torch.rand(n, k // GROUP_SIZE, generator=gen) * 15 if int4 else None
        weights.append((cpu_qgemm.pack_vnni(codes, scales, zeros, GROUP_SIZE), k))
    flop_per_row = sum(2 * n * k for _, n, k, _ in layers)
    print(f"\na decode step's integer linears ({num_layers} layers + LM head), the weights streaming from memory, "
          f"{cpu_ext.num_threads()} kernel threads: ms per pass (best of 5)")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in weights}}

        def one_pass() -> float:
            start = time.perf_counter()
            for weight, k in weights:
                cpu_qgemm.gemm_vnni(xs[k], weight)
            return time.perf_counter() - start

        one_pass()  # (warm-up)
        best = min(one_pass() for _ in range(5))
        print(f"M = {m:3}: {best * 1e3:7.2f} ms, {flop_per_row * m / best / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
