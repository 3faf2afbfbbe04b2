"""BlockPool: the paged KV cache's blocks (PagedAttention, Kwon et al. 2023): reference counts, the free queue in LRU
order, and the prefix cache's block hash -> block map with its continuations (partly filled blocks a hit inside a
block can copy). vLLM v1 keeps the same class in its own block_pool.py. KVCacheManager (shared/kv_cache_manager.py)
owns the block tables and the rules; the module docstring there describes the prefix cache the pool serves.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.shared.block_hash import BlockHash
from tandem.shared.kv_events import BlockRemoved, BlockStored
from tandem.shared.kv_offload import KVOffloader


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] | None = None  # the tokens whose KV it holds (checked on every hit)


class BlockPool:
    """num_blocks blocks: reference counts, the free queue (LRU first) and the prefix cache's hash -> block map.

    With record_events, cache changes are recorded as BlockStored / BlockRemoved events, taken with
    take_events(). With an offloader, an evicted cached block is copied into the tiers below the pool first."""

    def __init__(self, num_blocks: int, record_events: bool = False, offloader: KVOffloader | None = None):
        self.num_blocks = num_blocks
        self.record_events = record_events
        self.offloader = offloader
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # NOTE: every block with ref_cnt 0 is here (cached or not); the front is evicted first.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}
        # blocks a hit inside a block can copy, by the prefix they continue (KVCacheManager.continuation_key) and
        # their first token (so a lookup reads only blocks that share at least one token): cached full blocks, and
        # free partly filled blocks whose KV is intact -> {block id: token ids held}
        self.continuations: dict[tuple, dict[int, tuple[int, ...]]] = {}
        self.continuation_of: dict[int, tuple] = {}  # block id -> its key in continuations
        self.num_evictions = 0
        self._events: list[BlockStored | BlockRemoved] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free ones and cached ones no request uses)."""
        return len(self.free_block_queue)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref_cnt 1 each) from the front of the free queue, evicting cached ones. Raises
        MemoryError when fewer than n are free; takes none then."""
        if n > len(self.free_block_queue):
            raise MemoryError(f"need {n} KV blocks, {len(self.free_block_queue)} free")
        block_ids = []
        for _ in range(n):
            block_id, _ = self.free_block_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            self._drop_continuation(block_id)  # (a partial one: its KV is about to be overwritten)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (a prefix hit); blocks nobody used leave the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_block_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block; a block at 0 joins the back of the free queue (cached ones keep their
        hash). Pass a request's blocks in reverse order so that its tail is evicted before its prefix."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block_id] = None

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """The block holding exactly these tokens under this hash, or None."""
        block_id = self.cached_blocks.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...],
                    continuation_key: tuple | None = None) -> None:
        """Publish a full, computed block under its hash (and as a continuation of the prefix named by
        continuation_key, while cached). When another block already holds this hash, that one stays the cached
        copy and this block stays private (freed as an ordinary block)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached_blocks[block_hash] = block_id
        if continuation_key is not None:
            self._add_continuation(block_id, continuation_key, token_ids)
        if self.record_events:
            self._events.append(BlockStored((block_hash,)))

    def keep_partial(self, block_id: int, key: tuple, token_ids: tuple[int, ...]) -> None:
        """Record a free (ref_cnt 0), partly filled block holding the KV of token_ids after the prefix named by
        key as a continuation, until an allocation takes the block."""
        assert self.blocks[block_id].ref_cnt == 0 and self.blocks[block_id].block_hash is None
        self._add_continuation(block_id, key, token_ids)

    def _add_continuation(self, block_id: int, key: tuple, token_ids: tuple[int, ...]) -> None:
        assert block_id not in self.continuation_of and token_ids
        self.continuations.setdefault((key, token_ids[0]), {})[block_id] = token_ids
        self.continuation_of[block_id] = key, token_ids[0]

    def _drop_continuation(self, block_id: int) -> None:
        key = self.continuation_of.pop(block_id, None)
        if key is not None:
            entries = self.continuations[key]
            del entries[block_id]
            if not entries:
                del self.continuations[key]

    def find_continuation(self, key: tuple, token_ids: list[int]) -> tuple[int, int] | None:
        """The continuation of the prefix named by key sharing the longest run of leading tokens with token_ids:
        (block id, length of that run), or None when none shares even one."""
        best = None
        for block_id, held in self.continuations.get((key, token_ids[0]), {}).items() if token_ids else ():
            n = 0
            for a, b in zip(held, token_ids):
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (block_id, n)
        return best

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_blocks[block.block_hash]
        self._drop_continuation(block.block_id)
        if self.record_events:
            self._events.append(BlockRemoved((block.block_hash,)))
        if self.offloader is not None:  # (its KV is intact until the next forward or import writes the block)
            self.offloader.offload(block.block_id, block.block_hash, block.token_ids)
        block.block_hash = block.token_ids = None
        self.num_evictions += 1

    def cached_blocks_coldest_first(self) -> list[tuple[int, BlockHash, tuple[int, ...]]]:
        """(block id, hash, token ids) of every cached block: those in the free queue in eviction order, then
        those in use."""
        order = [b for b in self.free_block_queue if self.blocks[b].block_hash is not None]
        order += [b.block_id for b in self.blocks if b.ref_cnt > 0 and b.block_hash is not None]
        return [(b, self.blocks[b].block_hash, self.blocks[b].token_ids) for b in order]

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The cache changes since the last call, the tiers' below the pool after the pool's, consecutive stores
        and removes of one tier merged, in order (the order of each tier's own events is kept)."""
        events = self._events + (self.offloader.take_events() if self.offloader is not None else [])
        merged: list[BlockStored | BlockRemoved] = []
        for event in events:
            if merged and type(merged[-1]) is type(event) and merged[-1].tier == event.tier:
                merged[-1] = type(event)(merged[-1].block_hashes + event.block_hashes, event.tier)
            else:
                merged.append(event)
        self._events = []
        return merged
