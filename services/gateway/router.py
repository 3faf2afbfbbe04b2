"""Round-robin routing over the instances registered in Redis for the gateway's model.

Cache-aware routing (longest cached prefix traded against queue depth) replaces pick() later; the interface
stays: pick a prefill and a decode instance for a prompt.
"""
from __future__ import annotations

import itertools

from shared.errors import NoInstanceError
from shared.registry import InstanceInfo, Registry


class RoundRobinRouter:
    def __init__(self, registry: Registry, model_id: str):
        self.registry = registry
        self.model_id = model_id
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    async def pick(self, tier: str, num_tokens: int = 0, skip: set[str] = frozenset()) -> InstanceInfo:
        """Next instance of the tier in turn, leaving out instance ids in skip; instances without free blocks
        for num_tokens are passed over while another has room. NoInstanceError when none is left."""
        instances = [i for i in await self.registry.list_instances(tier, self.model_id) if i.instance_id not in skip]
        if not instances:
            raise NoInstanceError(f"no live {tier} instance is registered for model {self.model_id}")
        roomy = [i for i in instances if i.num_free_blocks * i.block_size >= num_tokens]
        candidates = roomy or instances
        return candidates[next(self._counters[tier]) % len(candidates)]
