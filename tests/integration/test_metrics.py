"""Every service's Prometheus endpoint, scraped around real traffic on a running cluster: the counters move by
exactly what the clients saw (tokens, requests, finish reasons, errors), histograms count every request, the
prefill's KV bytes sent equal the decode's received, and the gauges settle back to idle."""
import time
import urllib.request

import grpc
import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.services.client import Client
from tests.integration.helpers import wait_all_blocks_free, wait_idle

LONG = "Explain, step by step and with examples, how a bicycle's gears let a rider climb a steep hill. " * 4


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name/tier): value} of one endpoint."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "tier")))
            samples[(s.name, labels)] = s.value
    return samples


def total(samples: dict, name: str, **labels) -> float:
    """The sum of a sample over every label set that has these labels."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def scrape_all(cluster) -> dict[str, dict]:
    return {name: scrape(url) for name, url in cluster.metrics_urls.items()}


def scrape_all_settled(cluster, timeout_s: float = 15) -> dict[str, dict]:
    """scrape_all once the engines' token counters stop moving: they are refreshed every second, so an earlier
    test's last tokens can reach them after its requests are done (wait_idle reads the live load)."""
    deadline = time.monotonic() + timeout_s
    last = scrape_all(cluster)
    while True:
        time.sleep(1.2)
        now = scrape_all(cluster)
        moved = any(delta(now[n], last[n], counter) for n in ("prefill0", "decode0")
                    for counter in ("tandem:generation_tokens_total", "tandem:prompt_tokens_total"))
        if not moved or time.monotonic() > deadline:
            return now
        last = now


def test_metrics_follow_the_traffic(cluster):
    assert set(cluster.metrics_urls) == {"gateway", "prefill0", "decode0"}
    wait_idle(cluster)  # (the shared cluster: nothing of an earlier test's may run into these counts)
    before = scrape_all_settled(cluster)
    received, requests = 0, 4
    with Client(cluster.gateway_address) as client:
        for i in range(requests):  # long prompts: the prefill computes them and ships their KV
            # (the first asks for prompt logprobs, which only a prefill computes: one goes through it whatever rates
            # the shared cluster measured in earlier tests, which may price the idle decode cheaper for the rest)
            extra = {"prompt_logprobs": 1} if i == 0 else {}
            out = client.generate(f"{i}. {LONG}", max_tokens=12, temperature=0.0, ignore_eos=True, timeout=300,
                                  **extra)  # fmt: skip
            received += len(out.token_ids)
        with pytest.raises(grpc.RpcError):
            client.generate("Hello", max_tokens=4, top_p=5.0, timeout=60)
    bad = {"prompt": "Hello", "max_tokens": 4, "temperature": -1}  # (the HTTP API counts its 400s too)
    reply = httpx.post(cluster.openai_base_url + "/completions", json=bad, timeout=60)
    assert reply.status_code == 400
    assert received == 12 * requests
    wait_all_blocks_free(cluster)

    def settled() -> dict:  # (the engines' counters are refreshed every second; the KV transfer ends in the background)
        deadline = time.monotonic() + 15
        while True:
            now = scrape_all(cluster)
            engines = sum(delta(now[n], before[n], "tandem:generation_tokens_total") for n in ("prefill0", "decode0"))
            sent = delta(now["prefill0"], before["prefill0"], "tandem:kv_transfer_bytes_total")
            got = delta(now["decode0"], before["decode0"], "tandem:kv_transfer_bytes_total")
            if (engines == received and sent == got) or time.monotonic() > deadline:
                return now
            time.sleep(0.5)

    after = settled()
    gw, gw0 = after["gateway"], before["gateway"]
    assert delta(gw, gw0, "tandem:generation_tokens_total") == received
    assert delta(gw, gw0, "tandem:request_success_total", finished_reason="length") == requests
    assert delta(gw, gw0, "tandem:request_errors_total", code="INVALID_ARGUMENT") == 2
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_time_per_output_token_seconds", "request_generation_tokens"):  # fmt: skip
        assert delta(gw, gw0, f"tandem:{histogram}_count") == requests, histogram
    assert delta(gw, gw0, "tandem:inter_token_latency_seconds_count") == received - requests  # (after each first)
    assert delta(gw, gw0, "tandem:request_generation_tokens_sum") == received
    # Each long prompt goes through the prefill unless the router measured the idle decode cheaper for it
    # (decode_local_cost: conditional disaggregation by measured rates, which a loaded machine moves)
    via_prefill = delta(gw, gw0, "tandem:router_decisions_total", target_tier="prefill")
    local = delta(gw, gw0, "tandem:router_decisions_total", target_tier="decode", reason="decode_local_cost")
    assert via_prefill >= 1 and via_prefill + local == requests, (via_prefill, local)
    assert delta(gw, gw0, "tandem:request_queue_time_seconds_count") == via_prefill  # (those through the prefill)
    assert delta(gw, gw0, "tandem:router_decisions_total", target_tier="decode") == requests
    prefill, decode = after["prefill0"], after["decode0"]
    # every token the client got was sampled by the prefill (the first of those it computed) or the decode
    assert delta(prefill, before["prefill0"], "tandem:generation_tokens_total") == via_prefill
    assert delta(decode, before["decode0"], "tandem:generation_tokens_total") == received - via_prefill
    assert delta(prefill, before["prefill0"], "tandem:prompt_tokens_total") > 0
    assert delta(prefill, before["prefill0"], "tandem:request_queue_time_seconds_count") == via_prefill
    assert delta(prefill, before["prefill0"], "tandem:iteration_tokens_total_count") > 0
    sent = delta(prefill, before["prefill0"], "tandem:kv_transfer_bytes_total")
    assert sent > 0 and sent == delta(decode, before["decode0"], "tandem:kv_transfer_bytes_total")
    assert delta(prefill, before["prefill0"], "tandem:kv_transfer_duration_seconds_count") == via_prefill
    assert delta(decode, before["decode0"], "tandem:engine_step_duration_seconds_count") >= 11  # (11 decode steps)
    for engine in (prefill, decode):
        assert total(engine, "tandem:num_requests_running") == 0 and total(engine, "tandem:num_requests_waiting") == 0
        assert total(engine, "tandem:kv_cache_usage_perc") == 0.0
        assert total(engine, "tandem:num_kv_blocks_free") > 0
