"""One scheduling rule for both tiers (vLLM v1 style).

Each step, every running request and then every waiting one gets
min(num_tokens + len(spec_token_ids) - num_computed_tokens, remaining token budget) new tokens. A prompt larger
than the budget is prefilled in chunks across steps; a decoding request asks for 1 token, plus its proposed
draft tokens when it speculates (verified in the same forward); prefill and decode share one batch.
When the pool runs out of blocks, the most recently admitted running request is preempted (its blocks are
freed and it is recomputed later). Priorities (Request.priority, lower first; vLLM's priority policy) order both
queues each step, stably, so equal priorities keep first-come-first-served: the preempted request is the newest
of the lowest priority, and a waiting request that finds no room preempts a running one of lower priority. A
request admitted from scratch first takes its longest cached prefix (KVCacheManager.get_computed_blocks, then a
copy of a block that continues it: get_partial_block) and is scheduled only for the rest; one whose next block a
running request is computing right now waits for it (a step or two) instead of computing it again. A prefix
that continues in the tiers below the pool (shared/kv_offload.py) is loaded into fresh blocks beside the steps:
its request waits (LOADING_KV, in the waiting queue) until the load ends, then is admitted like one whose prefix
another request computed: the loaded blocks are in the pool's prefix cache.
With LoRA (LoRAConfig), one step runs the requests of at most max_loras distinct adapters (the base model's take
no slot; vLLM's rule): a running request of one adapter too many sits the step out, and a waiting one is not
admitted. Once a waiting request is held back that way, no later waiting request with an adapter is admitted in
that step (base-model ones are), so the adapters running drain and it gets the next free slot: first come, first
served, no starvation.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.shared.config import LoRAConfig, SchedulerConfig
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch


@dataclass
class SchedulerOutput:
    """What one step computes: requests in batch order and the new tokens each gets."""

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # draft tokens included
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # the drafts scheduled
    # sampled requests with a draft model's drafts: the distribution each draft came from, [num_drafts, vocab]
    spec_draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    preempted_requests: list[Request] = field(default_factory=list)
    # requests with a grammar that sample this step: the allowed tokens of each sampled row, [num_drafts + 1,
    # ceil(vocab / 32)] int32 bitmasks (shared/structured_output.py)
    grammar_bitmask: dict[str, torch.Tensor] = field(default_factory=dict)
    # KV block copies (src, dst) to run, in order, before the forward: partial-block prefix hits (copy-on-write)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # with LoRA: the adapter slot of each adapter (Request.lora_key) scheduled, once the engine activated them
    lora_slots: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def samples(self, request: Request) -> bool:
        """Whether this step computes the request's last token (its drafts included), and so samples the next."""
        num_drafts = len(self.scheduled_spec_decode_tokens.get(request.request_id, ()))
        return request.num_computed_tokens + self.num_scheduled_tokens[request.request_id] == (
            request.num_tokens + num_drafts)

    def constrained_samples(self) -> list[tuple[Request, list[int]]]:
        """(request, its draft token ids) for each request with a grammar that samples this step."""
        return [(r, self.scheduled_spec_decode_tokens.get(r.request_id, [])) for r in self.scheduled_requests
                if r.grammar is not None and self.samples(r)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 lora_config: LoRAConfig | None = None):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_loras = lora_config.max_loras if lora_config is not None else None  # adapters in one step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start

    def add_request(self, request: Request) -> None:
        """Queue a request; it starts at num_computed_tokens (0, or the prompt length if its KV was imported)."""
        if request.num_computed_tokens > 0:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def remove_request(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule(out)
        out.block_copies = self.kv_cache_manager.take_block_copies()
        return out

    def _finish_tier_loads(self) -> None:
        """Requests whose prefix finished loading from a tier are admitted as any other, finding it in the pool."""
        done = self.kv_cache_manager.finish_tier_loads()
        for request in self.waiting if done else ():
            if request.request_id in done and request.status == RequestStatus.LOADING_KV:
                request.status = RequestStatus.WAITING
                if request.num_cached_tokens is None:  # (its first admission: what it found is its cache hit)
                    for tier, num in done[request.request_id].items():
                        request.num_tier_cached_tokens[tier] = request.num_tier_cached_tokens.get(tier, 0) + num

    def _schedule(self, out: SchedulerOutput) -> None:
        self._finish_tier_loads()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=_priority)  # (stable: admission order within a priority)
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=_priority))
        loras: set[str] = set()  # the adapters of the requests scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens, budget)
            if num_new <= 0 or not self._lora_fits(request, loras):  # (decode tier: KV imports join any time)
                i += 1
                continue
            if not self.kv_cache_manager.allocate_slots(request, num_new):
                # NOTE: the victim sits at index >= i, so it has not been placed in this step's batch.
                victim = self.running.pop()  # newest admitted first
                self._preempt(victim, out)
                continue  # retry the same request (or stop if it was the victim)
            out.scheduled_requests.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            if request.lora_key is not None:
                loras.add(request.lora_key)
            num_spec = request.num_computed_tokens + num_new - request.num_tokens  # drafts that fit the budget
            if num_spec > 0:
                out.scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []  # proposed afresh after each step
            budget -= num_new
            i += 1
        if out.preempted_requests:
            return  # no admissions in a step that had to preempt
        in_flight = self.kv_cache_manager.blocks_in_flight(self.running) if self.waiting else set()
        lora_held = False  # a waiting request's adapter was one too many: no later adapter request goes first
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.status == RequestStatus.LOADING_KV:
                continue
            if request.lora_key is not None and (lora_held or not self._lora_fits(request, loras)):
                lora_held = True
                continue
            computed_block_ids, num_cached, partial = [], 0, None
            # (prompt logprobs need the logits of every prompt position: such a prompt is computed in full)
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                computed_block_ids, num_cached = self.kv_cache_manager.get_computed_blocks(request)
                if in_flight and self.kv_cache_manager.next_block_hash(request, len(computed_block_ids)) in in_flight:
                    continue  # its next block is being computed: take it from the cache when it is
                loading = self._start_tier_load(request, computed_block_ids)
                if loading:
                    in_flight |= self.kv_cache_manager.blocks_in_flight([])
                    continue
                if loading is False:  # (a tier holds its prefix but the pool has no room to load it now)
                    return
                partial = self.kv_cache_manager.get_partial_block(request, len(computed_block_ids))
                num_cached += partial[1] if partial else 0
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new, computed_block_ids, partial):
                victim = self.lowest_priority_running()
                if victim is None or victim.priority <= request.priority:
                    return
                budget += self._unschedule(victim, out)
                self.running.remove(victim)
                self._preempt(victim, out)
            request.num_computed_tokens += num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled_requests.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            if request.lora_key is not None:
                loras.add(request.lora_key)
            budget -= num_new
            in_flight |= self.kv_cache_manager.blocks_in_flight([request])

    def _lora_fits(self, request: Request, loras: set[str]) -> bool:
        """Whether the request may join a step whose scheduled requests have the adapters loras."""
        key = request.lora_key
        return key is None or self.max_loras is None or key in loras or len(loras) < self.max_loras

    def _start_tier_load(self, request: Request, computed_block_ids: list[int]) -> bool | None:
        """Start loading the request's prefix after its pool hit from the tiers below the pool, if they hold some
        and the pool has room: it waits (LOADING_KV) meanwhile, and True is returned. None when the tiers hold
        nothing of it (it is computed). False when they do but the pool has no room for all of it now while running
        requests or other loads hold blocks: it waits for them to end, first in line, rather than compute in
        chunks what a load brings back about a hundred times faster (measured: docs/prefix-caching.md)."""
        hits = self.kv_cache_manager.get_tier_hits(request, len(computed_block_ids))
        if not hits:
            return None
        if not self.kv_cache_manager.start_tier_load(request, computed_block_ids, hits):
            return False if self.running or self.kv_cache_manager.has_tier_loads else None
        request.status = RequestStatus.LOADING_KV
        return True

    def lowest_priority_running(self) -> Request | None:
        """The running request to preempt for a request of better priority: the newest of the worst priority."""
        return max(reversed(self.running), key=_priority, default=None)

    def preempt(self, request: Request) -> None:
        """Take a running request out of the batch between steps (its blocks freed; recomputed later)."""
        self.running.remove(request)
        self._preempt(request, None)

    def _unschedule(self, request: Request, out: SchedulerOutput) -> int:
        """Drop a request from this step's batch, if it is in it; returns the token budget it had."""
        if request.request_id not in out.num_scheduled_tokens:
            return 0
        out.scheduled_requests.remove(request)
        out.scheduled_spec_decode_tokens.pop(request.request_id, None)
        return out.num_scheduled_tokens.pop(request.request_id)

    def _preempt(self, request: Request, out: SchedulerOutput | None) -> None:
        self.num_preemptions += 1
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.num_computed_tokens = request.num_draft_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        if out is not None:
            out.preempted_requests.append(request)


def _priority(request: Request) -> int:
    return request.priority
