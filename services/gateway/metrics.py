"""The gateway's Prometheus metrics, served at http://HOST:HTTP_PORT/metrics beside the OpenAI-compatible API.

Names follow vLLM's with the prefix `tandem:` (services/metrics.py says why), labels model_name, tier and
gateway_id (this gateway's instance id; instance_id in router_decisions names the engine chosen):
  counters   tandem:request_success_total{finished_reason} (completions that finished: stop, length, abort),
             tandem:request_errors_total{code} (ours: requests that failed, by gRPC status code name),
             tandem:prompt_tokens_total, tandem:generation_tokens_total (tokens sent to clients),
             tandem:prompt_tokens_cached_total (prompt tokens served from a prefix cache),
             tandem:router_decisions_total{target_tier, instance_id, reason} (ours: where each request went and
             why: cache_aware, round_robin, decode_local (the decode computes the prompt: few tokens),
             decode_local_cost (the decode computes it: cheaper by measured cost), pinned (n completions
             and beams follow their prompt), session_affinity (the request's session kept its pair)), tandem:router_expected_cached_tokens_total{target_tier} (ours: the
             prompt tokens the prefix index said the chosen instance held),
             tandem:request_migrations_total{reason} (ours: completions placed again with their output so far
             after their decode failed mid-stream: decode_failed, kv_transfer_failed; pipeline.py),
             tandem:router_lora_decisions_total{target_tier, lora_name, reason} (ours: for requests with a LoRA
             adapter, why the instance chosen was: holder (it holds the adapter), load_cheaper (it loads it:
             cheaper than queueing behind a holder), load_no_holder (no candidate holds it); lora_routing.py)
  histograms tandem:time_to_first_token_seconds, tandem:inter_token_latency_seconds (per token: a message of k
             tokens counts its gap k times divided by k), tandem:request_time_per_output_token_seconds (TPOT:
             (E2E - TTFT) / (tokens - 1)), tandem:e2e_request_latency_seconds, tandem:request_prompt_tokens,
             tandem:request_generation_tokens, tandem:request_queue_time_seconds (the time its prefill instance
             queued it, PrefillResponse.queue_ms; requests whose prompt the decode computes are not counted: each
             engine's own histogram of the same name counts every request it queued)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from tandem.services.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)  # fmt: skip


class GatewayMetrics:
    def __init__(self, model_name: str, instance_id: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "tier": "gateway", "gateway_id": instance_id}
        names = list(self.labels)

        def counter(name: str, doc: str, extra=()):
            return Counter(f"tandem:{name}", doc, names + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets):
            return Histogram(f"tandem:{name}", doc, names, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.success = counter("request_success", "Completions that finished, by finish reason", ["finished_reason"])
        self.errors = counter("request_errors", "Requests that failed, by gRPC status code", ["code"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished completions").labels(**self.labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated for clients (all of best_of's "
                                         "completions)").labels(**self.labels)  # fmt: skip
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens found in a prefix cache").labels(
            **self.labels)
        self.decisions = counter("router_decisions", "Instances chosen by the router, and why",
                                 ["target_tier", "instance_id", "reason"])  # fmt: skip
        self.expected_cached = counter("router_expected_cached_tokens", "Prompt tokens the prefix index said the "
                                       "chosen instance held, by the KV tier holding them (pool, host, disk)",
                                       ["target_tier", "kv_tier"])  # fmt: skip
        self.lora_decisions = counter("router_lora_decisions", "Instances chosen for requests with a LoRA adapter, "
                                      "and why: holder, load_cheaper, load_no_holder",
                                      ["target_tier", "lora_name", "reason"])  # fmt: skip
        self.migrations = counter("request_migrations", "Completions placed again with their output so far after "
                                  "their decode failed mid-stream, by reason", ["reason"])  # fmt: skip
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens sent", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Time per output token after the first",
                              ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited in its prefill's queue",
                                    LATENCY_BUCKETS)  # fmt: skip
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request",
                                                   TOKEN_BUCKETS)  # fmt: skip

    def observe_route(self, route) -> None:
        """A Route (services/gateway/router.py) that placed a request."""
        for tier, instance, cached in (("decode", route.decode, route.decode_cached_tokens),
                                       ("prefill", route.prefill, route.prefill_cached_tokens)):  # fmt: skip
            if instance is not None:
                self.decisions.labels(**self.labels, target_tier=tier, instance_id=instance.instance_id,
                                      reason=route.reason).inc()  # fmt: skip
                held = route.prefill_cached_tiers if tier == "prefill" and route.prefill_cached_tiers else {
                    "pool": cached}  # (a decode's count is its pool's)
                for kv_tier, num in held.items():
                    self.expected_cached.labels(**self.labels, target_tier=tier, kv_tier=kv_tier).inc(num)
        for tier, reason in route.lora_reasons.items():
            self.lora_decisions.labels(**self.labels, target_tier=tier, lora_name=route.lora.name, reason=reason).inc()

    def observe_tokens(self, num_tokens: int, gap_s: float) -> None:
        """A message of num_tokens tokens sent gap_s after the previous one."""
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)

    def observe_finished(self, finish_reason: str, num_prompt: int, num_cached: int, num_generated: int,
                         ttft_s: float, e2e_s: float) -> None:
        self.success.labels(**self.labels, finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.cached_tokens.inc(num_cached)
        self.generation_tokens.inc(num_generated)
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_generated)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if num_generated > 1:
            self.tpot.observe((e2e_s - ttft_s) / (num_generated - 1))

    def observe_error(self, code: str) -> None:
        """A request that failed, answered with this gRPC status code (its name: "INVALID_ARGUMENT")."""
        self.errors.labels(**self.labels, code=code).inc()
