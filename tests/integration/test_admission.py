"""Admission control and overload on a real cluster (issue 16): a request waits while every decode's KV pool is full
and runs once room comes; past its bound it gets RESOURCE_EXHAUSTED with a retry hint; with every gateway slot
taken requests wait in a bounded room, one more is refused at once (gRPC and HTTP); a request larger than the
decode's whole pool is refused at once. Answers stay equal to HF transformers; no block is left held."""
import threading
import time

import grpc
import httpx2 as httpx
import pytest

from tandem.services.client import make_request
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2_grpc
from tests.integration.helpers import greedy_request, wait_all_blocks_free

DECODE_BLOCKS = 24  # x 16 tokens: 384 tokens of KV on the decode
FILLER_TOKENS = 360  # a reservation of 23 blocks: no 37-token prompt fits beside it
QUEUE_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def small_cluster(model_dir):
    from tandem.services.launcher import LocalCluster

    engine = ["--threads", "1", "--block-size", "16"]
    with LocalCluster(str(model_dir), prefill_args=engine + ["--num-blocks", "256"],
                      # (a lease longer than a test: the Filler's reservation, which no KV ever reaches, must hold
                      # the pool until the test closes it, not for the default 10 s)
                      decode_args=engine + ["--num-blocks", str(DECODE_BLOCKS), "--kv-lease-timeout", "60"],
                      gateway_args=["--max-concurrent-requests", "2", "--max-waiting-requests", "1", "--queue-timeout",
                                    str(QUEUE_TIMEOUT_S), "--local-prefill-tokens", "0"]) as c:  # fmt: skip
        yield c


class Filler:
    """A reservation straight on the decode that holds FILLER_TOKENS of its pool (no KV ever comes) until closed."""

    def __init__(self, cluster):
        self.channel = grpc.insecure_channel(cluster.addresses["decode0"])
        request = decode_pb2.DecodeRequest(request_id=f"filler-{time.monotonic_ns()}",
                                           prompt_token_ids=list(range(1, FILLER_TOKENS + 1)),
                                           sampling_params=common_pb2.SamplingParams(max_tokens=8))  # fmt: skip
        self.call = decode_pb2_grpc.DecodeStub(self.channel).Generate(request, timeout=120)
        assert next(self.call).reserved

    def close(self):
        self.call.cancel()
        self.channel.close()


def start(cluster, request, results: dict, key: str, timeout: float = 120) -> threading.Thread:
    """Run request through the gateway on a thread; results[key]: its token ids or the grpc.RpcError."""

    def run():
        with grpc.insecure_channel(cluster.gateway_address) as channel:
            try:
                replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout))
                results[key] = [t for r in replies for t in r.token_ids]
            except grpc.RpcError as e:
                results[key] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def pushback_ms(error: grpc.RpcError) -> int:
    return int(dict(error.trailing_metadata() or ())["grpc-retry-pushback-ms"])


def test_a_full_decode_pool_makes_requests_wait_then_run_or_be_refused_with_a_retry_hint(small_cluster,
                                                                                         hf_references):
    expected = hf_references["capital"][1][:8]
    filler = Filler(small_cluster)
    try:
        results: dict = {}
        bounded = greedy_request("chat", "What is the capital of France?", 8)
        bounded.deadline_ms = 1500
        started = time.monotonic()
        start(small_cluster, bounded, results, "bounded").join()
        error = results["bounded"]
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "waited" in error.details() and "room on a decode" in error.details()
        assert 1.0 <= time.monotonic() - started < QUEUE_TIMEOUT_S  # (it waited for room, within its deadline)
        started = time.monotonic()
        start(small_cluster, greedy_request("chat", "What is the capital of France?", 8), results, "timeout").join()
        error = results["timeout"]
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no decode has room" in error.details() and pushback_ms(error) >= 1000
        assert time.monotonic() - started >= QUEUE_TIMEOUT_S  # (it waited the whole --queue-timeout)
        waiting = start(small_cluster, greedy_request("chat", "What is the capital of France?", 8), results, "waits")
        time.sleep(1.0)
        assert "waits" not in results  # (still waiting for room)
    finally:
        filler.close()
    waiting.join(120)
    assert results["waits"] == expected
    assert "is full; placing it again" in (small_cluster.log_dir / "gateway.log").read_text()
    loads = wait_all_blocks_free(small_cluster)
    assert all(l.num_free_blocks == l.num_blocks and l.num_waiting == 0 for l in loads.values())


def test_with_every_slot_taken_one_request_waits_and_the_next_is_refused_at_once(small_cluster, hf_references):
    expected = hf_references["capital"][1][:8]
    request = greedy_request("chat", "What is the capital of France?", 8)
    filler = Filler(small_cluster)  # (the two requests holding the gateway's slots wait for room meanwhile)
    results: dict = {}
    try:
        threads = [start(small_cluster, request, results, f"slot{i}") for i in range(2)]
        time.sleep(1.0)
        threads.append(start(small_cluster, request, results, "waiting-room"))
        time.sleep(0.5)
        start(small_cluster, request, results, "refused").join(30)
        refused = results["refused"]
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-waiting-requests" in refused.details() and pushback_ms(refused) >= 1000
        r = httpx.post(small_cluster.openai_base_url + "/completions", timeout=30,
                       json={"prompt": "Hello", "max_tokens": 4})  # fmt: skip
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "--max-waiting-requests" in r.json()["error"]["message"]
    finally:
        filler.close()
    for thread in threads:
        thread.join(120)
    assert [results[k] for k in ("slot0", "slot1", "waiting-room")] == [expected] * 3
    wait_all_blocks_free(small_cluster)


def test_a_request_larger_than_the_decode_pool_is_refused_at_once(small_cluster):
    request = make_request("Tell me a story. " * 60, raw=True, max_tokens=300)  # (> 384 tokens in all)
    with grpc.insecure_channel(small_cluster.gateway_address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"holds {DECODE_BLOCKS * 16}" in e.value.details()


def test_more_prompts_than_the_gateway_can_ever_hold_is_a_400_not_a_429(small_cluster):
    """Each prompt of an HTTP request takes a slot: 4 prompts against 2 slots + 1 waiting place could never run,
    so a retry hint would be a lie (breaker)."""
    r = httpx.post(small_cluster.openai_base_url + "/completions", timeout=30,
                   json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "at most 3" in r.json()["error"]["message"]
