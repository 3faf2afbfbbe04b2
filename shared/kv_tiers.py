"""The KV tiers below the block pool: host memory, then a disk directory (SGLang's HiCache and vLLM's offloading
connector do the same; LMCache's local CPU and disk backends too).

A cached block the pool evicts is copied, with its token ids, into the host tier (CPU tensors, bounded in bytes);
the host tier's evictions go to the disk tier (one file per block, shared/kv_block_file.py, bounded in bytes). Each
tier is a set of blocks by hash, independent of the others (inclusive: a block brought back into the pool stays
in its tier, so evicting it again costs nothing). The order in which a tier evicts is EvictionOrder's: least
recently used, or least frequently used. shared/kv_offload.py moves blocks between the pool and these tiers.
The disk tier is shared/kv_disk_tier.py.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tandem.shared.block_hash import BlockHash

log = logging.getLogger(__name__)


class EvictionOrder:
    """The order a tier's blocks leave it in: "lru", least recently stored or hit first; "lfu", fewest hits since
    stored first, the least recent of those first (SGLang's --radix-eviction-policy lfu). O(1) per operation (but
    victim, O(distinct hit counts))."""

    def __init__(self, policy: str):
        self.policy = policy
        self.hits: dict[BlockHash, int] = {}
        self.buckets: dict[int, OrderedDict[BlockHash, None]] = {}  # hit count -> blocks, least recent first

    def __len__(self) -> int:
        return len(self.hits)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.hits

    def __iter__(self):
        for count in sorted(self.buckets):
            yield from self.buckets[count]

    def add(self, key: BlockHash) -> None:
        assert key not in self.hits
        self.hits[key] = 0
        self.buckets.setdefault(0, OrderedDict())[key] = None

    def touch(self, key: BlockHash) -> None:
        """A hit: the block becomes the most recent (and, with lfu, counts one more hit)."""
        count = self.hits[key]
        if self.policy == "lru":
            self.buckets[0].move_to_end(key)
            return
        self._unlink(key, count)
        self.hits[key] = count + 1
        self.buckets.setdefault(count + 1, OrderedDict())[key] = None

    def remove(self, key: BlockHash) -> None:
        self._unlink(key, self.hits.pop(key))

    def victim(self) -> BlockHash:
        """The block to evict next (the tier is not empty)."""
        return next(iter(self.buckets[min(self.buckets)]))

    def _unlink(self, key: BlockHash, count: int) -> None:
        bucket = self.buckets[count]
        del bucket[key]
        if not bucket:
            del self.buckets[count]


@dataclass(slots=True)
class TierBlock:
    """A block held by a tier: its token ids, its data (host tier; disk tier: until its file is written) and size."""

    token_ids: tuple[int, ...]
    data: torch.Tensor | None
    nbytes: int


class HostTier:
    """Blocks as CPU tensors, at most capacity_bytes of them. Engine thread only; the loader thread copies from a
    block's tensor, which is never written after put."""

    def __init__(self, capacity_bytes: int, eviction: str):
        self.capacity_bytes = capacity_bytes
        self.blocks: dict[BlockHash, TierBlock] = {}
        self.order = EvictionOrder(eviction)
        self.num_bytes = 0

    def get(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> TierBlock | None:
        """The block holding exactly these tokens under this hash, or None."""
        block = self.blocks.get(block_hash)
        return block if block is not None and block.token_ids == token_ids else None

    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], data: torch.Tensor
            ) -> list[tuple[BlockHash, TierBlock]]:
        """Hold a block (data: a CPU tensor no one else writes); returns the blocks evicted to make room, in
        order (it may be the block itself, when it alone exceeds the capacity)."""
        assert block_hash not in self.blocks
        nbytes = data.numel() * data.element_size()
        self.blocks[block_hash] = TierBlock(token_ids, data, nbytes)
        self.order.add(block_hash)
        self.num_bytes += nbytes
        evicted = []
        while self.num_bytes > self.capacity_bytes:
            victim = self.order.victim()
            evicted.append((victim, self.remove(victim)))
        return evicted

    def touch(self, block_hash: BlockHash) -> bool:
        """A use of the block, if the tier holds it (False: it does not)."""
        if block_hash not in self.blocks:
            return False
        self.order.touch(block_hash)
        return True

    def remove(self, block_hash: BlockHash) -> TierBlock:
        block = self.blocks.pop(block_hash)
        self.order.remove(block_hash)
        self.num_bytes -= block.nbytes
        return block
