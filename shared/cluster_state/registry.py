"""Instance registry in Redis: each instance's address, tier, model id, block size, load and LoRA adapters, kept by
heartbeat.

Key per instance: tandem:instance:<tier>:<instance_id> -> JSON, with a TTL that each heartbeat renews, so a
killed instance disappears within ttl_s. Redis being down or frozen never stops serving: heartbeats log and
retry, and readers keep the last list they saw (list_instances).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
KEY_PREFIX = "tandem:instance"
REREGISTER_GRACE_S = 3.0  # (three heartbeats)
FRESH_WAIT_S = 0.25  # most a reader waits for a registry read once it has a list (0 while Redis fails)


@dataclass
class InstanceInfo:
    instance_id: str
    tier: str  # "prefill" | "decode"
    address: str  # host:port of its gRPC service
    model_id: str
    block_size: int
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0  # tokens still to compute over its requests (the router's queue estimate)
    tokens_per_s: float = 0.0  # tokens its recent steps computed per second of step time (0: not measured yet)
    # measured seconds to bring one KV block from each tier below its pool back into it ({"host": s, "disk": s};
    # a tier it lacks or has not measured is absent)
    kv_tier_load_s: dict[str, float] = field(default_factory=dict)
    kv_dtype: str = ""  # its KV cache element type (CacheConfig.kv_dtype; "": a record of an older instance)

    def can_send_kv_to(self, decode: InstanceInfo) -> bool:
        """Whether this prefill's KV blocks can move to decode: the same KV dtype and block size (the KV transfer
        refuses any other pair; a record without kv_dtype, an older instance, is taken to match), and when either
        runs several tensor-parallel ranks, a transfer both know (docs/parallelism.md): the decode lists a KV
        endpoint per rank and the prefill's record has kv_endpoints (an older prefill's has not: it sends all heads
        to rank 0)."""
        if self.block_size != decode.block_size or (self.kv_dtype and decode.kv_dtype
                                                    and self.kv_dtype != decode.kv_dtype):
            return False
        if self.tensor_parallel_size == 1 and decode.tensor_parallel_size == 1:
            return True
        return bool(self.kv_endpoints) and len(decode.kv_endpoints) == decode.tensor_parallel_size
    # new on each start of the process: its prefix-index entries (shared/cluster_state/prefix_index.py)
    incarnation: str = ""
    hash_contract: dict | None = None  # shared.block_hash.HashContract.to_dict() of its prefix cache; None: none
    # LoRA adapters loaded here (docs/lora.md): name -> {"digest": 16 hex digits of its files, "path": its PEFT
    # directory}; the router prefers instances holding a request's adapter, and loads it on another from path
    lora_adapters: dict[str, dict[str, str]] = field(default_factory=dict)
    lora_load_s: float = 0.0  # measured seconds to load an adapter here (a running mean; 0: not measured yet)
    tensor_parallel_size: int = 1  # its ranks (docs/parallelism.md); an older record: 1
    # each rank's KV endpoint, in rank order (rank 0's: address): a decode's TransferKVShard servers; a prefill
    # lists its address (a record with it knows the re-sharding transfer). An older record: none
    kv_endpoints: list[str] = field(default_factory=list)
    # where it runs (shared/utils.py machine_cpus): its machine's boot id and the CPUs it may use; "" and none: an
    # older record
    boot_id: str = ""
    cpus: list[int] = field(default_factory=list)
    published_s: float = 0.0  # time.time() when Registry.publish wrote this record (0: an older writer's)

    def shares_cpus(self, other: InstanceInfo) -> bool:
        """Whether the two run on one machine with a CPU in common (so one's work slows the other's steps); False
        for a record whose cpus is no list (a malformed one)."""
        return (bool(self.boot_id) and self.boot_id == other.boot_id and isinstance(self.cpus, list)
                and isinstance(other.cpus, list) and not set(self.cpus).isdisjoint(other.cpus))

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}:{self.tier}:{self.instance_id}"

    @classmethod
    def from_json(cls, text: str | bytes) -> InstanceInfo | None:
        """The record in text; unknown keys (a newer writer) are ignored, None (logged) when it is no record."""
        try:
            d = json.loads(text)
            return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        except (ValueError, TypeError) as e:
            log.warning("registry: skipping a malformed instance record: %s", e)
            return None


class Registry:
    def __init__(self, redis_url: str, ttl_s: float = 10.0):
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.ttl_s = ttl_s
        self._last_seen: dict[str, tuple[list[InstanceInfo], float]] = {}  # tier -> (instances, when read)
        self._healthy = True  # the last read answered
        self._reads: dict[str, tuple[asyncio.Future, float]] = {}  # tier -> (the read in flight or the last, start)

    async def publish(self, info: InstanceInfo) -> None:
        """Write info's record (published_s: now), to expire in ttl_s unless published again."""
        record = asdict(info) | {"published_s": time.time()}
        await self.redis.set(info.key, json.dumps(record), px=int(self.ttl_s * 1000))

    async def remove(self, info: InstanceInfo) -> None:
        await self.redis.delete(info.key)

    async def heartbeat(self, get_info, interval_s: float = 1.0) -> None:
        """Publish get_info() (an async callable) every interval_s until cancelled; errors are logged and the
        heartbeat goes on (an instance that stops beating disappears from routing)."""
        while True:
            try:
                await self.publish(await get_info())
            except (RedisError, OSError) as e:
                log.warning("registry heartbeat failed: %s", e)
            except Exception:
                log.exception("registry heartbeat failed")
            await asyncio.sleep(interval_s)

    async def list_instances(self, tier: str, model_id: str | None = None) -> list[InstanceInfo]:
        """Live instances of a tier (optionally only those serving model_id), sorted by instance id.

        Callers share one read of Redis at a time. Once a list was read, a caller waits at most FRESH_WAIT_S for
        the read in flight (not at all while the last read failed) and otherwise gets the last list: a frozen
        Redis (its calls time out after 2 s) must not hold up routing. On a Redis error the last list stays, and
        so it does for an empty answer within REREGISTER_GRACE_S of the last non-empty one: a Redis restarted
        without its data is empty until the next heartbeats, although every instance still serves.
        """
        read, started = self._reads.get(tier, (None, 0.0))
        if read is None or read.done():
            read, started = self._reads[tier] = asyncio.ensure_future(self._read(tier)), time.monotonic()
        if tier not in self._last_seen:
            await asyncio.shield(read)
        elif (wait_s := started + FRESH_WAIT_S * self._healthy - time.monotonic()) > 0:
            await asyncio.wait({read}, timeout=wait_s)
        infos = self._last_seen.get(tier, ([], 0.0))[0]
        return infos if model_id is None else [i for i in infos if i.model_id == model_id]

    async def _read(self, tier: str) -> None:
        """Read tier's records from Redis into _last_seen (see list_instances)."""
        try:
            keys = [k async for k in self.redis.scan_iter(match=f"{KEY_PREFIX}:{tier}:*", count=100)]
            values = await self.redis.mget(keys) if keys else []
        except (RedisError, OSError) as e:
            if self._healthy:  # (once per outage)
                log.warning("registry read failed, using the last list seen until Redis answers: %s", e)
            values = None
        if values is not None and not self._healthy:
            log.info("registry answers again")
        self._healthy = values is not None
        now = time.monotonic()
        last_infos, last_time = self._last_seen.get(tier, ([], 0.0))
        if values is None:  # (the last list stays the current one: an empty answer once Redis is back is not news)
            self._last_seen[tier] = (last_infos, now)
        else:
            parsed = (InstanceInfo.from_json(v) for v in values if v)
            infos = sorted((i for i in parsed if i is not None), key=lambda i: i.instance_id)
            if infos or now - last_time > REREGISTER_GRACE_S:
                self._last_seen[tier] = (infos, now)

    @property
    def healthy(self) -> bool:
        """Whether the last read of Redis answered (False: list_instances gives the last lists seen)."""
        return self._healthy

    async def close(self) -> None:
        await self.redis.aclose()
