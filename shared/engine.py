"""LLMEngine: one step reads top to bottom - schedule -> run the model -> update requests.

The same engine serves both tiers. The prefill tier runs requests with max_tokens=1 and exports the KV of the
blocks each step completes; the decode tier reserves blocks for a request, imports its prompt KV, then decodes
it in the running batch (continuous batching).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import CacheConfig, ModelConfig, SchedulerConfig
from shared.kv_cache_manager import KVCacheManager
from shared.model_runner import ModelRunner
from shared.request import FinishReason, Request, RequestStatus
from shared.scheduler import Scheduler


@dataclass(slots=True)
class KVBlocks:
    """Consecutive logical blocks of one request for layers layer_start.. (all layers when exported).

    data [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in the KV cache dtype.
    """

    first_block_index: int
    data: torch.Tensor
    layer_start: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv: KVBlocks | None = None  # prefill tier: blocks completed by this step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: str = "cpu",
        export_kv: bool = False,
        model=None,
    ):
        self.model_config = model_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.model_runner = ModelRunner(model_config, cache_config, device, model=model)
        self.export_kv = export_kv
        self.requests: dict[str, Request] = {}
        self.last_step_num_tokens = 0  # 0 with work queued means stalled: nothing fits until blocks free up

    # -- admission -----------------------------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError("prompt is empty")
        max_len = self.model_config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; the model's context is {max_len}")
        if any(not 0 <= t < self.model_config.vocab_size for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        total = min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_len)
        if self.kv_cache_manager.num_blocks_for(total) > self.cache_config.num_blocks:
            raise ValueError(
                f"request needs up to {total} tokens of KV; this instance holds "
                f"{self.cache_config.num_blocks * self.cache_config.block_size}"
            )
        request.eos_token_ids = self.model_config.eos_token_ids
        request.max_model_len = max_len
        self.requests[request.request_id] = request

    def add_request(self, request: Request) -> None:
        """Queue a request to compute from its first token. Raises ValueError on bad input."""
        self._admit(request)
        self.scheduler.add_request(request)

    def reserve(self, request: Request) -> None:
        """Decode tier: hold blocks for the prompt, to be filled by import_kv. MemoryError if the pool is full."""
        self._admit(request)
        if not self.kv_cache_manager.allocate_slots(request, request.num_prompt_tokens):
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]
            raise MemoryError(f"no room for {request.num_prompt_tokens} prompt tokens of KV")
        request.status = RequestStatus.WAITING_FOR_KV

    def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        """Write received blocks into the pool at the request's reserved block ids."""
        request = self._get(request_id)
        if request.status != RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        block_table = self.kv_cache_manager.get_block_table(request_id)
        n = kv.data.shape[2]
        if kv.first_block_index + n > len(block_table):
            raise ValueError(f"KV blocks {kv.first_block_index}..{kv.first_block_index + n} exceed the prompt")
        device = self.model_runner.device
        ids = torch.tensor(block_table[kv.first_block_index : kv.first_block_index + n], device=device)
        layers = self.model_runner.kv_caches[kv.layer_start : kv.layer_start + kv.data.shape[0]]
        layers.index_copy_(2, ids, kv.data.to(device))

    def finish_kv_import(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """The prompt's KV is complete and the prefill sampled first_token_id: join the running batch.

        Returns a finished RequestOutput if that first token already ends the request, else None.
        """
        request = self._get(request_id)
        if request.status != RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV (its KV was completed already)")
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} is outside the vocabulary")
        request.num_computed_tokens = request.num_prompt_tokens
        reason = request.append_output_token(first_token_id)
        if reason is not None:
            return self._finish(request, reason, [])
        self.scheduler.add_request(request)
        return None

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once. False if it was not here (already finished)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.remove_request(request)
        self._finish(request, FinishReason.ABORT, [])
        return True

    def _get(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise KeyError(f"unknown request {request_id!r}")
        return self.requests[request_id]

    def _finish(self, request: Request, reason: FinishReason, new_tokens: list[int], error=None) -> RequestOutput:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        return RequestOutput(request.request_id, new_tokens, reason, error)

    # -- the step ------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        if not scheduler_output.scheduled_requests:
            return []
        sampled = self.model_runner.execute_model(scheduler_output, self.kv_cache_manager.block_tables)
        outputs = []
        for request in scheduler_output.scheduled_requests:
            prev = request.num_computed_tokens
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[request.request_id]
            kv = self._export(request, prev, request.request_id in sampled) if self.export_kv else None
            if request.request_id not in sampled:
                if kv is not None:
                    outputs.append(RequestOutput(request.request_id, [], kv=kv))
                continue
            token_id = sampled[request.request_id]
            if token_id is None:
                self.scheduler.remove_request(request)
                out = self._finish(request, FinishReason.ABORT, [], error="the model produced non-finite logits")
            else:
                reason = request.append_output_token(token_id)
                if reason is not None:
                    self.scheduler.remove_request(request)
                    out = self._finish(request, reason, [token_id])
                else:
                    out = RequestOutput(request.request_id, [token_id])
            out.kv = kv
            outputs.append(out)
        return outputs

    def _export(self, request: Request, prev_computed: int, prompt_done: bool) -> KVBlocks | None:
        """Copy the blocks this step completed (and the partial last block once the prompt is done)."""
        block_size = self.cache_config.block_size
        first = prev_computed // block_size
        end = -(-request.num_computed_tokens // block_size) if prompt_done else request.num_computed_tokens // block_size
        if end <= first:
            return None
        block_ids = self.kv_cache_manager.get_block_table(request.request_id)[first:end]
        ids = torch.tensor(block_ids, device=self.model_runner.device)
        return KVBlocks(first, self.model_runner.kv_caches.index_select(2, ids))

    # -- introspection -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks
