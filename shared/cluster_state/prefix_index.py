"""The cluster's prefix-cache index in Redis: block hash -> the instances holding it, kept true by KV events.

Each engine's block pool emits numbered KVEventBatch-es (shared/kv_events.py); its KVEventPublisher applies them to
Redis, and the gateway's PrefixIndex asks, per candidate instance, how many leading blocks of a prompt it holds (the
cluster-wide form of vLLM's get_computed_blocks, as in llm-d's KV-cache-aware routing and Dynamo's KV router).

Key layout, namespaced by the HashContract (ns = tandem:prefix:<contract_id>; hashes as 32 hex chars):
    <ns>:block:<hash>                   HASH  instance_id[@tier] -> incarnation holding the block in that tier
    <ns>:inc:<instance_id>:<inc>:seq    STRING  seq of the last batch this incarnation applied
    <ns>:inc:<instance_id>:<inc>:blocks SET   hash[@tier] of each block this incarnation holds (for cleanup)
    <ns>:incarnations                   SET   JSON [instance_id, incarnation] of every incarnation with state here
The tier suffix (shared/kv_events.KV_TIERS) is empty for the block pool and "@host" / "@disk" for the tiers below
it, so a pool-only instance writes exactly the fields it always did. An instance may hold a block in several tiers;
a reader counts each block at the fastest tier holding it (tiered_prefixes).

Consistency, by a per-incarnation applied-seq guard: a Lua script applies a batch only when its seq is the stored
seq + 1, in event order, atomically with the check. A batch with seq <= stored is a replay or late: skipped whole,
so a BlockStored never outlives a later BlockRemoved. seq > stored + 1 (a lost batch) or a missing seq key (Redis
restarted or flushed, or cleanup dropped this incarnation) answers "gap"/"missing", and the publisher rebuilds its
entries from snapshot() in one script: drop its old entries, write the snapshot's, set seq to the snapshot's. Lua,
not MULTI/EXEC: the write depends on the stored seq, which MULTI/EXEC could only do with WATCH and a second round
trip. A block's HASH field holds one incarnation per instance id: a restarted instance overwrites it, and entries
whose incarnation is not the caller's live one are ignored and removed by cleanup() / remove_incarnation().
Memory: an incarnation holds at most its pool's hashes; an empty HASH or SET vanishes in Redis.

Redis unreachable: every call raises IndexUnavailableError within its timeout (the router then routes on load
alone); KVEventPublisher.run() never raises it, marks itself dirty and rebuilds from a snapshot once Redis answers.
The scripts build keys from ns, so this needs a standalone Redis (not Redis Cluster). Instance ids and incarnations
must not contain ':'.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.shared.block_hash import BlockHash, HashContract
from tandem.shared.kv_events import KV_TIERS, BlockStored, KVEventBatch

log = logging.getLogger(__name__)
KEY_PREFIX = "tandem:prefix"

_DROP = """
local function split(member)  -- 'hash@tier' -> 'hash', '@tier'; 'hash' -> 'hash', ''
  return string.match(member, '^([^@]*)(.*)$')
end
local function drop(ns, iid, inc, ikey)
  for _, m in ipairs(redis.call('SMEMBERS', ikey .. ':blocks')) do
    local h, sfx = split(m)
    local bkey = ns .. ':block:' .. h
    if redis.call('HGET', bkey, iid .. sfx) == inc then redis.call('HDEL', bkey, iid .. sfx) end
  end
  redis.call('DEL', ikey .. ':blocks')
end
local ns, iid, inc, member = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ikey = ns .. ':inc:' .. iid .. ':' .. inc
"""
# ARGV[5..]: per batch: seq, number of events, then per event: 'S'|'R', tier suffix ('' | '@host' | '@disk'), number
# of hashes, hashes. -> {status, seq}
_APPLY = _DROP + """
local cur = tonumber(redis.call('GET', ikey .. ':seq'))
local i = 5
while i <= #ARGV do
  local i0, seq, nev = i, tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  if cur == nil then
    if seq ~= 1 then return {'missing', 0} end
    cur = 0
  end
  if seq > cur + 1 then return {'gap', cur} end
  local apply = seq == cur + 1
  for _ = 1, nev do
    local op, sfx, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
    local field = iid .. sfx
    i = i + 3
    if apply then
      for j = i, i + n - 1 do
        local bkey = ns .. ':block:' .. ARGV[j]
        if op == 'S' then
          redis.call('HSET', bkey, field, inc)
          redis.call('SADD', ikey .. ':blocks', ARGV[j] .. sfx)
        else
          if redis.call('HGET', bkey, field) == inc then redis.call('HDEL', bkey, field) end
          redis.call('SREM', ikey .. ':blocks', ARGV[j] .. sfx)
        end
      end
    end
    i = i + n
  end
  if apply then
    cur = seq
    redis.call('SET', ikey .. ':seq', ARGV[i0])
  end
end
redis.call('SADD', ns .. ':incarnations', member)
return {'ok', cur}
"""
# ARGV[5]: the snapshot's seq, ARGV[6..]: its blocks as hash[@tier]. -> 1, or 0 when the stored seq is newer (nothing
# written)
_REBUILD = _DROP + """
local cur, seq = tonumber(redis.call('GET', ikey .. ':seq')), tonumber(ARGV[5])
if cur and cur > seq then return 0 end
drop(ns, iid, inc, ikey)
for j = 6, #ARGV do
  local h, sfx = split(ARGV[j])
  redis.call('HSET', ns .. ':block:' .. h, iid .. sfx, inc)
  redis.call('SADD', ikey .. ':blocks', ARGV[j])
end
redis.call('SET', ikey .. ':seq', ARGV[5])
redis.call('SADD', ns .. ':incarnations', member)
return 1
"""
_REMOVE = _DROP + """
drop(ns, iid, inc, ikey)
redis.call('DEL', ikey .. ':seq')
redis.call('SREM', ns .. ':incarnations', member)
return 1
"""


class IndexUnavailableError(Exception):
    """Redis did not answer (down, unreachable, or slower than the timeout): route on load alone, retry later."""


def _suffix(tier: str) -> str:
    """The field / member suffix of a tier: '' for the pool, '@host', '@disk'."""
    if tier not in KV_TIERS:
        raise ValueError(f"unknown KV tier {tier!r}: one of {KV_TIERS}")
    return "" if tier == KV_TIERS[0] else f"@{tier}"


def _namespace(contract: HashContract) -> str:
    return f"{KEY_PREFIX}:{contract.contract_id}"


def _client(redis: aioredis.Redis | str, timeout_s: float) -> tuple[aioredis.Redis, bool]:
    """(client, whether we own it): a URL gets its own client with socket timeouts of timeout_s."""
    if isinstance(redis, str):
        return aioredis.Redis.from_url(redis, socket_timeout=timeout_s, socket_connect_timeout=timeout_s), True
    return redis, False


class _RedisUser:
    """What both sides share: the client, the contract's namespace, the scripts and the timeout of each call."""

    def __init__(self, redis: aioredis.Redis | str, contract: HashContract, timeout_s: float):
        self.redis, self._owns_redis = _client(redis, timeout_s)
        self.ns, self.timeout_s = _namespace(contract), timeout_s
        self._scripts = {src: self.redis.register_script(src) for src in (_APPLY, _REBUILD, _REMOVE)}

    async def _call(self, coro_fn: Callable[[], Awaitable]):
        """coro_fn()'s result; IndexUnavailableError on a Redis error or after timeout_s."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await coro_fn()
        except (RedisError, OSError, TimeoutError) as e:
            raise IndexUnavailableError(f"prefix index unavailable: {type(e).__name__}: {e}") from e

    def _script(self, source: str, args: list):
        return lambda: self._scripts[source](args=args)

    async def close(self) -> None:
        if self._owns_redis:
            await self.redis.aclose()


class KVEventPublisher(_RedisUser):
    """Applies one instance incarnation's KV event batches to the index (instance side, single writer).

    snapshot(): (seq of the last batch the pool has emitted, every (hash, tier) it holds now), consistent with each
    other.
    """

    def __init__(self, redis: aioredis.Redis | str, instance_id: str, incarnation: str, contract: HashContract,
                 snapshot: Callable[[], Awaitable[tuple[int, list[tuple[BlockHash, str]]]]], *,
                 timeout_s: float = 2.0, resync_interval_s: float = 5.0, max_batches_per_write: int = 256):
        if any(c in instance_id + incarnation for c in ":@") or not instance_id or not incarnation:
            raise ValueError(f"instance id and incarnation must be non-empty, without ':' or '@': {instance_id!r}, "
                             f"{incarnation!r}")
        super().__init__(redis, contract, timeout_s)
        self.instance_id, self.incarnation, self.snapshot = instance_id, incarnation, snapshot
        self.resync_interval_s, self.max_batches_per_write = resync_interval_s, max_batches_per_write
        self._head = [self.ns, instance_id, incarnation, json.dumps([instance_id, incarnation])]
        self._seq_key = f"{self.ns}:inc:{instance_id}:{incarnation}:seq"
        self.applied_seq: int | None = None  # last seq Redis confirmed; None: unknown
        self.dirty = False  # the next write must be a snapshot rebuild
        self.num_rebuilds = 0

    async def publish(self, batch: KVEventBatch) -> None:
        """Apply one batch (one round trip; a rebuild from snapshot() first when dirty, or on a gap or lost
        state). Raises IndexUnavailableError when Redis fails, after marking this publisher dirty."""
        await self.publish_many([batch])

    async def publish_many(self, batches: list[KVEventBatch]) -> None:
        """Apply batches (in seq order) in one script call; see publish()."""
        try:
            if self.dirty:
                await self._rebuild()
            batches = [b for b in batches if self.applied_seq is None or b.seq > self.applied_seq]
            if not batches:
                return
            status, seq = await self._call(self._script(_APPLY, self._head + _encode(batches)))
            if status == b"ok":
                self.applied_seq = seq
                return
            log.info("prefix index of %s: %s at seq %d, rebuilding from a snapshot", self.instance_id,
                     status.decode(), batches[0].seq)
            await self._rebuild()
            batches = [b for b in batches if self.applied_seq is not None and b.seq > self.applied_seq]
            if batches:  # the snapshot lagged: apply the rest; a gap now waits for the next write's rebuild
                status, seq = await self._call(self._script(_APPLY, self._head + _encode(batches)))
                self.applied_seq, self.dirty = (seq, False) if status == b"ok" else (None, True)
        except IndexUnavailableError:
            self.dirty = True
            raise

    async def verify(self) -> None:
        """Rebuild when dirty or when Redis lost this incarnation's state (restarted, flushed, cleaned up): what
        run() does when idle, so an instance without new events is indexed again. IndexUnavailableError as
        publish()."""
        try:
            if self.dirty or not await self._call(lambda: self.redis.exists(self._seq_key)):
                await self._rebuild()
        except IndexUnavailableError:
            self.dirty = True
            raise

    async def _rebuild(self) -> None:
        self.dirty = True
        seq, blocks = await self.snapshot()
        members = [h.hex() + _suffix(tier) for h, tier in blocks]
        written = await self._call(self._script(_REBUILD, self._head + [seq] + members))
        if not written:
            log.warning("prefix index of %s holds a newer seq than the snapshot's %d: kept", self.instance_id, seq)
        self.applied_seq = seq if written else None
        self.dirty = False
        self.num_rebuilds += 1

    async def run(self, queue: asyncio.Queue[KVEventBatch]) -> None:
        """Drain queue until cancelled: whatever is queued goes in one write (at most max_batches_per_write);
        every resync_interval_s without batches, verify(). Never raises on Redis errors: logs them (once per
        outage) and rebuilds from a snapshot once Redis answers again."""
        failing = False
        while True:
            try:
                batches = [await asyncio.wait_for(queue.get(), self.resync_interval_s)]
            except TimeoutError:
                batches = []
            while batches and not queue.empty() and len(batches) < self.max_batches_per_write:
                batches.append(queue.get_nowait())
            try:
                await (self.publish_many(batches) if batches else self.verify())
            except IndexUnavailableError as e:
                if not failing:
                    log.warning("prefix index write of %s failed, will rebuild: %s", self.instance_id, e)
                failing = True
                continue
            except Exception:
                log.exception("prefix index publisher of %s failed, will rebuild", self.instance_id)
                self.dirty = True
                continue
            if failing:
                log.info("prefix index of %s reachable again (rebuilt)", self.instance_id)
                failing = False

    async def remove_incarnation(self) -> None:
        """Delete this incarnation's entries and state (clean shutdown). IndexUnavailableError when Redis fails."""
        await self._call(self._script(_REMOVE, self._head))


class PrefixIndex(_RedisUser):
    """The gateway's reader of the index of one HashContract (instances of other contracts have no entries here).
    Every call raises IndexUnavailableError within timeout_s when Redis fails."""

    def __init__(self, redis: aioredis.Redis | str, contract: HashContract, *, timeout_s: float = 0.5,
                 batch_size: int = 16):
        super().__init__(redis, contract, timeout_s)
        self.batch_size = batch_size

    async def longest_prefixes(self, block_hashes: list[BlockHash], instances: dict[str, str]) -> dict[str, int]:
        """{instance_id: number of leading blocks of block_hashes it holds, in any tier} for each of instances
        ({instance_id: live incarnation}); see tiered_prefixes."""
        return {iid: sum(run.values()) for iid, run in (await self.tiered_prefixes(block_hashes, instances)).items()}

    async def tiered_prefixes(self, block_hashes: list[BlockHash], instances: dict[str, str],
                              tiers: dict[str, tuple[str, ...]] | None = None) -> dict[str, dict[str, int]]:
        """{instance_id: {tier: blocks}} for each of instances ({instance_id: live incarnation}): the leading run of
        block_hashes the instance holds in any of its tiers (tiers: {instance_id: the tiers to count}, default every
        one of KV_TIERS), each block counted at the fastest tier holding it; every tier of KV_TIERS is a key.
        Entries of other incarnations are ignored. One pipelined round trip per batch_size hashes, stopping at the
        first block that no instance still on its leading run holds."""
        tiers = {iid: tuple(t for t in KV_TIERS if t in (tiers or {}).get(iid, KV_TIERS)) for iid in instances}
        return await self._call(lambda: self._tiered_prefixes(block_hashes, instances, tiers))

    async def _tiered_prefixes(self, block_hashes: list[BlockHash], instances: dict[str, str],
                               tiers: dict[str, tuple[str, ...]]) -> dict[str, dict[str, int]]:
        counts = {iid: dict.fromkeys(KV_TIERS, 0) for iid in instances}
        expected = {iid: inc.encode() for iid, inc in instances.items()}
        running = list(instances)  # instances whose leading run is unbroken so far
        for start in range(0, len(block_hashes), self.batch_size):
            if not running:
                break
            columns = [(iid, t) for iid in running for t in tiers[iid]]  # (fastest first within an instance)
            fields = [iid + _suffix(t) for iid, t in columns]
            async with self.redis.pipeline(transaction=False) as pipe:
                for h in block_hashes[start : start + self.batch_size]:
                    pipe.hmget(f"{self.ns}:block:{h.hex()}", fields)
                rows = await pipe.execute()
            for row in rows:
                fastest = {}  # instance id -> the fastest tier holding this block
                for (iid, t), inc in zip(columns, row):
                    if inc == expected[iid] and iid not in fastest:
                        fastest[iid] = t
                running = [iid for iid in running if iid in fastest]
                for iid in running:
                    counts[iid][fastest[iid]] += 1
                if not running:
                    break
        return counts

    async def ping(self) -> None:
        """Returns once Redis answers; IndexUnavailableError when it does not within timeout_s."""
        await self._call(self.redis.ping)

    async def cleanup(self, live: dict[str, str]) -> int:
        """Delete the entries and state of every incarnation of this contract not in live ({instance_id:
        incarnation}); returns how many were deleted. One SMEMBERS when there is nothing to delete."""
        members = await self._call(lambda: self.redis.smembers(f"{self.ns}:incarnations"))
        dead = [(m, iid, inc) for m in members for iid, inc in [json.loads(m)] if live.get(iid) != inc]
        for member, iid, inc in dead:
            await self._call(self._script(_REMOVE, [self.ns, iid, inc, member]))
        if dead:
            log.info("prefix index: removed %d stale incarnation(s)", len(dead))
        return len(dead)


def _encode(batches: list[KVEventBatch]) -> list:
    """The _APPLY script's ARGV tail for batches."""
    args = []
    for batch in batches:
        args += [batch.seq, len(batch.events)]
        for event in batch.events:
            args += ["S" if isinstance(event, BlockStored) else "R", _suffix(event.tier), len(event.block_hashes)]
            args += [h.hex() for h in event.block_hashes]
    return args
