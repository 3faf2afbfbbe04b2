"""Paged KV cache bookkeeping: a pool of fixed-size blocks, each request's block table, and the prefix cache.

Follows PagedAttention (Kwon et al. 2023): a request's KV lives in block_size-token blocks anywhere in the pool;
its block table maps logical block i to a pool block id, and token t sits at
slot = block_table[t // block_size] * block_size + t % block_size.

Prefix caching (vLLM's automatic prefix caching): once a block is full and computed it gets its block hash
(shared/block_hash.py) and stays reusable after its requests end: a block whose ref_cnt drops to 0 keeps its hash
in the free queue, in LRU order, until an allocation needs it (then it is evicted and loses the hash). A new
request takes its longest run of cached leading blocks whose stored token ids equal its own (a hash collision
never serves another prompt's KV) and computes only the rest, always at least its last token. Blocks in use
(ref_cnt > 0) are never in the free queue, so never evicted.

Hits inside a block, copy on write (the PagedAttention paper's block sharing for beams and parallel samples;
SGLang's radix cache matches prefixes to the token the same way): every cached full block, and the computed,
partly filled last block a request leaves behind when it ends, is a continuation of the prefix before it (keyed
by the hash of the full blocks before it). A request that takes all those full blocks and shares some leading
tokens of its next block with a continuation gets a new block holding a copy of that block's KV (copied before
the step's forward, so the copy is private and the source is never written by it) and computes only what follows.
A cached full block stays a continuation until evicted; a partial one until its block is allocated again. Used by
the scheduler only: the decode tier's reserve (KV that comes over the wire) counts in whole blocks.

Sliding windows (Mistral: every layer attends to its last `sliding_window` positions only): once a request's next
query position is past a block by more than the window, no layer reads that block again. free_out_of_window_blocks
then returns it to the pool (cached ones keep their hash, so a later prompt with the same prefix can still hit them
until evicted) and sets its table entry to None; the attention kernels read no entry before the window. A model
with some full-attention layers (Gemma's alternation) needs every block and frees none early.

Tiers below the pool (shared/kv_offload.py, with a KVOffloader): a cached block the pool evicts is copied into the
host tier, then the disk tier. On admission a request's run of cached blocks continues through them
(get_tier_hits); start_tier_load gives those blocks fresh pool blocks that a loader thread fills beside the step,
and finish_tier_loads publishes them in the prefix cache once loaded and frees them, to be taken as a pool hit when
the request is admitted. Until then the request waits (LOADING_KV) and its blocks count as in flight, so a request
with the same prefix waits for them too. Scheduler admissions only: the decode tier's reserve stays pool-only.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.block_hash import BlockHash, HashContract, hash_request_blocks
from tandem.shared.block_pool import BlockPool
from tandem.shared.kv_offload import KVOffloader, TierHit
from tandem.shared.request import Request
from tandem.shared.utils import cdiv


def kv_variant(request: Request) -> str | None:
    """What besides its tokens the request's KV depends on, hashed with its blocks (ModelConfig.kv_variant's
    values): "rope:long" for a longrope request computed with the long factors."""
    return "rope:long" if request.rope_long else None


@dataclass(slots=True)
class TierLoad:
    """A request's blocks being loaded from the tiers below the pool, after its pool hit."""

    held_block_ids: list[int]  # its pool hit, held meanwhile
    block_ids: list[int]  # the pool blocks being written, held by the load alone
    hits: list[TierHit]
    continuation_keys: list[tuple]  # (KVCacheManager.continuation_key of each, for publishing it)
    cancelled: bool = False  # the request ended: its blocks are freed when the load ends


class KVCacheManager:
    """Owns every request's block table; allocates slots ahead of each step, frees on finish, and (with a hash
    contract) runs the prefix cache: get_computed_blocks on admission, cache_full_blocks after each step."""

    def __init__(self, num_blocks: int, block_size: int, hash_contract: HashContract | None = None,
                 record_events: bool = False, sliding_window: int | None = None,
                 offloader: KVOffloader | None = None):
        """sliding_window: the window of every layer of every model reading this pool's blocks (None: some layer
        attends to the whole context; no block is freed before its request ends). offloader: the tiers below the
        pool (None: none; ignored with caching off)."""
        if hash_contract is not None and hash_contract.block_size != block_size:
            raise ValueError(f"hash contract block size {hash_contract.block_size} != pool block size {block_size}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_freed_blocks: dict[str, int] = {}  # leading blocks of a request freed (None), by window
        self.hash_contract = hash_contract  # None: prefix caching off
        self.offloader = offloader if hash_contract is not None and offloader is not None and offloader.enabled \
            else None
        self.block_pool = BlockPool(num_blocks, record_events, self.offloader)
        self.tier_loads: dict[str, TierLoad] = {}  # request id -> its blocks being loaded from a tier
        self.block_tables: dict[str, list[int | None]] = {}  # None: freed, before the request's sliding window
        self.block_hashes: dict[str, list[BlockHash]] = {}  # full blocks' hashes per request, grown as it runs
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already published
        self.num_queries = self.num_hits = 0  # prompt tokens looked up / found, for the hit rate
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) block ids to copy before the next forward

    @property
    def enable_caching(self) -> bool:
        return self.hash_contract is not None

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first num_blocks full blocks (computed once, extended as tokens come)."""
        hashes = self.block_hashes.get(request.request_id, [])
        if len(hashes) < num_blocks:
            tokens = request.token_ids(0, num_blocks * self.block_size)
            hashes = hash_request_blocks(tokens, self.hash_contract, request.cache_salt, hashes,
                                         kv_variant(request), request.lora_key)
            self.block_hashes[request.request_id] = hashes
        return hashes[:num_blocks]

    def _block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.token_ids(i * self.block_size, (i + 1) * self.block_size))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached leading blocks of a request starting from scratch: (block ids, tokens
        they hold). At most num_tokens - 1 tokens, so the last token is always computed (its logits are
        needed). ([], 0) with caching off."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for i, block_hash in enumerate(self._hashes(request, max_blocks)):
            block_id = self.block_pool.get_cached_block(block_hash, self._block_tokens(request, i))
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def num_blocks_before_window(self, position: int) -> int:
        """Leading blocks no layer reads for a query at this position or later: those wholly before its window
        (positions position - sliding_window + 1 .. position). 0 without a window."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def free_out_of_window_blocks(self, request: Request, position: int | None = None) -> None:
        """Free the leading blocks wholly before the window of the request's next query position (default: its
        num_computed_tokens), after cache_full_blocks published them; their entries become None. A block
        never filled (a decode's reserve) is freed uncached. No-op without a window."""
        block_table = self.block_tables.get(request.request_id)
        position = request.num_computed_tokens if position is None else position
        end = min(self.num_blocks_before_window(position), len(block_table or ()))
        start = self.num_freed_blocks.get(request.request_id, 0)
        if end <= start:
            return
        self.block_pool.free(block_table[start:end][::-1])  # (newest first: the earliest is evicted last)
        block_table[start:end] = [None] * (end - start)
        self.num_freed_blocks[request.request_id] = end

    def continuation_key(self, request: Request, i: int) -> tuple:
        """What identifies the prefix before logical block i of a request: the hash of its block i - 1, or the
        contract's root, the cache salt, KV variant and LoRA adapter for the first block."""
        if i == 0:
            return self.hash_contract.root_hash, request.cache_salt, kv_variant(request), request.lora_key
        return self._hashes(request, i)[i - 1], None

    def get_partial_block(self, request: Request, num_full_blocks: int) -> tuple[int, int] | None:
        """For a request whose first num_full_blocks blocks are a prefix hit (get_computed_blocks): a block that
        continues that prefix with some of the request's next tokens (a cached full block, or a partly filled
        one a finished request left), as (block id, how many of those tokens it holds), at most up to the
        request's second-to-last token. The request computes from there on a copy of it. None without one
        (or with caching off)."""
        if not self.enable_caching:
            return None
        start = num_full_blocks * self.block_size
        end = min(start + self.block_size - 1, request.num_tokens - 1)
        if end <= start:
            return None
        return self.block_pool.find_continuation(self.continuation_key(request, num_full_blocks),
                                            request.token_ids(start, end))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies that partial hits need, in order, to run before the next forward."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def blocks_in_flight(self, requests: list[Request]) -> set[BlockHash]:
        """Hashes of the full prompt blocks these (running) requests hold but have not computed yet: a waiting
        request whose next block is among them finds it cached after a step or two, instead of computing it
        again alongside (SGLang's in-batch prefix sharing does the same). Empty with caching off."""
        if not self.enable_caching:
            return set()
        pending = set()
        for r in requests:
            num_full = r.num_prompt_tokens // self.block_size
            start = self.num_cached_blocks.get(r.request_id, 0)
            if r.num_computed_tokens < num_full * self.block_size and r.request_id in self.block_tables:
                pending.update(self._hashes(r, num_full)[start:])
        for load in self.tier_loads.values():  # (being loaded from a tier: published once loaded)
            if not load.cancelled:
                pending.update(hit.block_hash for hit in load.hits)
        return pending

    def num_reusable_tokens(self, request: Request, in_flight: set[BlockHash]) -> int:
        """Leading tokens of a request not admitted yet that it will not compute: its run of blocks that are
        cached (in the pool or a tier below it) or in in_flight (blocks_in_flight). What the queue estimate leaves
        out."""
        if not self.enable_caching:
            return 0
        num = 0
        for i, block_hash in enumerate(self._hashes(request, (request.num_tokens - 1) // self.block_size)):
            if block_hash not in in_flight:
                tokens = self._block_tokens(request, i)
                if self.block_pool.get_cached_block(block_hash, tokens) is None and (
                        self.offloader is None or self.offloader.find(block_hash, tokens) is None):
                    break
            num += 1
        return num * self.block_size

    def get_tier_hits(self, request: Request, num_pool_blocks: int) -> list[TierHit]:
        """The run of blocks after the request's first num_pool_blocks (its pool hit: get_computed_blocks) that the
        tiers below the pool hold, token ids checked, at most up to its second-to-last token. [] without tiers."""
        if self.offloader is None:
            return []
        hits = []
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        for i in range(num_pool_blocks, len(hashes)):
            hit = self.offloader.find(hashes[i], self._block_tokens(request, i))
            if hit is None:
                break
            hits.append(hit)
        return hits

    def start_tier_load(self, request: Request, computed_block_ids: list[int], hits: list[TierHit]) -> bool:
        """Start loading a request's tier hits (get_tier_hits, after its pool hit computed_block_ids; the request
        holds no blocks): its pool hit is held, and fresh blocks, which the offloader's loader thread fills, are
        taken for the hits. False (nothing taken) if the pool cannot hold them. The request then waits for
        finish_tier_loads, and is admitted afterwards like any other request, finding those blocks in the pool."""
        rid = request.request_id
        if rid in self.tier_loads:  # (a cancelled load of an earlier request of this id, still running)
            return False
        reusable = sum(self.block_pool.blocks[b].ref_cnt == 0 for b in computed_block_ids)
        if len(hits) > self.block_pool.num_free_blocks - reusable:
            return False
        self.offloader.touch(hits)  # (first: the evictions below push other blocks down the tiers)
        self.block_pool.touch(list(computed_block_ids))
        block_ids = self.block_pool.allocate(len(hits))
        start = len(computed_block_ids)
        keys = [self.continuation_key(request, i) for i in range(start, start + len(hits))]
        self.tier_loads[rid] = TierLoad(list(computed_block_ids), block_ids, list(hits), keys)
        self.offloader.start_load(rid, block_ids, hits)
        return True

    @property
    def has_tier_loads(self) -> bool:
        return bool(self.tier_loads)

    def finish_tier_loads(self) -> dict[str, dict[str, int]]:
        """Publish the blocks of the loads finished since the last call in the prefix cache, and return all their
        blocks to the free queue, tail first (the loaded ones cached; a block that failed and those after it
        not). Returns {request id: {tier: tokens loaded from it}} for the requests whose load finished (an ended
        request's is not among them)."""
        done = {}
        for finished in self.offloader.take_finished_loads() if self.offloader is not None else ():
            load = self.tier_loads.pop(finished.request_id)
            num_loaded = 0 if load.cancelled else finished.num_loaded
            for block_id, hit, key in list(zip(load.block_ids, load.hits, load.continuation_keys))[:num_loaded]:
                self.block_pool.cache_block(block_id, hit.block_hash, hit.token_ids, key)
            self.block_pool.free((load.held_block_ids + load.block_ids)[::-1])
            if not load.cancelled:
                done[finished.request_id] = loaded = {}
                for hit in load.hits[:num_loaded]:
                    loaded[hit.tier] = loaded.get(hit.tier, 0) + self.block_size
        return done

    def next_block_hash(self, request: Request, num_cached_blocks: int) -> BlockHash | None:
        """The hash of the request's full prompt block after its first num_cached_blocks (None: no such block,
        or caching off)."""
        if not self.enable_caching or (num_cached_blocks + 1) * self.block_size >= request.num_tokens:
            return None
        return self._hashes(request, num_cached_blocks + 1)[num_cached_blocks]

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_block_ids: list[int] = (),
                       partial_block: tuple[int, int] | None = None) -> bool:
        """Grow the block table to hold num_computed_tokens + num_new_tokens, first taking computed_block_ids
        (a prefix hit from get_computed_blocks, on a request with no blocks yet) as its leading blocks and,
        with partial_block (get_partial_block: (block id, tokens)), a copy of that block as the next one, its
        tokens counted as computed (num_new_tokens excludes them). False (nothing taken) if the pool cannot
        hold it."""
        block_table = self.block_tables.setdefault(request.request_id, [])
        assert not (computed_block_ids and block_table), "a prefix hit is taken only by a request with no blocks"
        num_partial = partial_block[1] if partial_block else 0
        num_computed = request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_partial
        needed = self.num_blocks_for(num_computed + num_new_tokens) - len(block_table) - len(computed_block_ids)
        # cached blocks nobody uses count as free until touched
        reusable = sum(self.block_pool.blocks[b].ref_cnt == 0 for b in computed_block_ids)
        if needed > self.block_pool.num_free_blocks - reusable:
            return False
        if not block_table and self.enable_caching:  # its first allocation: count the lookup
            self.num_queries += request.num_tokens
            self.num_hits += len(computed_block_ids) * self.block_size + num_partial
        if computed_block_ids:
            self.block_pool.touch(list(computed_block_ids))
            block_table.extend(computed_block_ids)
            self.num_cached_blocks[request.request_id] = len(computed_block_ids)
        if needed > 0:
            block_table.extend(self.block_pool.allocate(needed))
        if partial_block:  # (a free source is intact until this step's forward: the copy runs before it)
            self.block_copies.append((partial_block[0], block_table[len(computed_block_ids)]))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full and computed (num_computed_tokens) and not yet cached."""
        if not self.enable_caching:
            return
        rid = request.request_id
        block_table = self.block_tables.get(rid, ())
        num_full = min(request.num_computed_tokens // self.block_size, len(block_table))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        for i, block_hash in enumerate(self._hashes(request, num_full)[start:], start):
            if block_table[i] is not None:  # (a decode never received the blocks before its window)
                self.block_pool.cache_block(block_table[i], block_hash, self._block_tokens(request, i),
                                            self.continuation_key(request, i))
        self.num_cached_blocks[rid] = num_full

    def free_excess_blocks(self, request: Request) -> None:
        """Return the blocks past what the request's tokens need (allocated for draft tokens that were rejected;
        never cached, as they hold no computed full block)."""
        block_table = self.block_tables.get(request.request_id)
        keep = self.num_blocks_for(request.num_tokens)
        if block_table and len(block_table) > keep:
            self.block_pool.free(block_table[keep:][::-1])
            del block_table[keep:]

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool at once (finish, abort or preemption); cached ones stay
        reusable until evicted. Blocks a tier is loading into are freed when their load ends."""
        block_table = self.block_tables.pop(request.request_id, None)
        if request.request_id in self.tier_loads:  # (its blocks are freed when the load ends)
            self.tier_loads[request.request_id].cancelled = True
        i, num_partial = divmod(request.num_computed_tokens, self.block_size)
        partial = None
        if self.enable_caching and block_table and num_partial and i < len(block_table):
            partial = (block_table[i], self.continuation_key(request, i),
                       tuple(request.token_ids(i * self.block_size, request.num_computed_tokens)))
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_hashes.pop(request.request_id, None)
        num_freed = self.num_freed_blocks.pop(request.request_id, 0)
        if block_table:
            self.block_pool.free(block_table[num_freed:][::-1])
        if partial and self.block_pool.blocks[partial[0]].ref_cnt == 0:  # (a partial block is private)
            self.block_pool.keep_partial(*partial)

    def get_block_table(self, request_id: str) -> list[int | None]:
        return self.block_tables[request_id]

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash the pool's prefix cache holds now."""
        return list(self.block_pool.cached_blocks)

    def cached_block_tiers(self) -> list[tuple[BlockHash, str]]:
        """Every hash held now and its tier ("pool", "host", "disk"; a block in several tiers appears once per
        tier): the snapshot the prefix index rebuilds from."""
        held = [(h, "pool") for h in self.block_pool.cached_blocks]
        return held + (self.offloader.snapshot() if self.offloader is not None else [])
