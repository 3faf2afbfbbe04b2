"""`tandem bench`'s openai backend against the gateway's HTTP API of the shared test cluster: the same requests
through the cluster backend (gRPC) give the same prompt and output token counts, token messages and text. With
vLLM's CPU build ($VLLM_PYTHON, docs/benchmarks.md) and TANDEM_TEST_HEAVY=1: the vllm backend started at float32
gives HF's greedy tokens, and stops every process it started."""
import asyncio
import os

import pytest

from tandem.benchmarks.bench.backends.cluster import ClusterBackend
from tandem.benchmarks.bench.backends.openai_compat import OpenAIBackend
from tandem.benchmarks.bench.backends.vllm import VLLMServer, find_vllm_python
from tandem.benchmarks.bench.workloads import build_requests
from tandem.shared.engine_args import EngineArgs

INPUT_LEN, OUTPUT_LEN = 24, 12


def run(backend, requests):
    """Start the backend, send the requests one after another, stop it: their RequestResults."""

    async def session():
        await backend.start()
        try:
            return [await backend.generate(request) for request in requests]
        finally:
            await backend.stop()

    return asyncio.run(session())


def test_openai_backend_on_the_gateway_counts_what_the_cluster_backend_gets(cluster, model_dir, tokenizer):
    requests = build_requests("fixed", tokenizer, 3, seed=7, input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    over_http = run(OpenAIBackend("openai", cluster.openai_base_url, max_in_flight=1, request_timeout_s=120), requests)
    over_grpc = run(ClusterBackend(str(model_dir), EngineArgs(), gateway=cluster.gateway_address,
                                   request_timeout_s=120), requests)  # fmt: skip
    for http_result, grpc_result in zip(over_http, over_grpc):
        assert http_result.ok and grpc_result.ok, (http_result.error, grpc_result.error)
        assert http_result.prompt_len == grpc_result.prompt_len == INPUT_LEN
        assert http_result.num_output_tokens == len(grpc_result.output_token_ids) == OUTPUT_LEN
        assert len(http_result.token_times_s) == len(grpc_result.token_times_s)  # a chunk per token message
        # the gateway's chunks carry text only: the same tokens are the same text
        assert http_result.output_token_ids in ([], grpc_result.output_token_ids)
        assert http_result.output_text == tokenizer.decode(grpc_result.output_token_ids, skip_special_tokens=True)


@pytest.mark.heavy  # vLLM starts in 1-1.5 minutes on 2 cores
@pytest.mark.skipif(not os.environ.get("VLLM_PYTHON"), reason="needs vLLM's CPU build: set $VLLM_PYTHON")
def test_vllm_backend_at_float32_gives_hf_greedy_tokens(model_dir, tokenizer, hf_greedy, tmp_path):
    server = VLLMServer(find_vllm_python(), str(model_dir), "float32", threads=2, log_dir=str(tmp_path))
    requests = build_requests("fixed", tokenizer, 2, seed=7, input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    results = run(OpenAIBackend("vllm", None, max_in_flight=1, request_timeout_s=120, server=server), requests)
    for request, result in zip(requests, results):
        assert result.ok, result.error
        assert (result.prompt_len, result.num_output_tokens) == (INPUT_LEN, OUTPUT_LEN)
        assert len(result.token_times_s) == OUTPUT_LEN
        expected = hf_greedy(list(request.prompt_token_ids), OUTPUT_LEN)  # (ends at EOS; vLLM ignores it)
        assert result.output_token_ids[: len(expected)] == expected
    with pytest.raises(ProcessLookupError):
        os.killpg(server.server_process.process.pid, 0)  # its API server and engine core are gone
