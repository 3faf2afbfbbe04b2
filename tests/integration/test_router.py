"""The gateway's Router (services/gateway/router.py) on a real redis-server: instance records in the registry and
block events in the prefix index, as engines write them; exact costs decide the route. Covers a cached prefix
winning, a deep queue winning over it (on either side of the break-even point), a restarted instance's stale
entries, a killed instance or one marked down (and none left: the decode computes the prompt), a mismatched hash
contract, the decode's choice and the local-prefill threshold, the tiers' prices, KV formats. Session affinity:
test_session_affinity.py; the shared registry and index: routing_world.py."""
import asyncio
import dataclasses
import logging

import pytest

from tandem.services.gateway.router import DECODE_LOAD_TOKENS
from tandem.shared.block_hash import HashContract
from tandem.shared.errors import NoInstanceError
from tests.integration.routing_world import CACHED, PROMPT, instance, in_world


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
