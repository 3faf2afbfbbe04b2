"""A decode yields its CPUs to a backed-up prefill that shares them (services/engine_main.py _yield_to_prefill), on
a real redis-server: prefill records as engines publish them decide the decode's step interval; and the records'
machine identity (shared/utils.py machine_cpus, InstanceInfo.shares_cpus); a record no longer published (its prefill
died) is nothing to yield to."""
import asyncio
import json
import os
import time
import types
from dataclasses import asdict

from tandem.services import engine_main
from tandem.shared.cluster_state import cancel_and_wait
from tandem.shared.cluster_state.registry import InstanceInfo, Registry
from tandem.shared.utils import machine_cpus

BOOT_ID, OTHER_BOOT_ID = "boot-a", "boot-b"


def record(iid: str, tier: str, boot_id: str = BOOT_ID, cpus=(0, 1), **load) -> InstanceInfo:
    return InstanceInfo(iid, tier, "127.0.0.1:1", "m", 16, boot_id=boot_id, cpus=list(cpus), **load)


def test_instances_share_cpus_on_one_machine_with_a_cpu_in_common():
    decode = record("d", "decode")
    assert decode.shares_cpus(record("p", "prefill", cpus=(1, 2)))
    assert not decode.shares_cpus(record("p", "prefill", cpus=(2, 3)))  # (cpusets apart)
    assert not decode.shares_cpus(record("p", "prefill", boot_id=OTHER_BOOT_ID))
    assert not record("d", "decode", boot_id="").shares_cpus(record("p", "prefill", boot_id=""))  # (older records)
    boot_id, cpus = machine_cpus()
    assert boot_id and cpus == sorted(os.sched_getaffinity(0))
    assert machine_cpus(boot_id_file="/nonexistent")[0] == ""


async def _interval_after(registry: Registry, engine, prefills: list[InstanceInfo]) -> float:
    """Publish these prefill records (dropping the others), then the decode's step interval once it has read them."""
    for info in await registry.list_instances("prefill"):
        await registry.remove(info)
    for info in prefills:
        await registry.publish(info)
    await asyncio.sleep(0.6)  # (a few reads of the records)
    return engine.step_interval_s


async def _after_a_prefill_stops_beating(registry: Registry, engine, info: InstanceInfo) -> float:
    """The decode's step interval once info's record (backed up) was last published YIELD_STALE_S ago and more: a
    prefill killed within its record's TTL."""
    record = asdict(info) | {"published_s": time.time() - engine_main.YIELD_STALE_S - 0.5}
    await registry.redis.set(info.key, json.dumps(record), px=int(registry.ttl_s * 1000))
    await asyncio.sleep(0.6)
    return engine.step_interval_s


async def _after_redis_stops(engine, stop_redis) -> float:
    """The decode's step interval once Redis has been down for a few reads (its last list says: backed up)."""
    await asyncio.get_running_loop().run_in_executor(None, stop_redis)
    await asyncio.sleep(2.5)  # (a read times out after 2 s)
    return engine.step_interval_s


async def scenario(url: str, stop_redis) -> list[float]:
    registry = Registry(url)
    engine = types.SimpleNamespace(step_interval_s=0.0)  # (the one attribute _yield_to_prefill sets)
    task = asyncio.create_task(engine_main._yield_to_prefill(registry, record("d", "decode"), engine, 0.08))
    try:
        measured = {"tokens_per_s": 1000.0}
        intervals = [await _interval_after(registry, engine, prefills) for prefills in (
            [record("p1", "prefill", num_queued_tokens=5000, **measured)],  # 5 s queued, same CPUs: yield
            [record("p1", "prefill", num_queued_tokens=500, **measured)],  # 0.5 s: full speed
            [record("p1", "prefill", num_queued_tokens=5000, boot_id=OTHER_BOOT_ID, **measured)],  # another machine
            [record("p1", "prefill", num_queued_tokens=5000)],  # no rate measured yet
            [record("p1", "prefill", num_queued_tokens=500, **measured),  # one of two backed up
             record("p2", "prefill", num_queued_tokens=9000, cpus=(1,), **measured)],
            [record("p2", "prefill", num_queued_tokens=0, cpus=(1,), **measured)],  # its queue gone
            [record("p1", "prefill", num_queued_tokens=5000, **measured)])]  # fmt: skip
        backed_up = record("p1", "prefill", num_queued_tokens=5000, **measured)
        intervals += [await _after_a_prefill_stops_beating(registry, engine, backed_up),
                      await _interval_after(registry, engine, [backed_up])]  # (it beats again)
        return intervals + [await _after_redis_stops(engine, stop_redis)]
    finally:
        await cancel_and_wait(task)
        await registry.close()


def test_a_decode_spaces_its_steps_only_while_a_prefill_on_its_cpus_is_backed_up(redis_server, monkeypatch):
    monkeypatch.setattr(engine_main, "YIELD_CHECK_S", 0.05)
    # then: backed up again; its record not published for YIELD_STALE_S (killed): full speed; it beats again;
    # Redis stops (its last list still says backed up): full speed
    assert asyncio.run(scenario(redis_server.url, redis_server.stop)) == [0.08, 0.0, 0.0, 0.0, 0.08, 0.0, 0.08, 0.0,
                                                                          0.08, 0.0]
