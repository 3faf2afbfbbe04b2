"""The prefix index in a real redis-server: events in, exact prefix lengths out; replays, gaps, a flushed or
restarted Redis, stale incarnations and separate hash contracts (shared/cluster_state/prefix_index.py)."""
import asyncio
import json
import random
import signal
import time

import pytest
import redis.asyncio as aioredis

from tandem.shared.block_hash import HashContract, hash_request_blocks
from tandem.shared.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tandem.shared.cluster_state.prefix_index import IndexUnavailableError, KVEventPublisher, PrefixIndex
from tandem.shared.cluster_state.registry import InstanceInfo

CONTRACT = HashContract(block_size=4, model_id="m:abc:fp32", kv_dtype="float32")
OTHER_CONTRACT = HashContract(block_size=4, model_id="m:abc:int8", kv_dtype="float32")
HASHES = hash_request_blocks(list(range(4 * 40)), CONTRACT)  # a 40-block prompt


class FakePool:
    """Stands in for an engine's block pool: makes numbered batches and answers snapshot()."""

    def __init__(self):
        self.seq, self.cached = 0, []

    def batch(self, *events) -> KVEventBatch:
        self.seq += 1
        for e in events:
            blocks = [(h, e.tier) for h in e.block_hashes]
            if isinstance(e, BlockStored):
                self.cached += [b for b in blocks if b not in self.cached]
            else:
                self.cached = [b for b in self.cached if b not in blocks]
        return KVEventBatch(self.seq, tuple(events))

    async def snapshot(self):
        return self.seq, list(self.cached)


def stored(*hashes, tier="pool"):
    return BlockStored(tuple(hashes), tier)


def removed(*hashes, tier="pool"):
    return BlockRemoved(tuple(hashes), tier)


def make_publisher(url, instance_id="decode-1", incarnation="inc-a", contract=CONTRACT, pool=None, **kw):
    pool = pool or FakePool()
    return KVEventPublisher(url, instance_id, incarnation, contract, pool.snapshot, **kw), pool


def run(coro):
    return asyncio.run(coro)


def test_store_remove_and_exact_counts(redis_server):
    async def body():
        pub, pool = make_publisher(redis_server.url)
        index = PrefixIndex(redis_server.url, CONTRACT)
        live = {"decode-1": "inc-a"}
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        await pub.publish(pool.batch(stored(*HASHES[:5])))
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 5}
        assert await index.longest_prefixes(HASHES[:3], live) == {"decode-1": 3}
        await pub.publish(pool.batch(removed(HASHES[2])))
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 2}
        await pub.publish(pool.batch(stored(HASHES[2]), removed(*HASHES[:5])))  # in event order
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        assert await index.longest_prefixes([], live) == {"decode-1": 0}
        assert await index.longest_prefixes(HASHES, {}) == {}
        assert pub.num_rebuilds == 0
        keys = sorted(k.decode().removeprefix(index.ns) for k in await index.redis.keys("*"))
        assert keys == [":inc:decode-1:inc-a:seq", ":incarnations"]  # removed blocks leave nothing behind
        await pub.close(), await index.close()

    run(body())


def test_longest_prefix_several_instances_stops_at_first_miss(redis_server):
    async def body():
        pubs = {iid: make_publisher(redis_server.url, iid, "inc") for iid in ("a", "b", "c", "d")}
        runs = {"a": HASHES[:35], "b": HASHES[:2], "c": HASHES[:7] + HASHES[8:30], "d": HASHES[1:20]}
        for iid, hashes in runs.items():
            pub, pool = pubs[iid]
            await pub.publish(pool.batch(stored(*hashes)))
        index = PrefixIndex(redis_server.url, CONTRACT, batch_size=16)
        live = dict.fromkeys(runs, "inc") | {"e": "inc"}  # e holds nothing
        assert await index.longest_prefixes(HASHES, live) == {"a": 35, "b": 2, "c": 7, "d": 0, "e": 0}
        # round trips stop at the first miss of every run: count the lookups the server saw
        await index.redis.config_resetstat()
        await index.longest_prefixes(HASHES, {"b": "inc", "c": "inc"})
        assert (await index.redis.info("commandstats"))["cmdstat_hmget"]["calls"] == 16  # one batch of 16
        await index.redis.config_resetstat()
        await index.longest_prefixes(HASHES, {"a": "inc"})
        assert (await index.redis.info("commandstats"))["cmdstat_hmget"]["calls"] == 40  # all 3 batches (16 + 16 + 8)
        for pub, _ in pubs.values():
            await pub.close()
        await index.close()

    run(body())


def test_tiers_each_block_counted_at_its_fastest_tier(redis_server):
    """Blocks in the host and disk tiers continue a run; a block in several tiers counts at the fastest; moves
    between tiers, a rebuild from a tiered snapshot and a clean shutdown keep the index exact."""
    async def body():
        pub, pool = make_publisher(redis_server.url)
        index = PrefixIndex(redis_server.url, CONTRACT, batch_size=4)
        live = {"decode-1": "inc-a"}

        async def tiers():
            return (await index.tiered_prefixes(HASHES, live))["decode-1"]

        await pub.publish(pool.batch(stored(*HASHES[:3]), stored(*HASHES[3:6], tier="host"),
                                     stored(*HASHES[6:9], HASHES[1], tier="disk")))  # fmt: skip
        assert await tiers() == {"pool": 3, "host": 3, "disk": 3}
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 9}
        # block 1 evicted from the pool to the host tier: still held, now slower; block 4 leaves the host tier
        await pub.publish(pool.batch(removed(HASHES[1]), stored(HASHES[1], tier="host"), removed(HASHES[4],
                                                                                         tier="host")))
        assert await tiers() == {"pool": 2, "host": 2, "disk": 0}
        assert await index.tiered_prefixes(HASHES, live, tiers={"decode-1": ("pool",)}) == {
            "decode-1": {"pool": 1, "host": 0, "disk": 0}}  # (the pool alone: block 1 is not there)
        await pub.publish(pool.batch(stored(HASHES[4], tier="disk")))  # a promotion fills the gap from disk
        assert await tiers() == {"pool": 2, "host": 3, "disk": 4}
        pub.dirty = True  # a rebuild from the tiered snapshot writes the same state
        await pub.verify()
        assert pub.num_rebuilds == 1 and await tiers() == {"pool": 2, "host": 3, "disk": 4}
        await pub.remove_incarnation()
        assert await index.redis.keys(f"{index.ns}:*") == []  # every tier's fields went
        with pytest.raises(ValueError, match="unknown KV tier"):
            await pub.publish(pool.batch(stored(HASHES[0], tier="tape")))
        await pub.close(), await index.close()

    run(body())


def test_stale_incarnation_ignored_and_cleaned(redis_server):
    async def body():
        old, old_pool = make_publisher(redis_server.url, "decode-1", "inc-old")
        await old.publish(old_pool.batch(stored(*HASHES[:6])))
        new, new_pool = make_publisher(redis_server.url, "decode-1", "inc-new")  # the same instance id, restarted
        await new.publish(new_pool.batch(stored(*HASHES[:3])))
        other, other_pool = make_publisher(redis_server.url, "decode-2", "inc-x")  # dead, never restarted
        await other.publish(other_pool.batch(stored(*HASHES[:4])))
        index = PrefixIndex(redis_server.url, CONTRACT)
        live = {"decode-1": "inc-new"}
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 3}
        assert await index.longest_prefixes(HASHES, {"decode-1": "inc-old"}) == {"decode-1": 0}  # overwritten
        assert await index.cleanup(live) == 2
        assert await index.cleanup(live) == 0
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 3}
        assert await index.longest_prefixes(HASHES, {"decode-2": "inc-x"}) == {"decode-2": 0}
        keys = sorted(k.decode() for k in await index.redis.keys("*inc:*"))
        assert [k.rsplit(":", 3)[1:] for k in keys] == [["decode-1", "inc-new", "blocks"],
                                                        ["decode-1", "inc-new", "seq"]]  # fmt: skip
        assert await index.redis.hlen(f"{index.ns}:block:{HASHES[5].hex()}") == 0
        await new.remove_incarnation()  # clean shutdown: nothing of this contract is left
        assert await index.redis.keys(f"{index.ns}:*") == []
        for c in (old, new, other, index):
            await c.close()

    run(body())


def test_gap_rebuilds_from_snapshot(redis_server):
    async def body():
        pub, pool = make_publisher(redis_server.url)
        index = PrefixIndex(redis_server.url, CONTRACT)
        live = {"decode-1": "inc-a"}
        await pub.publish(pool.batch(stored(*HASHES[:4])))
        pool.batch(removed(HASHES[0]))  # seq 2 is lost
        await pub.publish(pool.batch(stored(HASHES[4], HASHES[5])))  # seq 3: a gap
        assert pub.num_rebuilds == 1 and pub.applied_seq == 3
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}  # block 0 is gone
        assert await index.longest_prefixes(HASHES[1:], live) == {"decode-1": 5}
        await pub.publish(pool.batch(stored(HASHES[0])))
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 6}
        assert pub.num_rebuilds == 1
        await pub.close(), await index.close()

    run(body())


def test_flushall_rebuilds_on_next_publish(redis_server):
    async def body():
        pub, pool = make_publisher(redis_server.url)
        index = PrefixIndex(redis_server.url, CONTRACT)
        live = {"decode-1": "inc-a"}
        await pub.publish(pool.batch(stored(*HASHES[:4])))
        await index.redis.flushall()
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        await pub.publish(pool.batch(stored(HASHES[4])))
        assert pub.num_rebuilds == 1
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 5}
        await index.redis.flushall()
        await pub.verify()  # what run() does when idle
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 5}
        await pub.close(), await index.close()

    run(body())


def test_replayed_or_late_stored_does_not_resurrect(redis_server):
    async def body():
        pub, pool = make_publisher(redis_server.url)
        index = PrefixIndex(redis_server.url, CONTRACT)
        live = {"decode-1": "inc-a"}
        first = pool.batch(stored(*HASHES[:3]))
        await pub.publish(first)
        await pub.publish(pool.batch(removed(HASHES[0])))
        await pub.publish(first)  # replayed
        pub.applied_seq = None  # and again, past the client-side filter: Redis's guard alone
        await pub.publish(first)
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        # late: seq 4 (remove) arrives before seq 3 (store) of the same block
        late = pool.batch(stored(HASHES[0]))
        await pub.publish(pool.batch(removed(HASHES[0])))  # a gap: rebuilt from the snapshot at seq 4
        await pub.publish(late)
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        assert pub.num_rebuilds == 1 and pub.applied_seq == 4
        # the guard is in Redis: another writer of the same incarnation replaying an old batch changes nothing
        replayer, _ = make_publisher(redis_server.url)
        await replayer.publish(late)
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        assert await index.longest_prefixes(HASHES[1:], live) == {"decode-1": 2}
        for c in (pub, replayer, index):
            await c.close()

    run(body())


def test_two_contracts_never_see_each_other(redis_server):
    async def body():
        other_hashes = hash_request_blocks(list(range(4 * 10)), OTHER_CONTRACT)
        pub, pool = make_publisher(redis_server.url, "decode-1", "inc-a", CONTRACT)
        opub, opool = make_publisher(redis_server.url, "decode-2", "inc-b", OTHER_CONTRACT)
        await pub.publish(pool.batch(stored(*HASHES[:10])))
        await opub.publish(opool.batch(stored(*HASHES[:10], *other_hashes)))  # even the same hash bytes
        index, oindex = PrefixIndex(redis_server.url, CONTRACT), PrefixIndex(redis_server.url, OTHER_CONTRACT)
        live = {"decode-1": "inc-a", "decode-2": "inc-b"}
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 10, "decode-2": 0}
        assert await oindex.longest_prefixes(HASHES, live) == {"decode-1": 0, "decode-2": 10}
        assert await oindex.longest_prefixes(other_hashes, live) == {"decode-1": 0, "decode-2": 10}
        assert await index.cleanup({}) == 1  # only its own contract's incarnations
        assert await oindex.longest_prefixes(other_hashes, live) == {"decode-1": 0, "decode-2": 10}
        for c in (pub, opub, index, oindex):
            await c.close()

    run(body())


def test_redis_down_then_back(redis_server):
    async def body():
        pool = FakePool()
        pub, _ = make_publisher(redis_server.url, pool=pool, timeout_s=0.5, resync_interval_s=0.1)
        index = PrefixIndex(redis_server.url, CONTRACT, timeout_s=0.5)
        live = {"decode-1": "inc-a"}
        queue = asyncio.Queue()
        task = asyncio.create_task(pub.run(queue))
        queue.put_nowait(pool.batch(stored(*HASHES[:3])))
        await wait_for(lambda: index.longest_prefixes(HASHES, live), {"decode-1": 3})

        redis_server.stop()
        t0 = time.monotonic()
        with pytest.raises(IndexUnavailableError):
            await index.longest_prefixes(HASHES, live)
        with pytest.raises(IndexUnavailableError):
            await index.cleanup(live)
        assert time.monotonic() - t0 < 1.0
        queue.put_nowait(pool.batch(stored(*HASHES[3:6])))  # lost with the server
        queue.put_nowait(pool.batch(removed(HASHES[0])))
        await wait_until(lambda: queue.empty() and pub.dirty)
        assert not task.done()

        redis_server.start()  # an empty Redis on the same port; no new batch: the idle resync rebuilds
        await wait_for(lambda: index.longest_prefixes(HASHES[1:], live), {"decode-1": 5})
        assert await index.longest_prefixes(HASHES, live) == {"decode-1": 0}
        queue.put_nowait(pool.batch(stored(HASHES[0])))
        await wait_for(lambda: index.longest_prefixes(HASHES, live), {"decode-1": 6})
        assert not task.done() and not pub.dirty
        task.cancel()
        await pub.close(), await index.close()

    run(body())


def test_redis_hung_raises_within_timeout(redis_server):
    async def body():
        index = PrefixIndex(redis_server.url, CONTRACT, timeout_s=0.3)
        client = aioredis.Redis.from_url(redis_server.url)  # a caller's client without socket timeouts
        index2 = PrefixIndex(client, CONTRACT, timeout_s=0.3)
        assert await index.longest_prefixes(HASHES, {"x": "y"}) == {"x": 0}
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            for idx in (index, index2):
                t0 = time.monotonic()
                with pytest.raises(IndexUnavailableError):
                    await idx.longest_prefixes(HASHES, {"x": "y"})
                assert time.monotonic() - t0 < 0.8
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert await index2.longest_prefixes(HASHES, {"x": "y"}) == {"x": 0}  # resumes on the same client
        await index.close(), await client.aclose()

    run(body())


def test_instance_info_json_is_backward_compatible():
    old = json.dumps({"instance_id": "decode-1", "tier": "decode", "address": "h:1", "model_id": "m",
                      "block_size": 16})  # fmt: skip
    info = InstanceInfo.from_json(old)
    assert info.incarnation == "" and info.hash_contract is None
    newer = json.dumps({**json.loads(old), "incarnation": "i", "hash_contract": CONTRACT.to_dict(), "later": 1})
    assert HashContract.from_dict(InstanceInfo.from_json(newer).hash_contract) == CONTRACT
    assert InstanceInfo.from_json('{"tier": "decode"}') is None and InstanceInfo.from_json("[1]") is None


async def wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def wait_for(fetch, expected, timeout_s=5.0):
    """Until await fetch() == expected (IndexUnavailableError counts as not yet)."""
    deadline, got = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            got = await fetch()
        except IndexUnavailableError as e:
            got = e
        if got == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"got {got!r}, expected {expected!r}")


def test_redis_loops_stop_however_a_cancel_lands(redis_server):
    """A heartbeat and a publisher, each looping on Redis calls, stopped at random moments: cancel_and_wait ends
    both every time. One cancel() alone can be lost on Python < 3.12 (shared/cluster_state/__init__.py): the
    loop then ran on, and a drain awaiting the heartbeat hung until the process was killed."""
    from tandem.shared.cluster_state import cancel_and_wait
    from tandem.shared.cluster_state.registry import Registry

    async def main():
        registry = Registry(redis_server.url)
        info = InstanceInfo("decode-1", "decode", "127.0.0.1:1", "m:abc:fp32", 4, 8)
        publisher, _ = make_publisher(redis_server.url, resync_interval_s=0.0)

        async def current_info():
            return info

        rng = random.Random(0)
        for _ in range(50):
            loops = [asyncio.create_task(registry.heartbeat(current_info, interval_s=0.0)),
                     asyncio.create_task(publisher.run(asyncio.Queue()))]  # fmt: skip
            await asyncio.sleep(rng.uniform(0.0, 0.005))
            async with asyncio.timeout(5):
                await cancel_and_wait(*loops)
            assert all(t.cancelled() for t in loops)
        await registry.redis.delete(info.key)
        await publisher.close()
        await registry.redis.aclose()

    run(main())
