"""Prometheus metrics of every service (prometheus_client), served at http://HOST:PORT/metrics.

Names follow vLLM's (docs "Production Metrics") with the prefix `tandem:` instead of `vllm:`, and the same
`model_name` label, so a vLLM dashboard or autoscaler rule carries over by renaming the prefix; every series
also has `tier` (gateway, prefill, decode) and `instance_id` (the id the registry, the router and the logs use)
labels. Metrics without a vLLM counterpart are marked "(ours)".

Engines (prefill, decode) - EngineMetrics:
  gauges   tandem:num_requests_running, tandem:num_requests_waiting, tandem:num_requests_waiting_for_kv (ours),
           tandem:kv_cache_usage_perc (0-1), tandem:num_kv_blocks_free / tandem:num_kv_blocks_used (ours)
  counters tandem:num_preemptions_total, tandem:prompt_tokens_total, tandem:generation_tokens_total,
           tandem:prefix_cache_queries_total, tandem:prefix_cache_hits_total (tokens),
           tandem:spec_decode_num_drafts_total, tandem:spec_decode_num_draft_tokens_total,
           tandem:spec_decode_num_accepted_tokens_total, tandem:kv_blocks_transferred_total (ours; exported by a
           prefill, imported by a decode)
  histograms tandem:iteration_tokens_total (tokens per step), tandem:engine_step_duration_seconds (ours),
           tandem:engine_step_num_requests (ours: batch size), tandem:request_queue_time_seconds (admission to
           first step)
  KV tiers below the pool (ours; kv_tier = host, disk) gauges tandem:kv_tier_blocks{kv_tier},
           tandem:kv_tier_load_seconds_per_block{kv_tier} (measured; the registry publishes it to the router);
           counters tandem:kv_tier_hits_total{kv_tier} (blocks loaded back into the pool),
           tandem:kv_tier_stores_total{kv_tier}, tandem:kv_tier_evictions_total{kv_tier},
           tandem:kv_tier_load_failures_total{kv_tier} (a corrupt or missing block: a miss),
           tandem:kv_tier_store_failures_total{kv_tier} (a failed disk write: the block is dropped)
  KV transfer (ours) tandem:kv_transfer_bytes_total{peer}, tandem:kv_transfer_messages_total{peer},
           tandem:kv_transfer_duration_seconds{peer} (prefill: per request, first message to the decode's
           answer; decode: bytes and messages received, peer = the sending request's prefill is not known, "any")
Gateway - services/gateway/metrics.py.

The engine's gauges and counters are read from one EngineStats snapshot per scrape interval (StatsCollector:
refreshed by the service every STATS_REFRESH_S), so a scrape never waits on the engine thread.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.shared.engine_stats import EngineStats, StepStats

STATS_REFRESH_S = 1.0
RATE_MIN_STEP_TOKENS, RATE_EWMA_ALPHA = 32, 0.2  # EngineMetrics.tokens_per_s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)  # fmt: skip  (seconds: vLLM's TTFT buckets)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StatsCollector:
    """A prometheus_client collector exposing the latest EngineStats as gauges and counters."""

    GAUGES = (("num_requests_running", "Requests in the running batch", lambda s: s.num_running),
              ("num_requests_waiting", "Requests queued, preempted or waiting for their KV", lambda s: s.num_waiting),
              ("num_requests_waiting_for_kv", "Requests reserved whose prompt KV is still arriving",
               lambda s: s.num_waiting_for_kv),
              ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)",
               lambda s: 1 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0),
              ("num_kv_blocks_free", "KV blocks no request holds", lambda s: s.num_free_blocks),
              ("num_kv_blocks_used", "KV blocks held by requests", lambda s: s.num_blocks - s.num_free_blocks),
              ("num_prefix_cached_blocks", "Blocks held by the prefix cache", lambda s: s.num_cached_blocks))  # fmt: skip
    COUNTERS = (("num_preemptions", "Requests preempted since start", lambda s: s.num_preemptions),
                ("prompt_tokens", "Prompt tokens computed (cache hits excluded)", lambda s: s.num_prompt_tokens),
                ("generation_tokens", "Tokens sampled", lambda s: s.num_generation_tokens),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 lambda s: s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hits),
                ("prefix_cache_evictions", "Cached blocks evicted", lambda s: s.num_evictions),
                ("spec_decode_num_drafts", "Verified steps that had draft tokens", lambda s: s.spec_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified", lambda s: s.spec_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted", lambda s: s.spec_num_accepted_tokens),
                ("kv_blocks_transferred", "KV blocks sent to decodes (prefill) or written from received KV "
                 "(decode)", lambda s: s.num_blocks_exported + s.num_blocks_imported))  # fmt: skip
    # per tier below the pool (EngineStats' dicts by tier name), labelled kv_tier
    TIER_GAUGES = (("kv_tier_blocks", "Blocks held by a KV tier below the pool", lambda s: s.kv_tier_blocks),
                   ("kv_tier_load_seconds_per_block", "Measured seconds to load one block from a KV tier into the "
                    "pool", lambda s: s.kv_tier_load_s))  # fmt: skip
    TIER_COUNTERS = (("kv_tier_hits", "Blocks loaded back into the pool from a KV tier", lambda s: s.kv_tier_hits),
                     ("kv_tier_stores", "Blocks stored in a KV tier", lambda s: s.kv_tier_stores),
                     ("kv_tier_evictions", "Blocks evicted from a KV tier", lambda s: s.kv_tier_evictions),
                     ("kv_tier_load_failures", "Loads from a KV tier cut short by a corrupt or missing block",
                      lambda s: s.kv_tier_load_failures),
                     ("kv_tier_store_failures", "Blocks a KV tier could not store (a failed disk write), dropped",
                      lambda s: s.kv_tier_store_failures))  # fmt: skip

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.stats: EngineStats | None = None

    def collect(self):
        if self.stats is None:
            return
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in self.GAUGES:
            family = GaugeMetricFamily(f"tandem:{name}", doc, labels=names)
            family.add_metric(values, float(value(self.stats)))
            yield family
        for name, doc, value in self.COUNTERS:
            family = CounterMetricFamily(f"tandem:{name}", doc, labels=names)
            family.add_metric(values, float(value(self.stats)))
            yield family
        for kind, table in ((GaugeMetricFamily, self.TIER_GAUGES), (CounterMetricFamily, self.TIER_COUNTERS)):
            for name, doc, value in table:
                by_tier = value(self.stats)
                if by_tier:
                    family = kind(f"tandem:{name}", doc, labels=names + ["kv_tier"])
                    for tier, number in by_tier.items():
                        family.add_metric(values + [tier], float(number))
                    yield family


class EngineMetrics:
    """One engine instance's metrics (tier "prefill" or "decode") in their own registry."""

    def __init__(self, tier: str, model_name: str, instance_id: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "tier": tier, "instance_id": instance_id}
        self.stats = StatsCollector(labels)
        self.registry.register(self.stats)
        self.tokens_per_s = 0.0  # (observe_step)
        names = list(labels)

        def histogram(name: str, doc: str, buckets, extra=()):
            return Histogram(f"tandem:{name}", doc, names + list(extra), buckets=buckets, registry=self.registry)

        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step",
                                          TOKEN_BUCKETS).labels(**labels)  # fmt: skip
        self.step_duration = histogram("engine_step_duration_seconds", "Wall time of one engine step",
                                       LATENCY_BUCKETS).labels(**labels)  # fmt: skip
        self.step_requests = histogram("engine_step_num_requests", "Requests in one engine step's batch",
                                       TOKEN_BUCKETS).labels(**labels)  # fmt: skip
        self.queue_time = histogram("request_queue_time_seconds", "Seconds from admission to a request's first step",
                                    LATENCY_BUCKETS).labels(**labels)  # fmt: skip
        self.labels = labels
        peer = names + ["peer"]
        self.kv_bytes = Counter("tandem:kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)", peer,
                                registry=self.registry)  # fmt: skip
        self.kv_messages = Counter("tandem:kv_transfer_messages", "KV messages sent (prefill) or received (decode)",
                                   peer, registry=self.registry)  # fmt: skip
        self.kv_transfer_duration = histogram("kv_transfer_duration_seconds", "One request's KV transfer to a decode, "
                                              "first message to its answer (prefill)", LATENCY_BUCKETS, ["peer"])  # fmt: skip

    def observe_step(self, step: StepStats) -> None:
        """AsyncEngine's on_step (engine thread; prometheus_client's metrics are thread-safe). Also keeps
        tokens_per_s, the registry's measure of how fast this instance works off its queue: an EWMA over steps of
        at least RATE_MIN_STEP_TOKENS tokens (decode-sized steps say little about prefill speed)."""
        if step.num_tokens >= RATE_MIN_STEP_TOKENS and step.duration_s > 0:
            rate = step.num_tokens / step.duration_s
            self.tokens_per_s = rate if not self.tokens_per_s else self.tokens_per_s + RATE_EWMA_ALPHA * (
                rate - self.tokens_per_s)
        self.iteration_tokens.observe(step.num_tokens)
        self.step_duration.observe(step.duration_s)
        self.step_requests.observe(step.num_requests)
        for seconds in step.queue_times_s:
            self.queue_time.observe(seconds)

    def observe_kv_message(self, peer: str, num_bytes: int) -> None:
        self.kv_bytes.labels(**self.labels, peer=peer).inc(num_bytes)
        self.kv_messages.labels(**self.labels, peer=peer).inc()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve registry at http://host:port/metrics from a daemon thread (port 0: any free port); returns the
    bound port. OSError naming the port and the flag if it cannot be bound."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}): pass --metrics-port N "
                      f"(0 picks a free port)") from None
    return server.server_port


def metrics_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/metrics"
