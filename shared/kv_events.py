"""Prefix-cache events of one instance's block pool, the input of the shared prefix index (shared/cluster_state/prefix_index.py).

The pool (shared/kv_cache_manager.py) records a BlockStored when a full, computed block gets its hash and becomes
reusable, and a BlockRemoved when an evicted block loses it; the engine hands them out once per step as one
KVEventBatch with the next per-instance sequence number (1, 2, ...), so a reader can tell a gap.

Each event names the tier it happened in (KV_TIERS, fastest first): the block pool itself, or the host-memory and
disk tiers below it (shared/kv_tiers.py). A block evicted from the pool to the host tier is a BlockRemoved("pool")
and a BlockStored("host").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.shared.block_hash import BlockHash


KV_TIERS = ("pool", "host", "disk")  # where an instance holds a block, fastest first


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]  # in the order they were cached
    tier: str = "pool"  # one of KV_TIERS


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    tier: str = "pool"


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int  # per instance incarnation, from 1, +1 per batch
    events: tuple[BlockStored | BlockRemoved, ...] = field(default_factory=tuple)
