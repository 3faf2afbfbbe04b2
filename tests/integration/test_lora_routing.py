"""Adapter-aware routing (services/gateway/lora_routing.py) on a real redis-server, with registered records as the
engines write them (tests/integration/routing_world.py's World): the instance holding a request's adapter wins; the
adapter is loaded elsewhere once the holder's queue costs more than the measured load time (on either side of the
break-even point), never before a load time is measured; with no holder the queue decides; an adapter's prefix hits
never serve another adapter or the base model; instances with other files under the adapter's name are never
chosen; an unknown adapter is named; the decision log and the Prometheus counter name each choice."""
import pytest

from tandem.services.gateway.lora_routing import lora_key
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.shared.block_hash import hash_request_blocks
from tandem.shared.cluster_state.prefix_index import KVEventPublisher
from tandem.shared.errors import NoInstanceError, UnknownLoRAError
from tandem.shared.kv_events import BlockStored, KVEventBatch
from tests.integration.routing_world import CONTRACT, PROMPT, _no_snapshot, in_world, instance

SQL = {"sql": {"digest": "0123456789abcdef", "path": "/adapters/sql", "resident": True}}
LOAD_S, RATE = 0.1, 1000.0  # a measured load of 0.1 s at 1000 tokens/s: 100 tokens


def holding(iid: str, tier: str, adapters=SQL, **load):
    """An instance record with adapters loaded, a measured load time and rate."""
    return instance(iid, tier, lora_adapters=adapters, **({"lora_load_s": LOAD_S, "tokens_per_s": RATE} | load))


def route(world, **kw):
    return world.router(local_prefill_tokens=0).route(PROMPT, 300, lora_name="sql", local=False, **kw)


def test_the_instance_holding_the_adapter_wins_until_its_queue_costs_more_than_a_load(redis_server):
    async def body(world):
        await world.register(holding("decode-a", "decode"), holding("decode-b", "decode", {}))
        for queued, winner, reason in ((0, "prefill-a", "holder"), (99, "prefill-a", "holder"),
                                       (101, "prefill-b", "load_cheaper"), (5000, "prefill-b", "load_cheaper")):
            await world.register(holding("prefill-a", "prefill", num_queued_tokens=queued),
                                 holding("prefill-b", "prefill", {}))  # fmt: skip
            r = await route(world)
            assert (r.prefill.instance_id, r.lora_reasons["prefill"]) == (winner, reason), (queued, r.explain())
            assert r.decode.instance_id == "decode-a" and r.lora_reasons["decode"] == "holder", r.explain()
            assert f"prefill prefill-a: {queued} queued + {len(PROMPT)} to compute, holds adapter sql" in r.explain()
            assert (f"prefill prefill-b: 0 queued + {len(PROMPT)} to compute, loads it: adapter sql +100 to load "
                    f"(100 ms at 1000 tokens/s) -> {len(PROMPT) + 100}") in r.explain()
            assert [i.instance_id for i in r.lora_loads] == ([] if winner == "prefill-a" else ["prefill-b"])
            expected = ("prefill prefill-b loads it (cheaper than queueing behind a holder)" if reason != "holder"
                        else "prefill prefill-a holds it")  # fmt: skip
            assert r.explanation[-1] == f"adapter sql: decode decode-a holds it; {expected}", r.explain()
            assert r.lora.key == lora_key("sql", "0123456789abcdef")

    in_world(redis_server, body)


def test_decodes_pay_the_load_against_their_requests_and_nothing_moves_before_a_load_is_measured(redis_server):
    async def body(world):
        holder = holding("prefill-a", "prefill", num_queued_tokens=5000)
        busy = holding("decode-a", "decode", num_running=1)  # (256 tokens of requests > 100 to load)
        await world.register(holder, holding("prefill-b", "prefill", {}), busy, holding("decode-b", "decode", {}))
        r = await route(world)
        assert (r.decode.instance_id, r.lora_reasons["decode"]) == ("decode-b", "load_cheaper"), r.explain()
        assert "decode decode-b: 0 cached, 0 requests, loads it: adapter sql +100 to load" in r.explain()
        assert [i.instance_id for i in r.lora_loads] == ["decode-b", "prefill-b"]
        unmeasured = {"lora_load_s": 0.0}  # (no instance has measured a load: none may leave a holder)
        await world.register(holding("prefill-a", "prefill", num_queued_tokens=5000, **unmeasured),
                             holding("prefill-b", "prefill", {}, **unmeasured),
                             holding("decode-a", "decode", num_running=1, **unmeasured),
                             holding("decode-b", "decode", {}, **unmeasured))  # fmt: skip
        r = await route(world)
        assert (r.decode.instance_id, r.prefill.instance_id) == ("decode-a", "prefill-a"), r.explain()
        assert "load time not measured yet: not moved off a holder" in r.explain()
        # an adapter whose weights the engine dropped (--max-cpu-loras) costs a load there too: no one holds it
        dropped = {"sql": SQL["sql"] | {"resident": False}}
        await world.register(holding("decode-a", "decode", dropped), holding("decode-b", "decode", {}, num_running=1),
                             holding("prefill-a", "prefill", dropped), holding("prefill-b", "prefill", {}))
        r = await route(world)
        assert (r.decode.instance_id, r.lora_reasons["decode"]) == ("decode-a", "load_no_holder"), r.explain()
        assert "decode decode-a: 0 cached, 0 requests, reads it again: adapter sql +100 to load" in r.explain()
        assert [i.instance_id for i in r.lora_loads] == ([] if r.prefill.instance_id == "prefill-a" else ["prefill-b"])

    in_world(redis_server, body)


def test_without_a_holder_the_queue_decides_and_an_unknown_adapter_is_named(redis_server):
    async def body(world):
        unmeasured = {"lora_load_s": 0.0, "tokens_per_s": 0.0}
        await world.register(holding("decode-a", "decode", {}, **unmeasured),
                             holding("prefill-a", "prefill", {}, num_queued_tokens=10, **unmeasured),
                             holding("prefill-b", "prefill", {}, **unmeasured))  # fmt: skip
        router = world.router(local_prefill_tokens=0)
        assert "sql" not in await router.adapters()
        with pytest.raises(UnknownLoRAError, match="'sql'"):
            await router.route(PROMPT, 300, lora_name="sql")
        await world.register(holding("prefill-c", "prefill", num_queued_tokens=10**6, **unmeasured))  # a holder
        r = await router.route(PROMPT, 300, lora_name="sql", local=False)
        assert (r.prefill.instance_id, r.lora_reasons["prefill"]) == ("prefill-c", "holder"), r.explain()
        dropped = {"sql": SQL["sql"] | {"resident": False}}  # (no holder now: each must load it; the queue decides)
        await world.register(holding("prefill-c", "prefill", dropped, num_queued_tokens=10**6, **unmeasured))
        r = await router.route(PROMPT, 300, lora_name="sql", local=False)
        assert (r.prefill.instance_id, r.lora_reasons["prefill"]) == ("prefill-b", "load_no_holder"), r.explain()
        assert {i.instance_id for i in r.lora_loads} == {"prefill-b", "decode-a"}

    in_world(redis_server, body)


def test_prefix_hits_never_cross_adapters(redis_server):
    async def body(world):
        holder, other = holding("prefill-a", "prefill"), holding("prefill-b", "prefill")
        await world.register(holding("decode-a", "decode"), holder, other)
        hashes = hash_request_blocks(PROMPT[:160], CONTRACT, lora_key=lora_key("sql", "0123456789abcdef"))
        publisher = KVEventPublisher(world.url, "prefill-a", "inc-1", CONTRACT, _no_snapshot)
        world.publishers.append(publisher)
        await publisher.publish(KVEventBatch(1, (BlockStored(tuple(hashes), "pool"),)))
        assert (await route(world)).prefill_cached_tokens == 160
        base = await world.router(local_prefill_tokens=0).route(PROMPT, 300)
        assert base.prefill_cached_tokens == 0 and base.lora is None and not base.lora_reasons
        poet = {"poet": {"digest": "fedcba9876543210", "path": "/adapters/poet"}}
        await world.register(holding("decode-a", "decode", SQL | poet))
        r = await world.router(local_prefill_tokens=0).route(PROMPT, 300, lora_name="poet")
        assert r.prefill_cached_tokens == 0 and r.decode.instance_id == "decode-a", r.explain()

    in_world(redis_server, body)


def test_instances_with_other_files_under_the_name_are_never_chosen_and_the_counter_counts(redis_server):
    async def body(world):
        other_files = {"sql": SQL["sql"] | {"digest": "ffffffffffffffff"}}
        await world.register(holding("decode-a", "decode"), holding("decode-b", "decode", other_files),
                             holding("prefill-a", "prefill", num_queued_tokens=5000),
                             holding("prefill-b", "prefill", other_files),
                             holding("prefill-c", "prefill", other_files, num_queued_tokens=10))  # fmt: skip
        router = world.router(local_prefill_tokens=0)
        assert (await router.adapters())["sql"].digest == "ffffffffffffffff"  # (most instances list it)
        metrics = GatewayMetrics("m", "gw")
        for _ in range(3):
            r = await router.route(PROMPT, 300, lora_name="sql", local=False)
            assert (r.decode.instance_id, r.prefill.instance_id) == ("decode-b", "prefill-b"), r.explain()
            metrics.observe_route(r)
        assert "decode-a" not in r.explain() and "prefill-a" not in r.explain()
        samples = {(s.labels["target_tier"], s.labels["reason"]): s.value for s in
                   metrics.lora_decisions.collect()[0].samples if s.name.endswith("_total")}  # fmt: skip
        assert samples == {("decode", "holder"): 3, ("prefill", "holder"): 3}

    in_world(redis_server, body)


def test_a_record_listing_the_adapter_decides_whether_it_is_held_over_a_recent_load():
    """A load by this gateway moments ago makes an instance a holder until its record lists the adapter; from then
    on the record's resident flag decides (a later load past --max-cpu-loras may have dropped its weights: the
    benchmark's routing section was blind to that while every instance counted as a holder)."""
    from tandem.services.gateway.lora_routing import AdapterPlan, ClusterAdapter

    adapter = ClusterAdapter("sql", "0123456789abcdef", "/adapters/sql")
    fresh, dropped, held = holding("p-a", "prefill", {}), holding("p-b", "prefill", {"sql": SQL["sql"] | {
        "resident": False}}), holding("p-c", "prefill")  # fmt: skip
    plan = AdapterPlan(adapter, [fresh, dropped, held], loaded={"p-a", "p-b"})
    assert [plan.holds(i) for i in (fresh, dropped, held)] == [True, False, True]
    assert plan.raw_cost(dropped) == LOAD_S * RATE and plan.explain(dropped, 100).startswith(", reads it again")


def test_without_a_prefill_of_the_clusters_files_the_log_names_the_adapter_not_the_kv_format(redis_server):
    """Every prefill holds other files under the adapter's name (its files changed on disk and one tier read them):
    a long prompt is computed by the decode, and the decision log says it is the adapter, not the KV format."""
    async def body(world):
        other_files = {"sql": SQL["sql"] | {"digest": "ffffffffffffffff"}}
        await world.register(holding("decode-a", "decode"), holding("decode-b", "decode"),
                             holding("prefill-a", "prefill", other_files))  # fmt: skip
        no_prefill = ("computes the prompt itself: no prefill serves adapter sql with the cluster's files (digest "
                      "0123456789abcdef)")  # fmt: skip
        for policy in ("cache-aware", "round-robin"):
            r = await world.router(local_prefill_tokens=0, policy=policy).route(PROMPT, 300, lora_name="sql")
            assert r.prefill is None and no_prefill in r.explain() and "KV format" not in r.explain(), r.explain()
        with pytest.raises(NoInstanceError, match="no prefill serves adapter sql") as e:
            await route(world)  # (prompt logprobs need a prefill)
        assert "KV format" not in str(e.value)

    in_world(redis_server, body)


def test_a_decodes_load_is_priced_for_every_request_it_stalls(redis_server):
    """A decode reads an adapter on its step thread, so a load there holds up each request it serves: a holder with
    3 running (768 tokens) beats a non-holder with 2 (512 + 3 x 100 to load), which a load priced once (612) would
    not."""
    async def body(world):
        await world.register(holding("prefill-a", "prefill"), holding("decode-a", "decode", num_running=3),
                             holding("decode-b", "decode", {}, num_running=2))  # fmt: skip
        r = await route(world)
        assert (r.decode.instance_id, r.lora_reasons["decode"]) == ("decode-a", "holder"), r.explain()
        assert ("decode decode-b: 0 cached, 2 requests, loads it: adapter sql +300 to load (100 ms at 1000 tokens/s, "
                "x 3 requests it stalls)") in r.explain()

    in_world(redis_server, body)
