"""What a tester broke once: cancels racing admission, duplicate ids, repeated KV completion, dead instances."""
import threading
import time

import grpc
import pytest

from services.client import generate, make_request
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.integration.helpers import generate_all, greedy_request, load, wait_all_blocks_free


def decode_request(request_id: str, n: int = 40) -> decode_pb2.DecodeRequest:
    params = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    return decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=list(range(1, n + 1)), sampling_params=params)


def test_cancel_racing_the_reservation_leaks_no_blocks(cluster):
    with grpc.insecure_channel(cluster.addresses["decode0"]) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        for i in range(10):
            call = stub.Generate(decode_request(f"race-{i}"), timeout=30)
            call.cancel()  # before the reserved reply
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        from tandem.v1 import gateway_pb2_grpc

        stub = gateway_pb2_grpc.GatewayStub(channel)
        for i in range(6):
            call = stub.Generate(make_request("Tell me a long story.", max_tokens=50), timeout=60)
            time.sleep(0.01 * i)
            call.cancel()
    loads = wait_all_blocks_free(cluster)
    for name, l in loads.items():
        assert (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0), name


def test_duplicate_request_id_is_refused_without_hurting_the_first(cluster, hf_references):
    ids, expected = hf_references["capital"]
    first = make_request("What is the capital of France?", max_tokens=30, temperature=0.0)
    first.request_id = "same-id"
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", generate(cluster.gateway_address, first, timeout=120)))
    t.start()
    time.sleep(0.3)
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.gateway_address, first, timeout=60)
    t.join()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in err.value.details()
    assert result["out"].token_ids == expected[:30]


def test_repeated_kv_completion_is_refused_and_decode_stays_healthy(cluster):
    with grpc.insecure_channel(cluster.addresses["decode0"]) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        call = stub.Generate(decode_request("twice", n=3), timeout=60)
        assert next(call).reserved
        last = decode_pb2.KVBlocksMessage(request_id="twice", first_token_id=5)
        stub.TransferKV(iter([last]), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.TransferKV(iter([last]), timeout=30)
        assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        replies = list(call)  # the stray repeat must not have failed the live request
        assert replies[-1].HasField("finish_reason") and not any(r.error for r in replies)
    wait_all_blocks_free(cluster)
    assert load(cluster.addresses["decode0"]).num_waiting == 0
    ok = generate_all(cluster.gateway_address, [greedy_request("chat", "What is the capital of France?", 8)])[0]
    assert "Paris" in ok.text


def test_gateway_places_requests_elsewhere_when_a_decode_dies(model_dir, hf_references):
    from services.launcher import LocalCluster

    engine = ["--num-blocks", "256", "--threads", "1"]
    with LocalCluster(str(model_dir), num_decode=2, prefill_args=engine, decode_args=engine) as c:
        c.processes["decode1"].kill()  # still registered until its TTL runs out
        c.processes["decode1"].wait()
        del c.processes["decode1"]
        outs = generate_all(c.gateway_address, [greedy_request("chat", "What is the capital of France?", 8)] * 4)
        assert all(o.token_ids == hf_references["capital"][1][:8] for o in outs)
