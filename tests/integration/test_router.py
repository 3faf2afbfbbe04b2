"""The gateway's Router (services/gateway/router.py) on a real redis-server: instance records in the registry and
block events in the prefix index, as engines write them; exact costs decide the route. Covers a cached prefix
winning, a deep queue winning over it (on either side of the break-even point), a restarted instance's stale
entries, a killed instance, a mismatched hash contract, the decode's choice and the local-prefill threshold, and
session affinity (a session's pair kept within the load bound, left when an instance is gone, restarted, down,
skipped or full; the session table's LRU bound and TTL).

Over 400 lines on purpose: every routing rule against one real Redis and one set of record factories."""
import asyncio
import dataclasses
import logging

import pytest

from tandem.services.gateway.router import DECODE_LOAD_TOKENS, Router
from tandem.shared.block_hash import HashContract, hash_request_blocks
from tandem.shared.kv_events import BlockStored, KVEventBatch
from tandem.shared.cluster_state.prefix_index import KVEventPublisher, PrefixIndex
from tandem.shared.cluster_state.registry import InstanceInfo, Registry
from tandem.shared.errors import NoInstanceError

MODEL_ID = "smollm2:abc:fp32"
CONTRACT = HashContract(block_size=16, model_id=MODEL_ID, kv_dtype="float32")
PROMPT = list(range(1000, 1200))  # 200 tokens: 12 full blocks can be cached (never the last token's block)
CACHED = 10 * 16  # the prefix the holder has


def instance(iid: str, tier: str, incarnation: str = "inc-1", contract: HashContract = CONTRACT, **load):
    load = {"num_blocks": 1024, "num_free_blocks": 1024} | load
    return InstanceInfo(iid, tier, "127.0.0.1:1", MODEL_ID, 16, incarnation=incarnation,
                        hash_contract=contract.to_dict(), **load)  # fmt: skip


class World:
    """The registry and the index a gateway would see, written through the engines' own classes."""

    def __init__(self, url: str):
        self.url, self.registry = url, Registry(url)
        self.publishers: list[KVEventPublisher] = []

    async def register(self, *infos: InstanceInfo) -> None:
        for info in infos:
            await self.registry.publish(info)

    async def cache(self, info: InstanceInfo, num_tokens: int, salt: str | None = None, tier: str = "pool") -> None:
        """info's engine stores PROMPT's first num_tokens (whole blocks) in its prefix cache (in tier)."""
        contract = HashContract.from_dict(info.hash_contract)
        hashes = hash_request_blocks(PROMPT[:num_tokens], contract, salt)
        publisher = KVEventPublisher(self.url, info.instance_id, info.incarnation, contract, _no_snapshot)
        self.publishers.append(publisher)
        await publisher.publish(KVEventBatch(1, (BlockStored(tuple(hashes), tier),)))

    def router(self, **kw) -> Router:
        return Router(self.registry, MODEL_ID, CONTRACT, PrefixIndex(self.url, CONTRACT), **kw)

    async def close(self) -> None:
        for publisher in self.publishers:
            await publisher.close()
        await self.registry.close()


async def _no_snapshot():
    raise AssertionError("no rebuild expected: every batch is in sequence")


def in_world(redis_server, body):
    async def run():
        world = World(redis_server.url)
        try:
            await body(world)
        finally:
            await world.close()

    asyncio.run(run())


def test_cached_prefix_wins_until_the_queue_outweighs_it(redis_server):
    async def body(world):
        decode, other = instance("decode-1", "decode"), instance("prefill-b", "prefill")
        for queued, winner in ((0, "prefill-a"), (CACHED - 1, "prefill-a"), (CACHED + 1, "prefill-b"),
                               (5000, "prefill-b")):  # fmt: skip
            holder = instance("prefill-a", "prefill", num_queued_tokens=queued)
            await world.register(decode, holder, other)
            if queued == 0:
                await world.cache(holder, CACHED)
            route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
            assert route.prefill.instance_id == winner, (queued, route.explain())
            assert f"prefill prefill-a: {queued} queued + {len(PROMPT) - CACHED} to compute" in route.explain()
            assert f"prefill prefill-b: 0 queued + {len(PROMPT)} to compute" in route.explain()
            assert route.prefill_cached_tokens == (CACHED if winner == "prefill-a" else 0)

    in_world(redis_server, body)


def test_prefill_only_work_takes_the_cheapest_prefill_and_needs_no_decode(redis_server):
    """Router.route_prefill (embeddings): the prefill rule of route, with no decode registered at all."""
    async def body(world):
        other = instance("prefill-b", "prefill")
        for queued, winner in ((0, "prefill-a"), (CACHED - 1, "prefill-a"), (CACHED + 1, "prefill-b")):
            holder = instance("prefill-a", "prefill", num_queued_tokens=queued)
            await world.register(holder, other)
            if queued == 0:
                await world.cache(holder, CACHED)
            assert (await world.router().route_prefill(PROMPT)).instance_id == winner, queued
        assert (await world.router().route_prefill(PROMPT, {"prefill-a"})).instance_id == "prefill-b"

    in_world(redis_server, body)


def test_restarted_instance_entries_are_not_trusted_and_are_cleaned(redis_server):
    async def body(world):
        holder = instance("prefill-a", "prefill", incarnation="before")
        await world.register(instance("decode-1", "decode"), holder, instance("prefill-b", "prefill"))
        await world.cache(holder, CACHED)
        router = world.router(local_prefill_tokens=0)
        assert (await router.route(PROMPT, 300)).prefill_cached_tokens == CACHED
        await world.register(instance("prefill-a", "prefill", incarnation="after"))  # the same id, started again
        route = await router.route(PROMPT, 300)
        assert f"prefill prefill-a: 0 queued + {len(PROMPT)} to compute" in route.explain(), route.explain()
        assert route.prefill_cached_tokens == 0
        await router.cleanup_index()
        keys = [k.decode() for k in await router.index.redis.keys("*")]
        assert not [k for k in keys if "before" in k] and not [k for k in keys if ":block:" in k], keys

    in_world(redis_server, body)


def test_killed_instance_is_not_a_candidate(redis_server):
    async def body(world):
        holder, other = instance("prefill-a", "prefill"), instance("prefill-b", "prefill")
        await world.register(instance("decode-1", "decode"), holder, other)
        await world.cache(holder, CACHED)
        await world.registry.remove(holder)  # what its registry TTL does once it stops beating
        router = world.router(local_prefill_tokens=0)
        for _ in range(3):
            assert (await router.route(PROMPT, 300)).prefill.instance_id == "prefill-b"
        # the gateway also skips an instance that failed this request, while it is still registered
        await world.register(holder)
        route = await router.route(PROMPT, 300, skip={"prefill-a"})
        assert route.prefill.instance_id == "prefill-b"

    in_world(redis_server, body)


def test_an_instance_marked_down_is_routed_around_until_its_ttl_unless_no_other_is_left(redis_server,
                                                                                       monkeypatch):
    """Down or failed prefills: the others; none left: the decode computes the prompt itself, or (a request only a
    prefill can serve: local False) the down ones are tried anyway rather than the request refused."""
    async def body(world):
        a, b = instance("prefill-a", "prefill"), instance("prefill-b", "prefill")
        await world.register(instance("decode-1", "decode"), a, b)
        for policy in ("round-robin", "cache-aware"):
            router = world.router(local_prefill_tokens=0, policy=policy)
            router.mark_down(a)  # (a call to it failed as unreachable)
            assert {(await router.route(PROMPT, 300)).prefill.instance_id for _ in range(4)} == {"prefill-b"}
            router.mark_down(b)
            for route in [await router.route(PROMPT, 300) for _ in range(2)]:
                assert route.prefill is None and route.reason == "decode_local", route.explain()
                assert "computes the prompt itself: no live prefill is left" in route.explain()
            routes = {(await router.route(PROMPT, 300, local=False)).prefill.instance_id for _ in range(4)}
            both = {"prefill-a", "prefill-b"}
            assert routes == both if policy == "round-robin" else routes < both  # (cache-aware: the prompt's)
            # each one failed for this request (still registered): the decode; none for local False
            route = await world.router(local_prefill_tokens=0, policy=policy).route(PROMPT, 300, skip={"prefill-a",
                                                                                                    "prefill-b"})
            assert route.prefill is None and route.reason == "decode_local", route.explain()
            with pytest.raises(NoInstanceError, match="no live prefill instance"):
                await router.route(PROMPT, 300, skip={"prefill-a", "prefill-b"}, local=False)
        monkeypatch.setattr(world.registry, "ttl_s", 0.0)
        router = world.router(local_prefill_tokens=0, policy="round-robin")
        router.mark_down(a)  # (for one TTL: 0 s now)
        router.mark_down(b)
        assert {(await router.route(PROMPT, 300)).prefill.instance_id for _ in range(4)} == {"prefill-a", "prefill-b"}

    in_world(redis_server, body)


def test_the_registry_keeps_its_last_list_through_a_redis_restart(redis_server, monkeypatch):
    """Redis down: the last list; Redis back without its data: still the last list for REREGISTER_GRACE_S (the
    instances re-register with their next heartbeat), then what Redis says."""
    import tandem.shared.cluster_state.registry

    async def body(world):
        await world.register(instance("decode-1", "decode"))
        assert [i.instance_id for i in await world.registry.list_instances("decode")] == ["decode-1"]
        redis_server.stop()
        assert [i.instance_id for i in await world.registry.list_instances("decode")] == ["decode-1"]
        redis_server.start()  # (empty: no persistence)
        assert [i.instance_id for i in await world.registry.list_instances("decode")] == ["decode-1"]
        monkeypatch.setattr(tandem.shared.cluster_state.registry, "REREGISTER_GRACE_S", 0.0)
        for _ in range(20):  # (a read started before the grace ended may still answer first)
            if not await world.registry.list_instances("decode"):
                break
            await asyncio.sleep(0.05)
        assert await world.registry.list_instances("decode") == []

    in_world(redis_server, body)


def test_other_hash_contract_is_never_looked_up(redis_server, caplog):
    async def body(world):
        int8 = HashContract(block_size=16, model_id="smollm2:abc:int8", kv_dtype="float32")
        holder = instance("prefill-a", "prefill", contract=int8)
        await world.register(instance("decode-1", "decode"), holder, instance("prefill-b", "prefill"))
        await world.cache(holder, CACHED)
        with caplog.at_level(logging.WARNING, logger="tandem.services.gateway.router"):
            route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert f"prefill prefill-a: 0 queued + {len(PROMPT)} to compute" in route.explain()
        assert "prefill-a has hash contract" in caplog.text

    in_world(redis_server, body)


def test_decode_choice_and_local_prefill_threshold(redis_server):
    async def body(world):
        holder = instance("decode-a", "decode")
        idle = instance("decode-b", "decode")
        await world.register(holder, idle, instance("prefill-a", "prefill"))
        await world.cache(holder, 12 * 16)  # everything but the last 8 tokens
        uncached = len(PROMPT) - 12 * 16
        route = await world.router(local_prefill_tokens=uncached).route(PROMPT, 300)
        assert route.decode.instance_id == "decode-a" and route.prefill is None, route.explain()
        assert f"decode decode-a: {12 * 16} cached, 0 requests -> {12 * 16}" in route.explain()
        route = await world.router(local_prefill_tokens=uncached - 1).route(PROMPT, 300)
        assert route.decode.instance_id == "decode-a" and route.prefill.instance_id == "prefill-a"
        # load outweighs the prefix: one running request weighs DECODE_LOAD_TOKENS > 192 cached tokens
        await world.register(instance("decode-a", "decode", num_running=1))
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert route.decode.instance_id == "decode-b", route.explain()
        assert f"decode decode-a: {12 * 16} cached, 1 requests -> {12 * 16 - DECODE_LOAD_TOKENS}" in route.explain()
        # a decode without room for the request is passed over while another has room
        await world.register(instance("decode-a", "decode", num_free_blocks=10))
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert route.decode.instance_id == "decode-b", route.explain()

    in_world(redis_server, body)


def test_a_prompt_just_routed_draws_its_prefix_before_the_index_shows_it(redis_server, monkeypatch):
    import tandem.services.gateway.router as router_module

    async def body(world):
        await world.register(instance("decode-1", "decode"), instance("prefill-a", "prefill"),
                             instance("prefill-b", "prefill"))  # fmt: skip
        router = world.router(local_prefill_tokens=0)
        first = (await router.route(PROMPT, 300)).prefill.instance_id  # a tie: round-robin
        for _ in range(3):  # the index still knows nothing; the same prefix follows the first
            route = await router.route(PROMPT[:150] + [7] * 50, 300)
            assert route.prefill.instance_id == first, route.explain()
            assert "routed there, not yet indexed" in route.explain()
        route = await router.route(list(range(5000, 5200)), 300)  # unrelated: nothing counts as held anywhere
        assert route.explain().count("0 queued + 200 to compute -> 200") == 2, route.explain()
        await asyncio.sleep(0.3)  # the hints expire
        route = await router.route(PROMPT, 300)
        assert "not yet indexed" not in route.explain() and route.prefill_cached_tokens == 0, route.explain()

    monkeypatch.setattr(router_module, "ROUTED_HINT_S", 0.2)
    in_world(redis_server, body)


def test_a_frozen_redis_does_not_hold_up_routing(redis_server, caplog):
    """Redis stopped by SIGSTOP (its calls time out instead of failing): routes come from the registry's last view
    and without the index, none waits for Redis's 2 s timeout (before, each waited about 4 s); once Redis answers
    again, cache-aware routing resumes by itself."""
    import signal
    import time

    async def body(world):
        caplog.set_level(logging.INFO)
        holder = instance("prefill-a", "prefill")
        await world.register(instance("decode-1", "decode"), holder, instance("prefill-b", "prefill"))
        await world.cache(holder, CACHED)
        router = world.router(local_prefill_tokens=0)
        assert (await router.route(PROMPT, 300)).prefill_cached_tokens == CACHED
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            routes = [await router.route(PROMPT, 300) for _ in range(10)]
            elapsed = time.monotonic() - started
            assert all(r.decode.instance_id == "decode-1" and r.prefill_cached_tokens == 0 for r in routes)
            assert elapsed < 2.0, elapsed  # (10 routes; one lookup may wait for the index's 0.5 s timeout)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        for _ in range(50):
            if "cache-aware routing resumed" in caplog.text:
                break
            await asyncio.sleep(0.1)
        assert "cache-aware routing resumed" in caplog.text

    in_world(redis_server, body)


def test_a_decode_computes_a_long_prompt_when_its_measured_cost_is_lower(redis_server):
    """Past --local-prefill-tokens the measured rates decide: an idle decode takes the prompt while the prefill's
    queue is deep; a busy one, or one whose rate is not measured yet, does not; prompts it was just given count in
    its queue before its record shows them."""
    async def body(world):
        prefill = instance("prefill-a", "prefill", num_queued_tokens=5000, tokens_per_s=1000.0)  # 5.2 s to go
        await world.register(instance("decode-a", "decode", tokens_per_s=500.0), prefill)
        router = world.router(local_prefill_tokens=0)
        route = await router.route(PROMPT, 300)  # 200 tokens at 500/s: 0.4 s, this request alone waiting
        assert route.prefill is None and route.reason == "decode_local_cost", route.explain()
        assert "on decode 400 ms x request (200 tokens at 500/s, 1 waiting), on prefill 5200 ms" in route.explain()
        route = await router.route(PROMPT, 300)  # (the first prompt's 200 tokens queued there: 0.8 s)
        assert route.prefill is None and "on decode 800 ms" in route.explain(), route.explain()
        await world.register(instance("decode-a", "decode", tokens_per_s=500.0, num_running=20))
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)  # 0.4 s x 21 requests held up
        assert route.prefill.instance_id == "prefill-a", route.explain()
        await world.register(instance("decode-a", "decode"))  # (no rate measured yet)
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert route.prefill.instance_id == "prefill-a" and "measured" not in route.explain(), route.explain()
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300, local=False)  # (prompt logprobs)
        assert route.prefill.instance_id == "prefill-a"

    in_world(redis_server, body)


def test_a_hit_is_priced_by_the_tier_holding_it(redis_server):
    """The same cached prefix in a prefill's pool, host tier and disk tier: pool < host < disk < computing, by each
    instance's measured seconds per block times its rate; the decision log names the tier; before the costs are
    measured, the prefill holding more in its pool wins the tie."""
    async def body(world):
        rate = {"tokens_per_s": 1000.0}
        pool = instance("prefill-pool", "prefill", **rate)
        host = instance("prefill-host", "prefill", kv_tier_load_s={"host": 0.0002, "disk": 0.003}, **rate)
        disk = instance("prefill-disk", "prefill", kv_tier_load_s={"host": 0.0002, "disk": 0.003}, **rate)
        cold = instance("prefill-cold", "prefill", **rate)
        await world.register(instance("decode-a", "decode"), pool, host, disk, cold)
        await world.cache(pool, CACHED)
        await world.cache(host, CACHED, tier="host")
        await world.cache(disk, CACHED, tier="disk")

        def place():  # (a new router each time: a routed prompt counts as held where it went)
            return world.router(local_prefill_tokens=0).route(PROMPT, 300)

        route = await place()  # costs: 40, 40 + 10 x 0.2 ms x 1000/s = 42, 40 + 30 = 70, 200
        assert route.prefill.instance_id == "prefill-pool", route.explain()
        assert route.prefill_cached_tiers == {"pool": CACHED, "host": 0, "disk": 0}
        assert ("prefill prefill-disk: 0 queued + 40 to compute, of the cached 160 in its disk tier (3.00 ms/block): "
                "+30 to load -> 70") in route.explain()
        await world.register(dataclasses.replace(pool, num_queued_tokens=5))  # 45 > 42
        route = await place()
        assert route.prefill.instance_id == "prefill-host", route.explain()
        assert route.prefill_cached_tiers["host"] == CACHED
        await world.register(dataclasses.replace(pool, num_queued_tokens=500),
                             dataclasses.replace(host, num_queued_tokens=500))  # fmt: skip
        route = await place()
        assert route.prefill.instance_id == "prefill-disk", route.explain()
        await world.register(dataclasses.replace(disk, kv_tier_load_s={"disk": 0.020}))  # 40 + 200 > 200: compute
        route = await place()
        assert route.prefill.instance_id == "prefill-cold", route.explain()
        # costs not measured yet: every hit is free, and of the equal ones the pool's wins
        await world.register(*(dataclasses.replace(i, tokens_per_s=0.0, kv_tier_load_s={}, num_queued_tokens=0)
                               for i in (pool, host, disk)))  # fmt: skip
        for _ in range(3):
            assert (await place()).prefill.instance_id == "prefill-pool"

    in_world(redis_server, body)


def test_only_a_prefill_sharing_the_decodes_kv_format_is_paired_with_it(redis_server, caplog):
    """A fleet mid-way through a change of --kv-dtype: the cheaper prefill of another KV dtype is never paired
    with the decode (the transfer would be refused); a decode no prefill pairs with computes the prompt itself."""
    async def body(world):
        int8 = {"kv_dtype": "int8"}
        await world.register(instance("decode-a", "decode", **int8), instance("prefill-int8", "prefill",
                             num_queued_tokens=900, **int8), instance("prefill-fp8", "prefill", kv_dtype="fp8_e4m3"))
        with caplog.at_level(logging.WARNING):
            route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert route.prefill.instance_id == "prefill-int8", route.explain()
        assert "prefill prefill-fp8" not in route.explain()
        assert "prefill-fp8 (KV fp8_e4m3, blocks of 16) cannot send KV to decode decode-a (KV int8" in caplog.text
        await world.registry.remove(instance("prefill-int8", "prefill"))
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert route.prefill is None and route.reason == "decode_local", route.explain()
        assert "no prefill shares its KV format (int8, blocks of 16)" in route.explain()
        with pytest.raises(NoInstanceError, match="shares decode decode-a's KV format"):
            await world.router(local_prefill_tokens=0).route(PROMPT, 300, local=False)
        await world.register(instance("decode-b", "decode", kv_dtype="fp8_e4m3"))  # (now a pair: decode-b's)
        route = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert (route.decode.instance_id, route.prefill.instance_id) == ("decode-b", "prefill-fp8"), route.explain()

    in_world(redis_server, body)


async def _pair(router: Router, session: str | None, **kw) -> tuple[str, str, str]:
    route = await router.route(PROMPT, 300, session_id=session, **kw)
    return route.prefill.instance_id, route.decode.instance_id, route.reason


def test_a_session_stays_on_its_pair_while_its_load_is_within_the_bound(redis_server):
    """Session affinity: the pair of the session's last request, over the cost model, until an instance of it is
    more than session_max_load tokens above its tier's least loaded; then the cost model, and the session moves."""
    async def body(world):
        await world.register(instance("prefill-a", "prefill"), instance("prefill-b", "prefill"),
                             instance("decode-a", "decode"), instance("decode-b", "decode"))  # fmt: skip
        router = world.router(local_prefill_tokens=0, session_max_load=1000)
        prefill, decode, reason = await _pair(router, "s1")
        assert reason == "cache_aware"
        other = {"prefill-a": "prefill-b", "prefill-b": "prefill-a"}[prefill]
        await world.cache(instance(other, "prefill"), CACHED)  # the cost model would now pick the other prefill
        await world.register(instance(prefill, "prefill", num_queued_tokens=1000),
                             instance(decode, "decode", num_running=3))  # 768 tokens: within the bound
        for _ in range(3):
            route = await router.route(PROMPT, 300, session_id="s1")
            assert (route.prefill.instance_id, route.decode.instance_id, route.reason) == (
                prefill, decode, "session_affinity"), route.explain()
        assert route.explanation[0] == (f"session s1: stays (decode {decode} +768, prefill {prefill} +1000 tokens "
                                        "above the least loaded, <= 1000)")
        other_decode = {"decode-a": "decode-b", "decode-b": "decode-a"}[decode]
        assert await _pair(router, "s2") == (other, other_decode, "cache_aware")  # (a new session: the cost model)
        await world.register(instance(prefill, "prefill", num_queued_tokens=1001))  # past the bound: it moves
        route = await router.route(PROMPT, 300, session_id="s1")
        assert route.prefill.instance_id == other and route.reason == "cache_aware", route.explain()
        assert route.explanation[0] == (f"session s1: moves from prefill {prefill}, which is 1001 tokens above the "
                                        "least loaded prefill (> 1000, --session-affinity-max-load)")
        decode = route.decode.instance_id  # (the cost model also chose the idle decode)
        await world.register(instance(prefill, "prefill"), instance("decode-a", "decode"),
                             instance("decode-b", "decode"))  # (idle again: the session stays where it moved)
        assert (await _pair(router, "s1"))[:2] == (other, decode)
        await world.register(instance(decode, "decode", num_running=4))  # 1024 tokens above the other decode
        route = await router.route(PROMPT, 300, session_id="s1")
        assert route.decode.instance_id != decode and "moves from decode" in route.explanation[0], route.explain()

    in_world(redis_server, body)


def test_a_session_moves_when_its_instance_is_gone_restarted_down_skipped_or_full(redis_server):
    async def body(world):
        a, b = instance("prefill-a", "prefill"), instance("prefill-b", "prefill")
        await world.register(a, b, instance("decode-a", "decode"), instance("decode-b", "decode"))
        router = world.router(local_prefill_tokens=0)
        # gone: its registry record expired
        pinned = (await _pair(router, "s"))[0]
        gone = instance(pinned, "prefill")
        await world.registry.remove(gone)
        route = await router.route(PROMPT, 300, session_id="s")
        assert route.prefill.instance_id != pinned and f"prefill {pinned}, which is gone or restarted" in \
            route.explanation[0], route.explain()
        # restarted: the same id, another incarnation (its cache is gone)
        pinned = route.prefill.instance_id
        await world.register(gone, instance(pinned, "prefill", incarnation="inc-2"))
        route = await router.route(PROMPT, 300, session_id="s")
        assert f"prefill {pinned}, which is gone or restarted" in route.explanation[0], route.explain()
        # marked down (a call to it failed as unreachable)
        pinned = route.prefill
        router.mark_down(pinned)
        route = await router.route(PROMPT, 300, session_id="s")
        assert route.prefill.instance_id != pinned.instance_id, route.explain()
        assert f"prefill {pinned.instance_id}, which is marked down" in route.explanation[0], route.explain()
        router._down.clear()
        # skipped: it failed this request (placement's next attempt)
        pinned = route.decode.instance_id
        route = await router.route(PROMPT, 300, session_id="s", skip={pinned})
        assert f"decode {pinned}, which failed this request" in route.explanation[0], route.explain()
        # full: no room for the request while the other decode has it
        pinned = route.decode.instance_id
        await world.register(instance(pinned, "decode", num_free_blocks=10))
        route = await router.route(PROMPT, 300, session_id="s")
        assert route.decode.instance_id != pinned, route.explain()
        assert f"decode {pinned}, which has no room for the request" in route.explanation[0], route.explain()
        # a migrated request: the cost model, and the session moves to its pair
        route = await router.route(PROMPT, 300, session_id="s", keep_session=False)
        assert route.explanation[0] == "session s: migrated, placed by the cost model", route.explain()
        assert router.sessions.get("s").decode == (route.decode.instance_id, route.decode.incarnation)

    in_world(redis_server, body)


def test_unknown_sessions_use_the_cost_model_and_the_table_is_bounded(redis_server):
    async def body(world):
        holder = instance("prefill-a", "prefill")
        await world.register(holder, instance("prefill-b", "prefill"), instance("decode-a", "decode"))
        await world.cache(holder, CACHED)
        router = world.router(local_prefill_tokens=0, max_sessions=2, session_ttl_s=0.2)
        route = await router.route(PROMPT, 300, session_id="new")
        assert route.prefill.instance_id == "prefill-a" and route.reason == "cache_aware", route.explain()
        assert route.explanation[0] == "session new: new here, placed by the cost model"
        assert "session" not in (await router.route(PROMPT, 300)).explain()
        for s in ("s1", "s2", "s3"):  # LRU: the least recently used of 3 goes
            await router.route(PROMPT, 300, session_id=s)
        assert len(router.sessions) == 2 and router.sessions.get("new") is None and router.sessions.get("s1") is None
        await router.route(PROMPT, 300, session_id="s2")  # (used again: s3 is now the least recent)
        await router.route(PROMPT, 300, session_id="s4")
        assert router.sessions.get("s2") is not None and router.sessions.get("s3") is None
        await asyncio.sleep(0.3)  # past the TTL: forgotten
        assert (await router.route(PROMPT, 300, session_id="s2")).explanation[0].endswith("new here, placed by the "
                                                                                         "cost model")
        await asyncio.sleep(0.3)
        await router.cleanup_index()
        assert len(router.sessions) == 0

    in_world(redis_server, body)
