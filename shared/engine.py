"""LLMEngine: one step reads top to bottom - schedule -> draft -> grammar masks -> execute_model -> save KV ->
update_from_output.

The same engine serves both tiers; the prefill -> decode KV protocol is its KVConnector (shared/kv_connector.py).
The prefill tier runs requests with max_tokens=1 and, after each forward, the connector copies out the KV of the
blocks the step completed (save_kv); the decode tier reserves blocks for a request, imports its prompt KV, then
decodes it in the running batch (continuous batching): reserve, import_kv, finish_kv_import and fail_kv_import
here admit, look up and finish the request and hand the KV part to the connector. With prefix caching
(CacheConfig enable_prefix_caching) every full computed block is published in the KV cache manager's prefix cache
after the step that completed it, and take_kv_events() hands the cache's changes out as numbered batches. With
tiers below the pool (KVTierConfig: host memory, disk; shared/kv_offload.py) evicted blocks go down to them and
come back on a hit, loaded beside the steps. With LoRA (LoRAConfig; docs/lora.md) requests name an adapter
(Request.lora_name), adapters are loaded and removed between steps (add_lora, remove_lora), and each step first puts
its adapters into the model's slots (ModelRunner.activate_loras).

Over 400 lines on purpose: this is the engine's whole surface (requests, KV import, LoRA, stats) in one class; one
step is step() through update_from_output().
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.shared.block_hash import HashContract
from tandem.shared.config import (CacheConfig, KVTierConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                  SchedulerConfig, SpeculativeConfig)
from tandem.shared.engine_stats import EngineStats, StepStats, snapshot
from tandem.shared.errors import InvalidRequestError, NoCapacityError, UnknownLoRAError, UnknownRequestError
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.kv_connector import KVBlocks, KVConnector
from tandem.shared.kv_events import KVEventBatch
from tandem.shared.kv_offload import KVOffloader
from tandem.shared.lora.manager import LoRAInfo
from tandem.shared.lora.peft import LoRAAdapter
from tandem.shared.lora.request import LoRARequest
from tandem.shared.model_runner import ModelRunner, ModelRunnerOutput
from tandem.shared.parallel.executor import TensorParallelWorkers
from tandem.shared.parallel.features import check_tensor_parallel_features
from tandem.shared.request import FinishReason, Request, RequestStatus, TokenLogprobs, check_token_ids
from tandem.shared.scheduler import Scheduler, SchedulerOutput
from tandem.shared.spec_decode.drafter import Drafter
from tandem.shared.structured_output import StructuredOutputManager, replay_grammar


@dataclass(slots=True)
class RequestOutput:
    """What one step (or a KV import) produced for one request: new tokens, the finish reason once it ends
    (with error set when the server failed it), on the prefill tier the KV blocks the step completed, and for a
    pooling request (Request.pooling_params) its pooled hidden state, with which it finishes (STOP). With
    speculative decoding: the drafts verified this step, and of those accepted (the first num_accepted_tokens
    of new_token_ids)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_is_invalid_request: bool = False  # the error is the request's fault (INVALID_ARGUMENT), not the server's
    kv: KVBlocks | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    pooled: torch.Tensor | None = None  # a pooling request's output, when it finishes: [hidden_size] fp32 (CPU)
    # with the first token, when the request asked for prompt logprobs: prompt tokens 1.. (the first has none)
    prompt_logprobs: list[TokenLogprobs] | None = None

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
        kv_events: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        kv_tier_config: KVTierConfig | None = None,
        lora_config: LoRAConfig | None = None,
        parallel_config: ParallelConfig | None = None,
    ):
        """export_kv: the prefill tier (each step returns the KV blocks it filled: KVConnector is_kv_producer).
        kv_events: record the prefix cache's changes for take_kv_events (a service publishing them to the prefix
        index); off, nothing accumulates. speculative_config: speculative decoding (None: off). kv_tier_config:
        the host and disk tiers below the pool (None or sizes 0: none; they need prefix caching). lora_config:
        serve LoRA adapters, its lora_modules loaded here (None: off; the model is left as it is). parallel_config: with
        tensor_parallel_size > 1, the other ranks' processes are started here and the model runs sharded over them
        (shared/parallel/; close() stops them); what TP does not combine with is refused by name."""
        if kv_tier_config is not None and kv_tier_config.enabled and not cache_config.enable_prefix_caching:
            raise ValueError("the KV tiers below the pool (--kv-host-tier-gib, --kv-disk-tier-dir) hold the prefix "
                             "cache's blocks: they need prefix caching (drop --no-enable-prefix-caching)")
        self.model_config = model_config
        self.tp_workers = None  # the other ranks of a tensor-parallel instance (None: this process alone)
        if parallel_config is not None and parallel_config.tensor_parallel_size > 1:
            check_tensor_parallel_features(model_config, parallel_config.tensor_parallel_size,
                                           speculative_config, kv_tier_config, lora_config, model)
            self.tp_workers = TensorParallelWorkers.start(model_config, cache_config, device, parallel_config)
        try:
            self.model_runner = ModelRunner(model_config, cache_config, device, model=model, lora_config=lora_config,
                                            tp=self.tp_workers.group if self.tp_workers is not None else None)
        except BaseException:
            self.close()
            raise
        self.lora_manager = self.model_runner.lora_manager
        self.cache_config = self.model_runner.cache_config  # the pool's size is known once the weights are loaded
        self.hash_contract = HashContract(self.cache_config.block_size, model_config.model_id,
                                          self.cache_config.kv_dtype)
        self.drafter = Drafter(speculative_config, self.model_runner) if speculative_config is not None else None
        self.offloader = None
        if kv_tier_config is not None and kv_tier_config.enabled:
            self.offloader = KVOffloader(kv_tier_config, self.model_runner.kv_caches, self.hash_contract, kv_events)
        self.kv_cache_manager = KVCacheManager(self.cache_config.num_blocks, self.cache_config.block_size,
                                               self.hash_contract if self.cache_config.enable_prefix_caching else None,
                                               record_events=kv_events, sliding_window=self._kv_window(),
                                               offloader=self.offloader)  # fmt: skip
        self.kv_event_seq = 0  # of the last KVEventBatch handed out
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_step_stats: StepStats | None = None
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, lora_config)
        self.kv_connector = KVConnector(model_config, self.model_runner, self.kv_cache_manager, self.scheduler,
                                        is_kv_producer=export_kv)
        self.requests: dict[str, Request] = {}
        self.last_step_num_tokens = 0  # 0 with work queued means stalled: nothing fits until blocks free up
        self.structured_output_manager = StructuredOutputManager(model_config.path, model_config.vocab_size,
                                                                 model_config.eos_token_ids)
        for name, path in lora_config.lora_modules if lora_config is not None else ():
            self.add_lora(LoRARequest(name, path))

    def _kv_window(self) -> int | None:
        """The sliding window past which this pool's blocks are freed early: the model's, when every layer has
        one, and no separate draft model pages its own KV by the same block tables (it computes a request's whole
        context on its first draft, blocks before the window included)."""
        if self.drafter is not None and self.drafter.draft_config is not None:
            return None
        return self.model_config.kv_window

    # -- admission -----------------------------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        max_len = self.model_config.max_model_len
        if request.num_tokens >= max_len + (request.pooling_params is not None):  # (pooled: no token follows)
            raise InvalidRequestError(f"prompt has {request.num_prompt_tokens} tokens (and output_token_ids "
                                      f"{len(request.output_token_ids)}); the model's context is {max_len}")
        if request.pooling_params is not None and (request.output_token_ids or request.sampling_params.prompt_logprobs
                                                   is not None or request.sampling_params.structured_output):
            raise InvalidRequestError("a pooling request takes no output_token_ids, prompt_logprobs or "
                                      "structured_output")  # fmt: skip
        vocab_size = self.model_config.vocab_size
        check_token_ids("prompt token ids", request.prompt_token_ids, vocab_size)
        check_token_ids("output token ids", request.output_token_ids, vocab_size)
        if len(request.output_token_ids) >= request.sampling_params.max_tokens:
            raise InvalidRequestError(f"output_token_ids has {len(request.output_token_ids)} tokens: max_tokens "
                                      f"({request.sampling_params.max_tokens}) are generated already")
        check_token_ids("stop_token_ids", request.sampling_params.stop_token_ids, vocab_size)
        check_token_ids("logit_bias token ids", (t for t, _ in request.sampling_params.logit_bias), vocab_size)
        if request.lora_name is not None and self.lora_manager is None:
            raise UnknownLoRAError(f"adapter {request.lora_name!r} is not loaded: this engine serves no LoRA adapters "
                                   "(--enable-lora)")
        if request.lora_name is not None:
            self.lora_manager.key_of(request.lora_name)  # (UnknownLoRAError naming it)
        total = min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_len)
        if self.kv_cache_manager.num_blocks_for(total) > self.cache_config.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {total} tokens of KV; this instance holds "
                f"{self.cache_config.num_blocks * self.cache_config.block_size}"
            )
        request.eos_token_ids = self.model_config.eos_token_ids
        if self.model_config.longrope_context is not None:  # (Request.rope_long)
            request.rope_long = request.num_tokens > self.model_config.longrope_context
        request.max_model_len = max_len
        request.arrival_time = time.monotonic()
        if request.sampling_params.structured_output is not None and request.grammar is None:
            # (AsyncEngine compiles it before it gets here, on another thread)
            request.grammar = self.structured_output_manager.matcher(request.sampling_params.structured_output)
        if request.grammar is not None and request.output_token_ids:
            replay_grammar(request)
        # (last: the adapter is held until _finish)
        request.lora_key = self.lora_manager.acquire(request.lora_name) if request.lora_name is not None else None
        self.requests[request.request_id] = request

    def add_request(self, request: Request) -> None:
        """Queue a request to compute from its first token. InvalidRequestError on bad input."""
        self._admit(request)
        self.scheduler.add_request(request)

    # -- the prefill -> decode KV protocol, decode tier (the KV part is the connector's) -------------------
    def reserve(self, request: Request) -> int:
        """Decode tier: admit a request whose prompt KV comes from a prefill and hold blocks for it
        (KVConnector.reserve, reusing the longest cached prefix, preempting running requests of lower priority).
        Returns the prompt tokens already cached here (a multiple of block_size): KV for them need not come.
        InvalidRequestError on bad input, NoCapacityError if the pool has no room now (with room_soon when
        requests of lower priority still waiting for their KV hold blocks: preemptible once they decode). At tensor
        parallelism each rank receives its own KV heads (KVConnector: ExpectKV to the other ranks)."""
        self._admit(request)
        try:
            return self.kv_connector.reserve(request)
        except NoCapacityError:
            del self.requests[request.request_id]
            self._release_lora(request)
            raise

    def import_kv(self, request_id: str, kv: KVBlocks) -> None:
        """Write received blocks into the request's reserved blocks (KVConnector.import_kv: kv.data
        [num_layers_in_msg, 2, n, block_size, num_kv_heads, head_dim] in the KV cache dtype). UnknownRequestError
        for an id not here; InvalidRequestError when the request is not waiting for KV or the blocks or layers
        overrun it."""
        self.kv_connector.import_kv(self._get(request_id), kv)

    def finish_kv_import(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """The prompt's KV is complete and the prefill sampled first_token_id: join the running batch.

        Returns a finished RequestOutput if that first token already ends the request, else None.
        UnknownRequestError for an id not here; InvalidRequestError when the request is not waiting for KV, the
        token is outside the vocabulary or its structured_output, or some layer of a block it lacked never
        arrived (KVConnector.finish_kv_import; the caller then fails the import).
        """
        request = self._get(request_id)
        self.kv_connector.finish_kv_import(request, first_token_id)
        request.arrival_time = time.monotonic()  # (its queue time: from joining the batch, not from the reserve)
        reason = request.append_output_token(first_token_id)
        if reason is not None:
            return self._finish(request, reason, RequestOutput(request_id, []))
        self.scheduler.add_request(request)
        return None

    def fail_kv_import(self, request_id: str, error: str) -> RequestOutput | None:
        """A KV transfer broke: fail the request if it is still waiting for its KV (blocks freed) and return its
        finished output; a request already decoding (this was a stray repeat) or gone is left alone (None)."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_KV:
            return None
        return self._finish(request, FinishReason.ABORT, RequestOutput(request_id, []), error)

    # -- ending requests -----------------------------------------------------------------------------------
    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once. False if it was not here (already finished)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT, RequestOutput(request_id, []))
        return True

    def _get(self, request_id: str) -> Request:
        if request_id not in self.requests:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        return self.requests[request_id]

    def _finish(self, request: Request, reason: FinishReason, out: RequestOutput, error: str | None = None):
        """End a request: take it out of the scheduler, free its blocks, record the reason on out (returned)."""
        self.scheduler.remove_request(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._release_lora(request)
        self.kv_connector.request_finished(request)
        if self.drafter is not None:
            self.drafter.request_finished(request)
        out.finish_reason, out.error = reason, error
        return out

    # -- the step ------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One step: schedule -> draft -> grammar masks -> execute_model -> save KV (prefill tier) ->
        update_from_output. Returns one RequestOutput per request with new tokens, a finish or saved KV blocks;
        its StepStats go to last_step_stats."""
        start, start_wall = time.perf_counter(), time.monotonic()
        self.last_step_stats = None
        scheduler_output, queue_times = self._schedule(start_wall)
        lora_errors = self.model_runner.activate_loras(scheduler_output)
        if not scheduler_output.scheduled_requests and self.kv_cache_manager.has_tier_loads:
            self.offloader.wait_for_load(0.01)  # (nothing to compute until a prefix is loaded: no spinning)
        self._draft(scheduler_output)
        scheduler_output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
            scheduler_output.constrained_samples())
        model_output = self.model_runner.execute_model(scheduler_output, self.kv_cache_manager.block_tables)
        kv_blocks = self.kv_connector.save_kv(scheduler_output)
        outputs = self.update_from_output(scheduler_output, model_output, kv_blocks, lora_errors)
        self._record_step(scheduler_output, outputs, time.perf_counter() - start, queue_times)
        return outputs

    def _schedule(self, start_wall: float) -> tuple[SchedulerOutput, list[float]]:
        """Propose drafts for the running requests (speculative decoding), then the scheduler's decision. Returns
        it and the queue times (seconds from admission; start_wall is the step's time.monotonic()) of the requests
        it schedules for the first time."""
        if self.drafter is not None:
            self.drafter.propose_drafts(self.scheduler.running, self.model_config.max_model_len)
        scheduler_output = self.scheduler.schedule()
        queue_times = []
        for request in scheduler_output.scheduled_requests:
            if request.queue_time_s is None:
                request.queue_time_s = start_wall - request.arrival_time
                queue_times.append(request.queue_time_s)
        return scheduler_output, queue_times

    def _draft(self, scheduler_output: SchedulerOutput) -> None:
        """With a draft model: fill in the drafts of the requests scheduled (placeholders until now)."""
        if self.drafter is not None:
            self.drafter.draft(scheduler_output, self.kv_cache_manager.block_tables)

    def _record_step(self, scheduler_output: SchedulerOutput, outputs: list[RequestOutput], duration: float,
                     queue_times: list[float]) -> None:
        """The step's StepStats to last_step_stats (duration in seconds), and its timing to adaptive speculation."""
        if self.drafter is not None:
            self.drafter.observe_step(scheduler_output, sum(len(o.new_token_ids) for o in outputs), duration)
        self.last_step_stats = StepStats(duration, len(scheduler_output.scheduled_requests),
                                         scheduler_output.total_num_scheduled_tokens, queue_times)  # fmt: skip

    def update_from_output(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput,
                           kv_blocks: dict[str, KVBlocks], lora_errors: dict[str, str] | None = None
                           ) -> list[RequestOutput]:
        """Advance num_computed_tokens, append sampled tokens, finish requests that stop (freeing their blocks).
        lora_errors: adapter key -> why it could not be put in a slot (activate_loras): its requests fail.

        Returns one RequestOutput per request with new tokens, a finish or exported blocks.
        """
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        outputs = []
        for request in scheduler_output.scheduled_requests:
            request_id = request.request_id
            num_scheduled = scheduler_output.num_scheduled_tokens[request_id]
            self.num_prompt_tokens += max(0, min(request.num_computed_tokens + num_scheduled, request.num_prompt_tokens)
                                          - request.num_computed_tokens)  # fmt: skip
            request.num_computed_tokens += num_scheduled
            out = RequestOutput(request_id, [], kv=kv_blocks.get(request_id))
            if request_id in model_output.non_finite_request_ids:  # (its KV is not published)
                self._finish(request, FinishReason.ABORT, out, error="the model produced non-finite logits")
                outputs.append(out)
                continue
            if lora_errors and request.lora_key in lora_errors:  # (computed without its adapter: nothing kept)
                request.num_computed_tokens -= num_scheduled
                out.kv = None
                self._finish(request, FinishReason.ABORT, out, error=lora_errors[request.lora_key])
                outputs.append(out)
                continue
            request.prompt_logprobs += model_output.prompt_logprobs.get(request_id, ())
            token_ids = model_output.sampled_token_ids.get(request_id, ())
            if token_ids and not request.output_token_ids and request.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs = request.prompt_logprobs
            reason = None
            if request_id in model_output.pooled:  # a pooling request's last token is computed: it is done
                out.pooled, reason = model_output.pooled[request_id], FinishReason.STOP
            try:
                for token_id in token_ids:
                    out.new_token_ids.append(token_id)
                    reason = request.append_output_token(token_id)
                    if reason is not None:
                        break
            except ValueError as e:  # its grammar failed (llguidance's limits on a huge grammar): it alone fails
                out.new_token_ids.clear()
                out.error_is_invalid_request = True
                self._finish(request, FinishReason.ABORT, out, error=f"structured_output failed: {e}".split("\n")[0])
                outputs.append(out)
                continue
            self.num_generation_tokens += len(out.new_token_ids)
            if request_id in model_output.logprobs:
                out.logprobs = model_output.logprobs[request_id][: len(out.new_token_ids)]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                # accepted: the drafts emitted (a stop inside the run cuts it)
                out.num_draft_tokens = len(drafts)
                out.num_accepted_tokens = min(len(token_ids) - 1, len(out.new_token_ids))
                self.drafter.record(request, out.num_draft_tokens, out.num_accepted_tokens)
                # KV holds up to the last accepted draft; the token after it (and anything past a stop) has none
                request.num_computed_tokens = min(request.num_computed_tokens - len(drafts) + len(token_ids) - 1,
                                                  request.num_tokens - 1)  # fmt: skip
            self.kv_cache_manager.cache_full_blocks(request)
            if reason is None and request.rope_long is False and \
                    request.num_tokens > self.model_config.longrope_context:
                # longrope: past the original context every position takes the long factors: compute it all again
                # (HF's Phi-3 drops its cache at this token); its short KV stays cached under the short variant
                request.rope_long = True
                self.scheduler.preempt(request)
            if reason is not None:
                self._finish(request, reason, out)
            else:
                self.kv_cache_manager.free_out_of_window_blocks(request)
                if drafts:
                    self.kv_cache_manager.free_excess_blocks(request)  # blocks only rejected drafts needed
            if out.new_token_ids or out.finished or out.kv is not None:
                outputs.append(out)
        return outputs

    # -- LoRA adapters -------------------------------------------------------------------------------------
    def _lora_manager(self, name: str):
        if self.lora_manager is None:
            raise InvalidRequestError(f"adapter {name!r}: this engine serves no LoRA adapters (--enable-lora)")
        return self.lora_manager

    def read_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter's PEFT directory for this model (shared/lora/peft.py), without loading it:
        safe on any thread, so a service can read it beside the steps. InvalidRequestError naming the adapter."""
        return self._lora_manager(lora_request.lora_name).read(lora_request)

    def add_lora(self, lora: LoRARequest | LoRAAdapter) -> bool:
        """Serve an adapter (a LoRARequest is read first: read_lora) under its name, from the next step on. False if
        the name already serves these very files; InvalidRequestError naming the adapter if it serves others (remove
        it first), the directory is refused, or LoRA is off."""
        adapter = self.read_lora(lora) if isinstance(lora, LoRARequest) else lora
        return self._lora_manager(adapter.name).add(adapter)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter: requests naming it are refused from now on; those admitted before go on with it
        to their end (as vLLM lets them finish). UnknownLoRAError naming it if it is not loaded."""
        if self.lora_manager is None:
            raise UnknownLoRAError(f"adapter {name!r} is not loaded: this engine serves no LoRA adapters")
        self.lora_manager.remove(name)

    def list_loras(self) -> list[LoRAInfo]:
        """The adapters loaded, by name ([] with LoRA off)."""
        return self.lora_manager.list() if self.lora_manager is not None else []

    def _release_lora(self, request: Request) -> None:
        if request.lora_key is not None:
            self.lora_manager.release(request.lora_key)

    # -- introspection -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    def take_kv_events(self) -> KVEventBatch | None:
        """The prefix cache's changes since the last call as the next numbered batch, or None if none."""
        events = self.kv_cache_manager.block_pool.take_events()
        if not events:
            return None
        self.kv_event_seq += 1
        return KVEventBatch(self.kv_event_seq, tuple(events))

    def stats(self) -> EngineStats:
        """A snapshot of this engine's load and counters (engine_stats.snapshot)."""
        return snapshot(self)

    def close(self) -> None:
        """A clean stop: the pool's and host tier's cached blocks are written to the disk tier, if there is one (so a
        restart finds them), then the tiers' threads stop (their writes finished first)."""
        if self.tp_workers is not None:
            self.tp_workers.close()
        if getattr(self, "offloader", None) is not None:
            self.offloader.save_to_disk(self.kv_cache_manager.block_pool.cached_blocks_coldest_first())
            self.offloader.close()
