"""tandem.services.client's Client and AsyncClient against a real cluster (real Redis, real model): greedy outputs equal
HF transformers fp32, streams concatenate to generate()'s text, errors carry the server's status code."""
import asyncio
import contextlib

import grpc
import pytest

from tandem.services.client import AsyncClient, Client, generate, make_request
from tests.prompts import PROMPTS

GREEDY_PROMPTS = ["capital", "raw_story", "haiku"]
TEXTS = {name: (kind, text) for name, kind, text in PROMPTS}


def prompt_args(name: str) -> dict:
    """generate()'s input for a prompt of tests.prompts: raw text, or one user turn."""
    kind, text = TEXTS[name]
    return {"prompt": text} if kind == "raw" else {"messages": [{"role": "user", "content": text}]}


def check_greedy(out, name: str, hf_references) -> None:
    ids, expected = hf_references[name]
    assert out.token_ids == expected, name
    assert out.finish_reason == ("stop" if expected[-1] == 2 else "length"), name
    assert out.prompt_tokens == len(ids) and out.completion_tokens == len(expected), name
    assert out.text and out.e2e_ms > 0


def test_client_generate_equals_hf_greedy(cluster, hf_references):
    with Client(cluster.gateway_address) as client:
        for name in GREEDY_PROMPTS:
            check_greedy(client.generate(**prompt_args(name), temperature=0, max_tokens=48, timeout=600), name,
                         hf_references)  # fmt: skip


def test_async_client_concurrent_generate_equals_hf_greedy(cluster, hf_references):
    async def main():
        async with AsyncClient(cluster.gateway_address) as client:
            return await asyncio.gather(*(client.generate(**prompt_args(name), temperature=0, max_tokens=48,
                                                          timeout=600) for name in GREEDY_PROMPTS))  # fmt: skip

    for name, out in zip(GREEDY_PROMPTS, asyncio.run(main())):
        check_greedy(out, name, hf_references)


def test_stream_deltas_concatenate_to_generate(cluster, hf_references):
    args = prompt_args("raw_story") | {"temperature": 0, "max_tokens": 24, "timeout": 600}
    with Client(cluster.gateway_address) as client:
        whole = client.generate(**args)
        msgs = list(client.stream(**args))

    async def astream():
        async with AsyncClient(cluster.gateway_address) as client:
            return [msg async for msg in client.stream(**args)]

    for stream in (msgs, asyncio.run(astream())):
        assert len(stream) > 1, "the answer should come as several deltas"
        assert "".join(m.text for m in stream) == whole.text
        assert [t for m in stream for t in m.token_ids] == whole.token_ids == hf_references["raw_story"][1][:24]
        assert stream[-1].HasField("finish_reason") and not any(m.HasField("finish_reason") for m in stream[:-1])


def test_bad_parameter_is_invalid_argument(cluster):
    with Client(cluster.gateway_address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate("Hello", top_p=2, max_tokens=4, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()

    async def main():
        async with AsyncClient(cluster.gateway_address) as client:
            await client.generate("Hello", top_p=2, max_tokens=4, timeout=60)

    with pytest.raises(grpc.aio.AioRpcError) as aerr:
        asyncio.run(main())
    assert aerr.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in aerr.value.details()


def test_unknown_keyword_is_type_error(cluster):
    with Client(cluster.gateway_address) as client, pytest.raises(TypeError, match="top_q"):
        client.generate("Hello", top_q=0.5)

    async def main():
        async with AsyncClient(cluster.gateway_address) as client:
            with pytest.raises(TypeError, match="max_new_tokens"):
                await client.generate("Hello", max_new_tokens=4)
            with pytest.raises(TypeError, match="top_q"):
                async for _ in client.stream("Hello", top_q=0.5):
                    pass

    asyncio.run(main())


def test_health_is_serving(cluster):
    with Client(cluster.gateway_address) as client:
        assert client.health() == "SERVING"

    async def main():
        async with AsyncClient(cluster.gateway_address) as client:
            return await client.health()

    assert asyncio.run(main()) == "SERVING"
    # grpc.health.v1's streaming Watch answers on every service too (what Kubernetes-style probes may use)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address in [cluster.gateway_address, *cluster.addresses.values()]:
        with grpc.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING, address
            watch.cancel()


def test_sampling_fields_by_name_reach_the_server(cluster):
    """logprobs, stop, n and structured_output (a dict) each change the answer, so each must have been sent."""
    with Client(cluster.gateway_address) as client:
        out = client.generate(**prompt_args("capital"), temperature=0, max_tokens=6, logprobs=2)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids and all(len(lp.top) == 2 for lp in out.logprobs)
        full = client.generate(**prompt_args("raw_story"), temperature=0, max_tokens=24).text
        word = full.split()[3]
        cut = client.generate(**prompt_args("raw_story"), temperature=0, max_tokens=24, stop=[word])
        assert cut.finish_reason == "stop" and cut.text == full[: full.index(word)]
        choice = client.generate(messages=[{"role": "user", "content": "Is Paris in France?"}], temperature=0,
                                 max_tokens=8, structured_output={"choice": ["certainly", "no way"]})  # fmt: skip
        assert choice.text in ("certainly", "no way") and choice.finish_reason == "stop"
        with pytest.raises(ValueError, match="stream"):
            client.generate("Hello", n=2, max_tokens=2)
        msgs = list(client.stream("Hello", n=2, max_tokens=2, temperature=1.0, seed=3))
    assert {m.index for m in msgs} == {0, 1}
    assert sum(m.HasField("finish_reason") for m in msgs) == 2


def test_one_channel_for_the_client_lifetime_and_closed_after(cluster, monkeypatch):
    opened = []
    real = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel", lambda *a, **k: opened.append(a) or real(*a, **k))
    with Client(cluster.gateway_address) as client:
        for _ in range(3):
            client.generate("Hello", max_tokens=2, temperature=0)
        assert client.health() == "SERVING"
    assert len(opened) == 1
    with pytest.raises(ValueError, match="(?i)closed"):
        client.generate("Hello", max_tokens=2)


def test_breaking_out_of_a_stream_cancels_the_request(cluster):
    """Left running, this request (ignore_eos, 1000 tokens) would hold its blocks far longer than 15 s."""
    from tests.integration.helpers import wait_all_blocks_free

    with Client(cluster.gateway_address) as client:
        stream = client.stream(**prompt_args("long_summary"), max_tokens=1000, ignore_eos=True, temperature=0)
        with contextlib.closing(stream):
            assert next(stream).token_ids
        loads = wait_all_blocks_free(cluster, timeout_s=15)
    for name, l in loads.items():
        assert l.num_running == 0 and l.num_free_blocks == l.num_blocks, f"{name} still runs the closed stream"


def test_module_generate_shares_completion_accumulation(cluster, hf_references):
    texts = []
    out = generate(cluster.gateway_address, make_request(TEXTS["capital"][1], max_tokens=12, temperature=0.0),
                   on_text=texts.append, timeout=600)  # fmt: skip
    assert out.token_ids == hf_references["capital"][1][:12]
    assert "".join(texts) == out.text and out.finish_reason in ("stop", "length")
    assert 0 < len(out.itl_ms) < len(out.token_ids) and min(out.itl_ms) >= 0
