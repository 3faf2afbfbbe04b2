"""The batched LoRA delta's C++ kernel (kernels/cpu/lora.cpp) against its torch reference (kernels/lora.py
add_lora_ref) and against the base linear it rides on (kernels/cpu_dense, the engine's dense kernel), on the default
model's linears.

    python -m tandem.benchmarks.lora_kernel [--kernel-threads 2] [--ranks 8,16,64] [--decode 1,8,32]
                                            [--prefill 512] [--dtypes bfloat16,float32] [--max-loras 8]

Per linear, dtype, adapter rank r and batch: the kernel's time per call (best of --repeats), the reference's (torch
on one thread, as the engine runs it), the base linear's, and the kernel's time over each. A linear's slots hold
r per part, as the engine stacks them (shared/lora/targets.py): rank 3r for the fused q/k/v, 2r for gate/up. A decode
batch is one-row segments, segment i using slot i % --max-loras (each a different adapter up to that many); a
prefill batch is one segment of --prefill rows. Numbers printed, nothing asserted.
"""
from __future__ import annotations

import argparse

import torch

from tandem.kernels import cpu_dense, cpu_ext, cpu_lora
from tandem.benchmarks.dense_gemm import best_us
from tandem.kernels.lora import add_lora_ref

# (name, N, K, parts) of SmolLM2-135M's linears that take adapters
SHAPES = [("qkv_proj", 960, 576, 3), ("o_proj", 576, 576, 1), ("gate_up_proj", 3072, 576, 2),
          ("down_proj", 576, 1536, 1)]


def batches(decode: list[int], prefill: int | None, num_slots: int) -> list[tuple[str, int, list[tuple]]]:
    """(label, T, [(start, len, slot)]) per batch."""
    out = [(f"decode x{n}", n, [(i, 1, i % num_slots) for i in range(n)]) for n in decode]
    if prefill:
        out.append((f"prefill {prefill}", prefill, [(0, prefill, 0)]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel-threads", type=int, default=2)
    parser.add_argument("--ranks", default="8,16,64", help="adapter ranks r (per part)")
    parser.add_argument("--decode", default="1,8,32", help="decode batches: one-row segments each")
    parser.add_argument("--prefill", type=int, default=512, help="rows of the prefill segment (0: none)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--max-loras", type=int, default=8, help="adapter slots L")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not cpu_ext.available():
        raise SystemExit("the CPU kernels are not available here (see the warning above)")
    cpu_ext.set_num_threads(args.kernel_threads)
    torch.set_num_threads(1)
    print(f"kernel and base linear on {args.kernel_threads} kernel threads, the reference on 1 torch thread; "
          f"L = {args.max_loras} slots; times in us per call")
    print(f"{'linear':13} {'dtype':8} {'r':>3} {'R':>4} {'batch':12} {'kernel':>8} {'ref':>8} {'base':>8} "
          f"{'ref/kernel':>10} {'kernel/base':>11}")
    g = torch.Generator().manual_seed(0)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, n, k, parts in SHAPES:
            weight = torch.randn(n, k, generator=g).to(dtype)
            for r in (int(v) for v in args.ranks.split(",")):
                rank = r * parts
                lora_a = (torch.randn(args.max_loras, rank, k, generator=g) / k**0.5).to(dtype)
                lora_b = (torch.randn(args.max_loras, n, rank, generator=g) / rank**0.5).to(dtype)
                decode = [int(v) for v in args.decode.split(",") if v]
                for label, t, segments in batches(decode, args.prefill, args.max_loras):
                    x = torch.randn(t, k, generator=g).to(dtype)
                    y = torch.randn(t, n, generator=g).to(dtype)
                    segs = [torch.tensor([s[i] for s in segments], dtype=torch.int64) for i in range(3)]
                    assert cpu_lora.supports(y, x)
                    ours = best_us(lambda: cpu_lora.add_lora(y, x, lora_a, lora_b, *segs), args.repeats)
                    ref = best_us(lambda: add_lora_ref(y, x, lora_a, lora_b, *segs), max(3, args.repeats // 4))
                    base = best_us(lambda: cpu_dense.linear_supported(x, weight), args.repeats)
                    print(f"{name:13} {str(dtype)[6:]:8} {r:3} {rank:4} {label:12} {ours:8.1f} {ref:8.1f} "
                          f"{base:8.1f} {ref / ours:10.1f} {ours / base:11.2f}")


if __name__ == "__main__":
    main()
