"""Prefix-cache events of one instance's block pool, the input of the shared prefix index (shared/cluster_state/prefix_index.py).

The pool (shared/kv_cache_manager.py) records a BlockStored when a full, computed block gets its hash and becomes
reusable, and a BlockRemoved when an evicted block loses it; the engine hands them out once per step as one
KVEventBatch with the next per-instance sequence number (1, 2, ...), so a reader can tell a gap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.shared.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]  # in the order they were cached


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int  # per instance incarnation, from 1, +1 per batch
    events: tuple[BlockStored | BlockRemoved, ...] = field(default_factory=tuple)
