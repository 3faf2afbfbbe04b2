"""What an engine reports about itself: each step's StepStats (for metrics) and EngineStats, the snapshot of its
load that the registry publishes, Instance/GetLoad answers (one proto field per field) and metrics read; snapshot()
takes one of an LLMEngine."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.shared.request import RequestStatus


@dataclass(slots=True)
class StepStats:
    """What one step did, for metrics: its wall time, the requests and tokens in its batch (drafts included),
    and the queue time of each request it scheduled for the first time (seconds since admission)."""

    duration_s: float
    num_requests: int
    num_tokens: int
    queue_times_s: list[float]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine's load, as the registry publishes it and the router reads it."""

    model_id: str
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_running: int  # in the running batch
    num_waiting: int  # queued, preempted, or (decode) waiting for their prompt's KV
    num_queued_tokens: int = 0  # tokens still to compute over every request here: none for one waiting for its
    # KV; for one not admitted yet, its prompt less the prefix it will find cached (or being computed)
    num_cached_blocks: int = 0  # blocks in the prefix cache
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found
    num_evictions: int = 0  # cached blocks evicted, since start
    num_blocks_exported: int = 0  # KV blocks sent (prefill) and written from received KV (decode), since start
    num_blocks_imported: int = 0
    spec_num_drafts: int = 0  # since start: verified steps with draft tokens, the drafts, and of those accepted
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_waiting_for_kv: int = 0  # decode: reserved, prompt KV still arriving (counted in num_waiting too)
    num_preemptions: int = 0  # since start
    num_prompt_tokens: int = 0  # since start: prompt tokens computed here (cache hits, imported KV excluded)
    num_generation_tokens: int = 0  # since start: tokens sampled here
    # The tiers below the pool (shared/kv_offload.py), by tier ("host", "disk"; a tier it lacks is absent):
    kv_tier_load_s: dict[str, float] = field(default_factory=dict)  # measured seconds to load one block into the
    # pool (a one-block probe at start, then a running mean of real loads)
    kv_tier_blocks: dict[str, int] = field(default_factory=dict)  # blocks held now
    kv_tier_hits: dict[str, int] = field(default_factory=dict)  # since start: blocks loaded back into the pool
    kv_tier_stores: dict[str, int] = field(default_factory=dict)  # since start: blocks stored
    kv_tier_evictions: dict[str, int] = field(default_factory=dict)  # since start: blocks evicted
    kv_tier_store_failures: dict[str, int] = field(default_factory=dict)  # since start: blocks a tier could not
    # store (a failed disk write: a full or vanished filesystem), dropped
    kv_tier_load_failures: dict[str, int] = field(default_factory=dict)  # since start: loads cut short by a
    # corrupt or missing block (a miss: the request computes from there)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a speculating request gains per verified step: 1 + accepted drafts per step (vLLM's name)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def _num_queued_tokens(engine) -> int:
    """Tokens admitted but not computed yet: waiting prompts less their reusable prefix, running requests' rest."""
    kv = engine.kv_cache_manager
    in_flight = kv.blocks_in_flight(engine.scheduler.running) if engine.scheduler.waiting else set()
    queued = 0
    for r in engine.requests.values():
        if r.status in (RequestStatus.WAITING, RequestStatus.LOADING_KV) and r.num_computed_tokens == 0:
            queued += r.num_tokens - kv.num_reusable_tokens(r, in_flight)  # (a prefix being loaded is in flight)
        elif r.status != RequestStatus.WAITING_FOR_KV:
            queued += r.num_tokens - r.num_computed_tokens
    return queued


def snapshot(engine) -> EngineStats:
    """An LLMEngine's EngineStats now: its pool, queues, prefix cache, transfers, drafts and tiers."""
    kv, d = engine.kv_cache_manager, engine.drafter
    return EngineStats(
        model_id=engine.model_config.model_id,
        block_size=engine.cache_config.block_size,
        num_blocks=engine.cache_config.num_blocks,
        num_free_blocks=engine.kv_cache_manager.num_free_blocks,
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.requests) - len(engine.scheduler.running),
        num_queued_tokens=_num_queued_tokens(engine),
        num_cached_blocks=len(kv.block_pool.cached_blocks),
        prefix_cache_queries=kv.num_queries,
        prefix_cache_hits=kv.num_hits,
        num_evictions=kv.block_pool.num_evictions,
        num_blocks_exported=engine.kv_connector.num_blocks_exported,
        num_blocks_imported=engine.kv_connector.num_blocks_imported,
        spec_num_drafts=d.num_drafts if d else 0,
        spec_num_draft_tokens=d.num_draft_tokens if d else 0,
        spec_num_accepted_tokens=d.num_accepted_tokens if d else 0,
        num_waiting_for_kv=sum(r.status == RequestStatus.WAITING_FOR_KV for r in engine.requests.values()),
        num_preemptions=engine.scheduler.num_preemptions,
        num_prompt_tokens=engine.num_prompt_tokens,
        num_generation_tokens=engine.num_generation_tokens,
        **_tier_stats(engine),
    )


def _tier_stats(engine) -> dict:
    """EngineStats' kv_tier_* fields (empty dicts without tiers)."""
    o = engine.offloader
    if o is None:
        return {}
    return dict(kv_tier_load_s=dict(o.load_s_per_block), kv_tier_blocks=o.num_blocks(),
                kv_tier_hits=dict(o.num_loaded), kv_tier_stores=dict(o.num_stored),
                kv_tier_evictions=dict(o.num_evicted), kv_tier_load_failures=dict(o.num_failed),
                kv_tier_store_failures={"disk": o.disk.num_write_failures} if o.disk is not None else {})
