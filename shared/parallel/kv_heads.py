"""Which KV heads each rank of a tensor-parallel instance holds, and who sends which heads to whom when a prefill
of one size ships KV to a decode of another (heterogeneous P/D, docs/parallelism.md).

Ranks hold the KV heads of their query heads (shared/parallel/layers.py shard_model): with at least as many KV heads
as ranks, rank r holds [r * K / N, (r + 1) * K / N); with fewer, each KV head is replicated on the N / K consecutive
ranks whose query heads read it. Of the prefill ranks holding a head, exactly one (the lowest) sends it; a decode
rank receives every head it holds (a replicated head goes to each decode rank holding it).
"""
from __future__ import annotations

from typing import NamedTuple


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """The model's KV heads [start, end) that rank (of size ranks) holds. ValueError when num_kv_heads neither
    divides by size nor divides it (the shape check_tensor_parallel refuses)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside [0, {size})")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"num_key_value_heads {num_kv_heads} neither divides by {size} nor divides it")
    start = rank * num_kv_heads // size
    return start, max(start + 1, (rank + 1) * num_kv_heads // size)


def kv_heads_sent(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """The heads [start, end) rank sends: those it holds when it is the lowest rank holding them, else none
    (start == end)."""
    start, end = kv_head_range(rank, size, num_kv_heads)
    if rank > 0 and kv_head_range(rank - 1, size, num_kv_heads)[0] == start:  # (a replica of the rank before's)
        return start, start
    return start, end


class KVRoute(NamedTuple):
    """One shard stream of a transfer: prefill_rank sends the model's KV heads [head_start, head_end) to
    decode_rank."""

    prefill_rank: int
    decode_rank: int
    head_start: int
    head_end: int


def kv_transfer_routes(prefill_size: int, decode_size: int, num_kv_heads: int) -> list[KVRoute]:
    """The streams of one request's KV from a prefill of prefill_size ranks to a decode of decode_size ranks, by
    prefill rank then decode rank: every head each decode rank holds arrives exactly once, from the lowest prefill
    rank holding it. One route (0, 0, 0, num_kv_heads) between two single-rank instances."""
    routes = []
    for p in range(prefill_size):
        a, b = kv_heads_sent(p, prefill_size, num_kv_heads)
        for d in range(decode_size):
            c, e = kv_head_range(d, decode_size, num_kv_heads)
            if max(a, c) < min(b, e):
                routes.append(KVRoute(p, d, max(a, c), min(b, e)))
    return routes
