"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client against a running cluster:
answers equal the gRPC API's for the same greedy request (and HF's tokens), streaming semantics, n, logprobs,
errors in OpenAI's shape, and a client that disconnects mid-stream frees the request on both tiers."""
import time

import httpx2 as httpx  # (the HTTP client the openai package is built on)
import openai
import pytest

from services.client import generate, make_request
from tests.integration.helpers import load, wait_all_blocks_free

MODEL = "SmolLM2-135M-Instruct"
CAPITAL = "What is the capital of France?"
STORY = "Once upon a time, in a small village by the mountains,"


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused", max_retries=0, timeout=300)


def grpc_greedy(cluster, text: str, raw: bool, max_tokens: int):
    return generate(cluster.gateway_address, make_request(text, raw=raw, max_tokens=max_tokens, temperature=0.0),
                    timeout=300)  # fmt: skip


def test_models_and_health(cluster, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(cluster.openai_base_url.removesuffix("/v1") + "/health").status_code == 200


def test_chat_equals_grpc_and_hf(cluster, client, hf_references, tokenizer):
    expected = grpc_greedy(cluster, CAPITAL, raw=False, max_tokens=24)
    assert expected.token_ids == hf_references["capital"][1][:24]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}], max_tokens=24,
                                       temperature=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason == "stop"
    assert r.usage.prompt_tokens == expected.prompt_tokens and r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    # content parts, max_completion_tokens and the "developer" role mean what OpenAI says
    r2 = client.chat.completions.create(model=MODEL, max_completion_tokens=24, temperature=0,
                                        messages=[{"role": "user", "content": [{"type": "text", "text": CAPITAL}]}])
    assert r2.choices[0].message.content == expected.text


def test_chat_stream_with_usage(cluster, client):
    expected = grpc_greedy(cluster, CAPITAL, raw=False, max_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # without include_usage: no usage chunk
    plain = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}],
                                                max_tokens=24, temperature=0, stream=True))  # fmt: skip
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == expected.text


def test_completions_equal_grpc_streaming_or_not(cluster, client, tokenizer):
    expected = grpc_greedy(cluster, STORY, raw=True, max_tokens=20)
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=20, temperature=0)
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "length"
    assert r.object == "text_completion" and r.usage.completion_tokens == 20
    streamed = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    # token-id prompts and a batch of prompts: one choice each, in order
    story_ids = tokenizer(STORY, add_special_tokens=False).input_ids  # (as the gateway tokenizes raw text)
    by_ids = client.completions.create(model=MODEL, prompt=story_ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == expected.text
    batch = client.completions.create(model=MODEL, prompt=[STORY, CAPITAL], max_tokens=20, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == expected.text
    assert batch.choices[1].text == grpc_greedy(cluster, CAPITAL, raw=True, max_tokens=20).text


def test_sampling_parameters_reach_the_engine(cluster, client):
    """Each OpenAI name maps to its gRPC field: the HTTP answer equals the gRPC one with that field set, and
    differs from the answer without it."""
    base = {"model": MODEL, "prompt": STORY, "max_tokens": 24}
    cases = [
        ({"temperature": 1.0, "seed": 7}, {"temperature": 1.0, "seed": 7}),
        ({"temperature": 0, "presence_penalty": 2.0}, {"temperature": 0.0, "presence_penalty": 2.0}),
        ({"temperature": 0, "frequency_penalty": 2.0}, {"temperature": 0.0, "frequency_penalty": 2.0}),
        ({"temperature": 0, "extra_body": {"repetition_penalty": 1.5}}, {"temperature": 0.0, "repetition_penalty": 1.5}),
        ({"temperature": 1.0, "seed": 7, "top_p": 0.5}, {"temperature": 1.0, "seed": 7, "top_p": 0.5}),
        ({"temperature": 1.0, "seed": 7, "extra_body": {"top_k": 2}}, {"temperature": 1.0, "seed": 7, "top_k": 2}),
        ({"temperature": 1.0, "seed": 7, "extra_body": {"min_p": 0.5}}, {"temperature": 1.0, "seed": 7, "min_p": 0.5}),
    ]  # fmt: skip
    greedy = client.completions.create(**base, temperature=0).choices[0].text
    seeded = client.completions.create(**base, temperature=1.0, seed=7).choices[0].text
    for http_args, grpc_fields in cases:
        text = client.completions.create(**base, **http_args).choices[0].text
        req = make_request(STORY, raw=True, max_tokens=24)
        for name, value in grpc_fields.items():
            setattr(req.sampling_params, name, value)
        assert text == generate(cluster.gateway_address, req, timeout=300).text, http_args
        if len(grpc_fields) > 1 and not (len(grpc_fields) == 2 and "seed" in grpc_fields):
            assert text != (seeded if "seed" in grpc_fields else greedy), f"{http_args} changed nothing"
    # stop, with the stop string kept on request; ignore_eos and min_tokens run past EOS
    stop = client.completions.create(**base, temperature=0, stop=[" wizard"]).choices[0]
    assert stop.finish_reason == "stop" and " wizard" not in stop.text
    kept = client.completions.create(**base, temperature=0, stop=" wizard",
                                     extra_body={"include_stop_str_in_output": True}).choices[0]  # fmt: skip
    assert kept.text == stop.text + " wizard"
    short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}],
                                           max_tokens=16, temperature=0)  # fmt: skip
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 16
    for extra in ({"ignore_eos": True}, {"min_tokens": 16}):
        long = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}],
                                              max_tokens=16, temperature=0, extra_body=extra)  # fmt: skip
        assert long.usage.completion_tokens == 16 and long.choices[0].finish_reason == "length", extra


def test_n_and_logprobs(cluster, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}], max_tokens=8,
                                       temperature=1.0, seed=3, n=3, logprobs=True, top_logprobs=2)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.prompt_tokens == grpc_greedy(cluster, CAPITAL, raw=False, max_tokens=1).prompt_tokens
    for c in r.choices:
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
        assert all(t.top_logprobs[0].logprob >= t.logprob for t in c.logprobs.content)
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CAPITAL}],
                                           max_tokens=8, temperature=1.0, seed=3, n=3)  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    comp = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 6
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "user", "content": CAPITAL}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "presence_penalty": 9}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "logit_bias": {"one": 5}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "logit_bias": {"²": 5}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ({"messages": [{"role": "wizard", "content": CAPITAL}]}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": CAPITAL}], "model": "gpt-4"}, 404, "model"),
    ({}, 400, "messages"),
])  # fmt: skip
def test_errors_have_openai_shape(cluster, body, status, param):
    r = httpx.post(cluster.openai_base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_bodies_and_the_official_client_errors(cluster, client):
    r = httpx.post(cluster.openai_base_url + "/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
    for prompt in ([10**7], [], [STORY, [1, 2]], 5, [[]]):
        r = httpx.post(cluster.openai_base_url + "/completions", json={"prompt": prompt}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, top_p=3)
    assert "top_p" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=STORY, max_tokens=4)
    # still serving
    assert client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=0).choices[0].text


def test_disconnect_mid_stream_frees_the_request_on_both_tiers(cluster, client):
    decode = cluster.addresses["decode0"]
    with httpx.stream("POST", cluster.openai_base_url + "/completions", timeout=120,
                      json={"model": MODEL, "prompt": STORY, "max_tokens": 2000, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:  # fmt: skip
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert load(decode).num_running == 1
    deadline = time.monotonic() + 30
    while load(decode).num_running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load(decode).num_running == 0
    loads = wait_all_blocks_free(cluster)
    assert all(l.num_free_blocks == l.num_blocks for l in loads.values())
