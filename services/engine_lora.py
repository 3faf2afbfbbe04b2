"""An engine service's LoRA adapters (docs/lora.md): the Instance RPCs that load, unload and list them at run time
(the engine does the work: AsyncEngine.add_lora, remove_lora, list_loras), and what the instance's registry record
says of them for the gateway's router: each adapter's name, digest and directory, whether its weights are in memory
now, and the seconds a load takes here (InstanceInfo.lora_adapters, lora_load_s).

The load time is measured, a running mean: each LoadLoRAAdapter call that reads an adapter, and at start a probe
reading one of the adapters --lora-modules loaded (the engine loads those before serving, unmeasured). An adapter
read again from disk after the engine dropped its weights (--max-cpu-loras) costs about the same read.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from tandem.services.metrics import STATS_REFRESH_S
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.cluster_state.registry import InstanceInfo
from tandem.shared.errors import InvalidRequestError
from tandem.shared.lora.peft import LoRAAdapter
from tandem.shared.lora.request import LoRARequest
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
LOAD_TIME_WEIGHT = 0.5  # weight of the newest load in the running mean of lora_load_s


class EngineLoRA:
    """The adapters of one engine service; refresh() keeps the record's view current (run it as a task)."""

    def __init__(self, engine: AsyncEngine, read_lora: Callable[[LoRARequest], LoRAAdapter]):
        """read_lora: the engine's LLMEngine.read_lora (reads and checks a directory without loading it; any
        thread)."""
        self.engine, self.read_lora = engine, read_lora
        self.adapters: list = []  # the engine's last list_loras() (LoRAInfo)
        self.load_s = 0.0  # measured seconds per load (0: none yet)

    async def start(self) -> None:
        """Read the adapters loaded at start, and time reading one of them again (the first load-time sample: adding
        an adapter under its own name again reads its directory and changes nothing)."""
        self.adapters = await self.engine.list_loras()
        if self.adapters:
            first = self.adapters[0]
            started = time.perf_counter()
            await self.engine.add_lora(LoRARequest(first.name, first.path))
            self._measured(time.perf_counter() - started)
            log.info("LoRA adapters loaded at start: %s; reading one takes %.0f ms here",
                     ", ".join(a.name for a in self.adapters), self.load_s * 1e3)  # fmt: skip

    async def refresh(self) -> None:
        """Keep self.adapters at most STATS_REFRESH_S old (which adapters' weights are in memory changes with the
        requests that come)."""
        while True:
            await asyncio.sleep(STATS_REFRESH_S)
            self.adapters = await self.engine.list_loras()

    def record(self, info: InstanceInfo) -> InstanceInfo:
        """info with this instance's adapters and measured load time."""
        info.lora_adapters = {a.name: {"digest": a.digest, "path": a.path, "resident": a.resident}
                              for a in self.adapters}  # fmt: skip
        info.lora_load_s = round(self.load_s, 4)
        return info

    async def load(self, request: common_pb2.LoadLoRAAdapterRequest) -> common_pb2.LoadLoRAAdapterResponse:
        """Instance.LoadLoRAAdapter. InvalidRequestError naming the adapter and what is wrong; with expected_digest,
        also when the directory's files have another digest (they changed since the cluster loaded them), and then
        nothing is loaded here."""
        expected = request.expected_digest if request.HasField("expected_digest") else None
        started = time.perf_counter()
        read = await asyncio.to_thread(self.read_lora, LoRARequest(request.lora_name, request.lora_path))
        if expected is not None:  # (files of another digest must never serve, not even a moment)
            self._check_digest(read, expected)
        added = await self.engine.add_lora(read)
        elapsed = time.perf_counter() - started
        self.adapters = await self.engine.list_loras()
        adapter = next(a for a in self.adapters if a.name == request.lora_name)
        self._measured(elapsed)  # (the same files again were read again, too: a load's cost either way)
        if added:
            log.info("LoRA adapter %s (digest %s, rank %d) loaded from %s in %.0f ms", adapter.name, adapter.digest,
                     adapter.rank, adapter.path, elapsed * 1e3)  # fmt: skip
        return common_pb2.LoadLoRAAdapterResponse(adapter=_info(adapter), load_ms=elapsed * 1e3 if added else 0.0)

    async def unload(self, request: common_pb2.UnloadLoRAAdapterRequest) -> common_pb2.UnloadLoRAAdapterResponse:
        """Instance.UnloadLoRAAdapter. UnknownLoRAError (NOT_FOUND) for a name not loaded here."""
        await self.engine.remove_lora(request.lora_name)
        self.adapters = await self.engine.list_loras()
        log.info("LoRA adapter %s unloaded", request.lora_name)
        return common_pb2.UnloadLoRAAdapterResponse()

    async def list(self) -> common_pb2.ListLoRAAdaptersResponse:
        """Instance.ListLoRAAdapters."""
        self.adapters = await self.engine.list_loras()
        return common_pb2.ListLoRAAdaptersResponse(adapters=[_info(a) for a in self.adapters])

    @staticmethod
    def _check_digest(adapter, expected: str) -> None:
        if adapter.digest != expected:
            raise InvalidRequestError(f"adapter {adapter.name!r}: the files at {adapter.path} have digest "
                                      f"{adapter.digest}, not the expected {expected} (they changed on disk since "
                                      "the cluster loaded them); not loaded")  # fmt: skip

    def _measured(self, seconds: float) -> None:
        self.load_s = seconds if not self.load_s else (1 - LOAD_TIME_WEIGHT) * self.load_s + LOAD_TIME_WEIGHT * seconds


def _info(adapter) -> common_pb2.LoRAAdapterInfo:
    return common_pb2.LoRAAdapterInfo(name=adapter.name, path=adapter.path, digest=adapter.digest, rank=adapter.rank)
