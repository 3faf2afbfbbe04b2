"""Session affinity in the gateway's Router (services/gateway/session_affinity.py) on a real redis-server: a
session's pair kept within the load bound, left when an instance is gone, restarted, down, skipped or full; the
session table's LRU bound and TTL."""
import asyncio

from tandem.services.gateway.router import Router
from tests.integration.routing_world import CACHED, PROMPT, instance, in_world


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
