"""What an engine reports about itself: each step's StepStats (for metrics) and EngineStats, the snapshot of its
load that the registry publishes, Instance/GetLoad answers (one proto field per field) and metrics read."""
from __future__ import annotations

from dataclasses import dataclass, field


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
