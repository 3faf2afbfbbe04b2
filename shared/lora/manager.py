"""LoRAManager: the adapters an engine serves, at three levels (vLLM's LoRA model manager and its CPU cache):

- loaded: name -> adapter (its identity LoRAAdapter.key = name:digest), any number; add and remove at run time.
  Requests hold a reference to their adapter's key from admission to their end (acquire / release).
- in memory: the weights of at most max_cpu_loras adapters, least recently used dropped first; an adapter needed
  again is read from its directory again, and refused if its files changed since it was loaded (its digest).
- in slots: each LoRA-wrapped linear's stacked weights for max_loras adapters. activate() puts the step's adapters
  (the scheduler admits at most max_loras per step) into slots: those already there stay, the others take the
  slots of adapters the step does not use, least recently used first.

Removing an adapter takes its name away at once (new requests naming it are refused) while requests admitted
before go on with it to their end (as vLLM lets them finish); its record goes with the last of them. Engine
thread only, except read(), which reads and checks a directory and may run on any thread.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tandem.shared.config import LoRAConfig, ModelConfig, torch_dtype
from tandem.shared.errors import InvalidRequestError, UnknownLoRAError
from tandem.shared.lora.layers import LoRALinear, wrap_lora_linears
from tandem.shared.lora.peft import LoRAAdapter, read_lora_adapter
from tandem.shared.lora.request import LoRARequest
from tandem.shared.lora.targets import lora_targets

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAInfo:
    """A loaded adapter as list_loras reports it: name, directory, digest of its files, largest rank, the requests
    using it now, and whether its weights are in memory (else a request reads them from disk first)."""

    name: str
    path: str
    digest: str
    rank: int
    num_requests: int
    resident: bool


@dataclass(slots=True)
class _Record:
    request: LoRARequest
    digest: str
    rank: int
    num_requests: int = 0
    loaded: bool = True  # False: removed, kept while requests admitted before use it


class LoRAManager:
    """Wraps model's linears (shared/lora/layers.py) and keeps its adapters. device: the model's."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, model: torch.nn.Module,
                 device: torch.device | str):
        self.config = config
        self.dtype = torch_dtype(model_config.dtype)
        self.targets = lora_targets(model_config)
        self.layers: dict[str, LoRALinear] = wrap_lora_linears(model, self.targets, config.max_loras,
                                                               config.max_lora_rank, self.dtype, device)
        self.records: dict[str, _Record] = {}  # adapter key -> record
        self.names: dict[str, str] = {}  # loaded name -> adapter key
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> weights, least recently used first
        self.slots: list[str | None] = [None] * config.max_loras  # slot -> the adapter key in it
        self.slot_used: list[int] = [0] * config.max_loras  # slot -> the activation that last used it
        self.num_activations = 0

    # -- loaded adapters -----------------------------------------------------------------------------------
    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check request's directory for this model (shared/lora/peft.py; any thread)."""
        return read_lora_adapter(request, self.targets, self.config.max_lora_rank, self.dtype)

    def add(self, adapter: LoRAAdapter) -> bool:
        """Serve adapter under its name. False if that name already serves these very files (nothing changes);
        InvalidRequestError if it serves others (remove it first)."""
        key = self.names.get(adapter.name)
        if key == adapter.key:
            return False
        if key is not None:
            raise InvalidRequestError(f"adapter {adapter.name!r} is already loaded, from other files "
                                      f"({self.records[key].request.lora_path}): unload it first")
        record = self.records.get(adapter.key)
        if record is None:
            record = self.records[adapter.key] = _Record(LoRARequest(adapter.name, adapter.path), adapter.digest,
                                                         adapter.rank)
        record.loaded = True
        self.names[adapter.name] = adapter.key
        self._keep(adapter)
        return True

    def remove(self, name: str) -> None:
        """Stop serving name (the module's docstring says what happens to its requests). UnknownLoRAError if no
        adapter has that name."""
        key = self.names.pop(name, None)
        if key is None:
            raise UnknownLoRAError(f"adapter {name!r} is not loaded")
        self.records[key].loaded = False
        self._forget_if_unused(key)

    def list(self) -> list[LoRAInfo]:
        """The loaded adapters, by name."""
        infos = []
        for name, key in sorted(self.names.items()):
            r = self.records[key]
            infos.append(LoRAInfo(name, r.request.lora_path, r.digest, r.rank, r.num_requests, key in self.resident))
        return infos

    def key_of(self, name: str) -> str:
        """The key of the adapter loaded as name. UnknownLoRAError naming it if none is."""
        key = self.names.get(name)
        if key is None:
            raise UnknownLoRAError(f"adapter {name!r} is not loaded")
        return key

    def acquire(self, name: str) -> str:
        """A request admitted with adapter name holds it until release(); returns its key. UnknownLoRAError."""
        key = self.key_of(name)
        self.records[key].num_requests += 1
        return key

    def release(self, key: str) -> None:
        record = self.records[key]
        record.num_requests -= 1
        self._forget_if_unused(key)

    def _forget_if_unused(self, key: str) -> None:
        record = self.records[key]
        if record.loaded or record.num_requests > 0:
            return
        del self.records[key]
        self.resident.pop(key, None)
        if key in self.slots:
            self.slots[self.slots.index(key)] = None

    # -- memory and slots ----------------------------------------------------------------------------------
    def _keep(self, adapter: LoRAAdapter) -> None:
        """Hold adapter's weights in memory, dropping the least recently used beyond max_cpu_loras."""
        self.resident[adapter.key] = adapter
        self.resident.move_to_end(adapter.key)
        while len(self.resident) > self.config.max_cpu_loras:
            self.resident.popitem(last=False)

    def _weights(self, key: str) -> LoRAAdapter:
        """The adapter of key in memory, read from its directory again if it was dropped. InvalidRequestError
        (or OSError) if that fails or its files changed since it was loaded."""
        adapter = self.resident.get(key)
        if adapter is None:
            record = self.records[key]
            adapter = self.read(record.request)
            if adapter.digest != record.digest:
                raise InvalidRequestError(f"adapter {record.request.lora_name!r}: its files in "
                                          f"{record.request.lora_path} changed since it was loaded (digest "
                                          f"{record.digest}, now {adapter.digest}); load it again")
        self._keep(adapter)
        return adapter

    def activate(self, keys: list[str]) -> tuple[dict[str, int], dict[str, str]]:
        """Put the adapters of keys (at most max_loras distinct ones: the scheduler's limit) into slots.

        Returns ({key: slot}, {key: error} for adapters that could not be read again from disk: their requests must
        fail; each such adapter is unloaded, so that no new request takes it)."""
        wanted = list(dict.fromkeys(keys))
        assert len(wanted) <= len(self.slots), "the scheduler admits at most max_loras adapters a step"
        self.num_activations += 1
        slot_of = {key: self.slots.index(key) for key in wanted if key in self.slots}
        free = sorted((i for i in range(len(self.slots)) if self.slots[i] not in slot_of),
                      key=lambda i: (self.slots[i] is not None, self.slot_used[i]))
        failed = {}
        for key in wanted:
            if key in slot_of:
                continue
            try:
                adapter = self._weights(key)
            except (OSError, ValueError) as e:
                failed[key] = str(e)
                self._unload_broken(key)
                continue
            slot = slot_of[key] = free.pop(0)
            for name, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(name))
            self.slots[slot] = key
        for slot in slot_of.values():
            self.slot_used[slot] = self.num_activations
        return slot_of, failed

    def _unload_broken(self, key: str) -> None:
        record = self.records[key]
        log.error("adapter %s could not be read again from %s: unloaded", record.request.lora_name,
                  record.request.lora_path)
        if self.names.get(record.request.lora_name) == key:
            del self.names[record.request.lora_name]
        record.loaded = False
