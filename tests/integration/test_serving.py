"""Continuous batching, bad input, cancellation and the CLI against a real cluster (real Redis, real model)."""
import json
import subprocess
import sys

import grpc
import pytest

from tandem.services.client import make_request, stream
from tests.integration.helpers import generate_all, greedy_request, load, wait_all_blocks_free
from tandem.v1 import gateway_pb2_grpc
from tests.prompts import PROMPTS


def test_continuous_batching_8_requests(cluster, hf_references):
    decode_addr = cluster.addresses["decode0"]
    start_free = load(decode_addr).num_free_blocks
    cases = [(PROMPTS[i % len(PROMPTS)], 4 + 6 * i) for i in range(8)]  # max_tokens 4, 10, ..., 46
    outs = generate_all(cluster.gateway_address, [greedy_request(kind, text, n) for (_, kind, text), n in cases])
    for ((name, _, _), n), out in zip(cases, outs):
        expected = hf_references[name][1][:n]
        assert out.token_ids == expected, f"{name} max_tokens={n}"
        assert out.finish_reason == ("length" if len(expected) == n and expected[-1] != 2 else "stop")
        assert out.completion_tokens == len(expected)
    loads = wait_all_blocks_free(cluster)
    assert loads["decode0"].num_free_blocks == start_free == loads["decode0"].num_blocks


BAD_INPUTS = {
    "empty prompt": make_request("", raw=True),
    "empty chat": make_request("", raw=False),
    "too long": make_request("hello " * 9000, raw=True, max_tokens=4),
    "max_tokens zero": make_request("hi", max_tokens=0),
    "max_tokens negative": make_request("hi", max_tokens=-3),
    "temperature negative": make_request("hi", temperature=-0.5),
    "top_p zero": make_request("hi", top_p=0.0),
    "top_p above one": make_request("hi", top_p=1.5),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_argument(cluster, case):
    with pytest.raises(grpc.RpcError) as err:
        list(stream(cluster.gateway_address, BAD_INPUTS[case], timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details(), "the error must say what is wrong"
    ok = generate_all(cluster.gateway_address, [greedy_request("chat", "What is the capital of France?", 8)])[0]
    assert ok.finish_reason in ("stop", "length") and ok.token_ids


def test_cancel_mid_stream_frees_blocks_on_both_tiers(cluster):
    request = make_request(PROMPTS[-1][2], max_tokens=200, temperature=0.0)
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120)
        received = 0
        for msg in call:
            received += len(msg.token_ids)
            if received >= 3:
                held = load(cluster.addresses["decode0"])
                assert held.num_free_blocks < held.num_blocks, "the request should hold decode blocks mid-stream"
                call.cancel()
                break
    loads = wait_all_blocks_free(cluster)
    for name, l in loads.items():
        assert l.num_free_blocks == l.num_blocks, f"{name} still holds blocks after cancel"
        assert l.num_running == 0 and l.num_waiting == 0


def test_cli_generate_json(cluster, hf_references):
    """Sent twice: the second time every prompt token before the last comes from the prefix cache (the full blocks,
    and a copy of the block holding the rest)."""
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "tandem.services", "generate", "--json", "--max-tokens", "12", "--temperature", "0",
             "--gateway", cluster.gateway_address, "What is the capital of France?"],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        result = json.loads(out.stdout)
    assert set(result) == {"text", "token_ids", "finish_reason", "usage", "timings"}
    assert result["token_ids"] == hf_references["capital"][1][:12]
    assert "Paris" in result["text"]
    num_prompt = len(hf_references["capital"][0])
    assert result["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": len(result["token_ids"]),
                               "cached_tokens": num_prompt - 1, "cached_tokens_host": 0, "cached_tokens_disk": 0,
                               "num_draft_tokens": 0, "num_accepted_tokens": 0}  # (no speculation, no KV tiers)
    assert result["timings"]["ttft_ms"] > 0 and result["timings"]["e2e_ms"] >= result["timings"]["ttft_ms"]


def test_tandem_up_passes_engine_flags_to_every_engine(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "tandem.services", "up", "--num-blocks", "96", "--kv-dtype", "bfloat16", "--max-num-seqs",
         "5", "--prefill-chunk", "48", "--log-dir", str(tmp_path), "--prompt", "Hi", "--max-tokens", "3",
         "--temperature", "0"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    decode, prefill = (tmp_path / "decode0.log").read_text(), (tmp_path / "prefill0.log").read_text()
    assert "96 KV blocks of 16 tokens (bfloat16), 256 tokens and 5 requests per step" in decode, decode
    assert "96 KV blocks of 16 tokens (bfloat16), 48 tokens and 5 requests per step" in prefill, prefill
    for log in (decode, prefill):  # (no --model: the packaged model's native GGUF, and the line says why)
        assert "weights: gguf-q4_1 from " in log and "the default for the packaged model" in log, log
