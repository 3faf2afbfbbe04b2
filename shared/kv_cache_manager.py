"""Paged KV cache bookkeeping: a pool of fixed-size blocks and each request's block table.

Follows PagedAttention (Kwon et al. 2023): a request's KV lives in block_size-token blocks anywhere in the pool;
its block table maps logical block i to a pool block id, and token t sits at
slot = block_table[t // block_size] * block_size + t % block_size.
"""
from __future__ import annotations

from collections import deque

from shared.request import Request
from shared.utils import cdiv


class BlockPool:
    """Free list and reference counts for num_blocks block ids."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref_cnt 1 each). Raises MemoryError when fewer than n are free; takes none then."""
        if n > len(self.free_block_ids):
            raise MemoryError(f"need {n} KV blocks, {len(self.free_block_ids)} free")
        block_ids = [self.free_block_ids.popleft() for _ in range(n)]
        for block_id in block_ids:
            self.ref_cnt[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_block_ids.append(block_id)


class KVCacheManager:
    """Owns every request's block table; allocates slots ahead of each step and frees on finish."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table to hold num_computed_tokens + num_new_tokens. False (nothing taken) if full."""
        block_table = self.block_tables.setdefault(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(block_table)
        if needed <= 0:
            return True
        if needed > self.block_pool.num_free_blocks:
            return False
        block_table.extend(self.block_pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool at once (finish, abort or preemption)."""
        block_table = self.block_tables.pop(request.request_id, None)
        if block_table:
            self.block_pool.free(block_table)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
