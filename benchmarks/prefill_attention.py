"""The CPU prefill attention kernel (kernels/cpu/prefill_attention.cpp) against torch's path for the same batch
(shared/attention.py's per-request gather + scaled_dot_product_attention on torch's one thread, what the engine ran
before the kernel), on the default model's attention shape (9 query heads, 3 KV heads, head_dim 64).

    python -m tandem.benchmarks.prefill_attention [--chunk 512] [--prefixes 0,512,1536] [--kernel-threads 1,2]
                                                   [--dtypes float32,bfloat16] [--repeats 12]

One layer's attention for one request: a chunk of --chunk query tokens after a cached prefix of each --prefixes.
The paths take turns, --repeats calls in a row each, 3 rounds; per path the best call, as wall time and as the
process's CPU time (with 1 kernel thread the steadier measure of per-core work on a shared machine: another
process's load inflates wall time; with 2 it counts both threads' work). GFLOP/s counts QK^T and PV over the visible
(causal) keys. Numbers printed, nothing asserted.
"""
from __future__ import annotations

import argparse
import time

import torch

from tandem.kernels import cpu_ext
from tandem.kernels.cpu_prefill_attention import paged_prefill_attention
from tandem.shared.attention import AttentionMetadata, _per_request_cpu

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def best_times(fns: dict, repeats: int, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """{name: (best wall seconds, best process CPU seconds)} of single calls: each fn called repeats times in a
    row, the fns taking turns for rounds rounds. (In a row, as an engine step calls the kernels: between calls of
    alternating paths the kernels' helper threads go to sleep and miss the next call's start.)"""
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                fn()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--prefixes", default="0,512,1536")
    parser.add_argument("--kernel-threads", default="1,2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, scale = args.chunk, HEAD_DIM**-0.5
    print(f"one layer, {Q_HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, chunk {n}; ms as wall / process CPU "
          f"(best of 3 x {args.repeats}); torch on 1 thread")
    print(f"{'dtype':>9} {'prefix':>6} {'threads':>7} {'torch':>15} {'kernel':>15} {'speedup':>13} {'GFLOP/s':>7}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for prefix in (int(p) for p in args.prefixes.split(",")):
            ctx = prefix + n
            num_blocks = -(-ctx // BLOCK_SIZE)
            gen = torch.Generator().manual_seed(0)
            key_cache, value_cache = (torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                                      for _ in range(2))  # fmt: skip
            query = torch.randn(n, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
            tables = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]
            starts, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
            meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start_loc=[0, n], context_lens=[ctx],
                                     block_tables=tables, query_start_loc_t=starts, context_lens_t=lens)
            flops = 4 * Q_HEADS * HEAD_DIM * sum(prefix + i + 1 for i in range(n))
            for threads in (int(t) for t in args.kernel_threads.split(",")):
                cpu_ext.set_num_threads(threads)
                best = best_times({
                    "torch": lambda: _per_request_cpu(query, key_cache, value_cache, meta, scale, None, None),
                    "kernel": lambda: paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens,
                                                              scale)}, args.repeats)  # fmt: skip
                (tw, tc), (kw, kc) = best["torch"], best["kernel"]
                print(f"{str(dtype).split('.')[1]:>9} {prefix:6} {threads:7} {tw * 1e3:6.2f} / {tc * 1e3:6.2f} "
                      f"{kw * 1e3:6.2f} / {kc * 1e3:6.2f} {tw / kw:5.2f}x /{tc / kc:5.2f}x {flops / kw / 1e9:7.1f}")


if __name__ == "__main__":
    main()
