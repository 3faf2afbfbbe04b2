"""The CPU paged decode attention kernel (kernels/cpu/attention.cpp) against the machine's memory bandwidth
measured in the same run, on the default model's attention shape (9 query heads, 3 KV heads, head_dim 64).

    python -m tandem.benchmarks.decode_attention [--shapes 1x1000,8x150,32x150,32x400] [--kernel-threads 1,2]
                                                  [--dtypes float32,bfloat16] [--layers 10] [--repeats 20]

A shape SxC is S sequences of C cached tokens each. A decode step reads every layer's K and V once, more bytes than
the last-level cache holds at batch 8-32, so the benchmark gives each of --layers layers caches of its own (blocks
in shuffled order, as a pool hands them out) and calls them in turn, as a step does. Printed: us per layer call
(the mean over --repeats passes), the K and V bytes read per second, and that as a share of the copy bandwidth on
the kernels' thread count (model_shapes.memory_bandwidth_gb_s: STREAM's copy, bytes read + written per second).
Numbers printed, nothing asserted.
"""
from __future__ import annotations

import argparse
import time

import torch

from tandem.benchmarks.model_shapes import memory_bandwidth_gb_s
from tandem.kernels import cpu_ext
from tandem.kernels.cpu_attention import paged_decode_attention

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x1000,8x150,32x150,32x400")
    parser.add_argument("--kernel-threads", default="1,2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    scale = HEAD_DIM**-0.5
    print(f"{Q_HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, {args.layers} layers' caches called in turn")
    print(f"{'dtype':>9} {'shape':>8} {'threads':>7} {'us/layer':>9} {'GB/s':>6} {'of copy bw':>10}")
    for threads in (int(t) for t in args.kernel_threads.split(",")):
        bandwidth = memory_bandwidth_gb_s(threads) * 1e9
        torch.set_num_threads(1)
        print(f"copy bandwidth, {threads} thread(s): {bandwidth / 1e9:.1f} GB/s")
        cpu_ext.set_num_threads(threads)
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            for shape in args.shapes.split(","):
                num_seqs, ctx = (int(v) for v in shape.split("x"))
                width = -(-ctx // BLOCK_SIZE)
                gen = torch.Generator().manual_seed(0)
                layers = []
                for _ in range(args.layers):
                    caches = [torch.randn(num_seqs * width, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                              for _ in range(2)]  # fmt: skip
                    tables = torch.randperm(num_seqs * width, generator=gen).to(torch.int32).view(num_seqs, width)
                    layers.append((*caches, tables))
                query = torch.randn(num_seqs, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
                lens = torch.full((num_seqs,), ctx, dtype=torch.int32)

                def step():
                    for key_cache, value_cache, tables in layers:
                        paged_decode_attention(query, key_cache, value_cache, tables, lens, scale)

                step()
                start = time.perf_counter()
                for _ in range(args.repeats):
                    step()
                per_layer = (time.perf_counter() - start) / args.repeats / args.layers
                rate = 2 * num_seqs * ctx * KV_HEADS * HEAD_DIM * query.element_size() / per_layer
                print(f"{str(dtype).split('.')[1]:>9} {shape:>8} {threads:7} {per_layer * 1e6:9.0f} "
                      f"{rate / 1e9:6.1f} {rate / bandwidth:9.0%}")


if __name__ == "__main__":
    main()
