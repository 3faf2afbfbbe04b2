"""The registry and prefix index a gateway's Router reads, on a real redis-server, written through the engines' own
classes: record factories and a World for the routing tests (test_router.py, test_session_affinity.py)."""
import asyncio

from tandem.services.gateway.router import Router
from tandem.shared.block_hash import HashContract, hash_request_blocks
from tandem.shared.cluster_state.prefix_index import KVEventPublisher, PrefixIndex
from tandem.shared.cluster_state.registry import InstanceInfo, Registry
from tandem.shared.kv_events import BlockStored, KVEventBatch

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
