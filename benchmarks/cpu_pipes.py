"""What bounds the integer GEMM on this CPU: the throughput of vpdpwssd alone and mixed with each other operation
of gemm_vnni's inner loop and fold (kernels/cpu/qgemm_vnni.cpp), in cycles per loop of 12 independent vpdpwssd
(zmm) plus 3 of the other instruction, on one thread.

    python -m tandem.benchmarks.cpu_pipes [--iterations 50000000]

Cycles are seconds x the clock that the loop of 12 vpdpwssd alone implies at one per cycle (AMD Zen 4: two 256-bit
multiply pipes, a zmm vpdpwssd takes both for a cycle), so 12.0 means the 3 extra instructions issue beside the
vpdpwssd for free and 15.0 that they take the same pipes. Built with torch's cpp_extension (inline asm: the
compiler can neither drop nor reorder the loop); needs AVX-512 VNNI and BF16.
"""
from __future__ import annotations

import argparse

import torch

# (name, 3 extra instructions after the 12 vpdpwssd; operands: zmm16, zmm17 inputs, zmm12-14 outputs, %0 memory)
MIXES = [
    ("12 vpdpwssd alone", ""),
    ("+ 3 vfmadd231ps (the fold's FMAs)", "vfmadd231ps %%zmm16,%%zmm17,%%zmm{r}"),
    ("+ 3 vmulps (the fold's scale product)", "vmulps %%zmm16,%%zmm17,%%zmm{r}"),
    ("+ 3 vaddps", "vaddps %%zmm16,%%zmm17,%%zmm{r}"),
    ("+ 3 vcvtdq2ps (the fold's int32 -> fp32)", "vcvtdq2ps %%zmm16,%%zmm{r}"),
    ("+ 3 vpandd (int4 low nibbles)", "vpandd %%zmm16,%%zmm17,%%zmm{r}"),
    ("+ 3 vpsrlw (int4 high nibbles)", "vpsrlw $4,%%zmm16,%%zmm{r}"),
    ("+ 3 vpmovzxbw (codes to int16)", "vpmovzxbw %%ymm16,%%zmm{r}"),
    ("+ 3 vpbroadcastd from memory", "vpbroadcastd {o}(%0),%%zmm{r}"),
    ("+ 3 vpmaddwd", "vpmaddwd %%zmm16,%%zmm17,%%zmm{r}"),
    ("+ 3 vdpbf16ps", "vdpbf16ps %%zmm16,%%zmm17,%%zmm{r}"),
]


def _source() -> str:
    dots = "".join(f'"vpdpwssd %%zmm16,%%zmm17,%%zmm{i}\\n"' for i in range(12))
    bodies = []
    for j, (_, extra) in enumerate(MIXES):
        more = "".join(f'"{extra.format(r=12 + i, o=4 * i)}\\n"' for i in range(3)) if extra else ""
        bodies.append(f"""
double mix{j}(int64_t n) {{
  alignas(64) static int32_t buf[16] = {{1}};
  const int32_t* p = buf;
  auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i)
    asm volatile({dots} {more} :: "r"(p) : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
                 "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / n;
}}""")
    binds = "".join(f'  m.def("mix{j}", &mix{j});\n' for j in range(len(MIXES)))
    return ("#include <torch/extension.h>\n#include <chrono>\n#include <cstdint>\n" + "".join(bodies)
            + f"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}}}\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=5, help="each mix's best of this many runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("tandem_cpu_pipes", cpp_sources=_source(), extra_cflags=["-O2", "-march=native"])
    seconds = [float("inf")] * len(MIXES)
    for _ in range(args.rounds):  # (the mixes in turns, each its best: a shared machine's noise only slows)
        for j in range(len(MIXES)):
            seconds[j] = min(seconds[j], getattr(ext, f"mix{j}")(args.iterations))
    cycle = seconds[0] / 12  # the clock, taking 12 vpdpwssd alone at one per cycle
    print(f"clock implied: {1e-9 / cycle:.2f} GHz; cycles per loop (12 vpdpwssd zmm + 3 of the instruction)")
    for (name, _), s in zip(MIXES, seconds):
        print(f"  {name:<42} {s / cycle:5.1f}")


if __name__ == "__main__":
    main()
