"""Property tests (hypothesis): random and malformed requests through both public APIs never crash a service.
Each answer is a success or a client error (gRPC INVALID_ARGUMENT / HTTP 400 or 404) whose message names the
field at fault, and after every example the cluster still answers a plain request and every KV block is free."""
import json
import math

import grpc
import httpx2 as httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.services.client import generate, make_request
from tests.passes import fuzz_settings
from tests.integration.helpers import wait_all_blocks_free

FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "logprobs", "n", "seed", "prompt_logprobs", "beam_width",
          "length_penalty")  # fmt: skip
FUZZ = fuzz_settings(25)

numbers = st.one_of(st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.integers(-(2**63), 2**63))  # fmt: skip
values = st.one_of(numbers, st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(-5, 5), max_size=3))


@given(params=st.dictionaries(st.sampled_from(FIELDS), numbers, max_size=4),
       prompt=st.text(max_size=20), stop=st.lists(st.text(max_size=3), max_size=2))
@FUZZ
def test_grpc_random_sampling_params(cluster, params, prompt, stop):
    req = make_request(prompt or "x", raw=True, stop=stop)
    for name, value in params.items():
        try:
            setattr(req.sampling_params, name, type(getattr(req.sampling_params, name))(value))
        except (TypeError, ValueError, OverflowError):
            continue  # (not representable in the proto field: a client library refuses it before sending)
    p = req.sampling_params
    if not p.HasField("max_tokens") or p.max_tokens > 4:
        p.max_tokens = 4  # (keeps each example short; small or negative values stay as drawn)
    if p.n > 3:
        p.n = 3
    try:
        out = generate(cluster.gateway_address, req, timeout=120)
        assert out.finish_reason in ("stop", "length")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (params, e.code(), e.details())
        assert any(word in e.details() for word in (*FIELDS, "stop", "prompt")), e.details()
    _still_serving(cluster)


@given(body=st.dictionaries(st.sampled_from(("messages", "model", "max_tokens", "temperature", "top_p", "n", "stop",
                                             "logprobs", "top_logprobs", "seed", "stream", "presence_penalty",
                                             "response_format", "min_tokens", "top_k", "stream_options")),
                            values, max_size=5),  # fmt: skip
       messages=st.one_of(st.just([{"role": "user", "content": "Hi"}]),
                          st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                                                    "tool", ""]),
                                                          "content": st.one_of(st.text(max_size=8), st.none(),
                                                                               st.integers())}), max_size=2)))
@FUZZ
def test_http_random_chat_bodies(cluster, body, messages):
    body = {"messages": messages} | body
    if isinstance(body.get("max_tokens"), (int, float)) and not isinstance(body["max_tokens"], bool):
        if not math.isfinite(body["max_tokens"]) or body["max_tokens"] > 4:
            body["max_tokens"] = 4
    else:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    r = httpx.post(cluster.openai_base_url + "/chat/completions", json=body, timeout=120)
    _check_http_answer(r, body)
    _still_serving(cluster)


@given(body=st.dictionaries(st.sampled_from(("prompt", "max_tokens", "temperature", "n", "logprobs", "echo", "seed",
                                             "logit_bias", "prompt_logprobs", "use_beam_search", "length_penalty",
                                             "structured_outputs", "response_format", "stop", "stream")),
                            st.one_of(values, st.dictionaries(st.sampled_from(("1", "x", "99999999", "json", "regex",
                                                                               "choice", "type")),
                                                              values, max_size=2)),
                            max_size=5),  # fmt: skip
       prompt=st.one_of(st.text(max_size=12), st.lists(st.integers(-2, 60000), max_size=4)))
@FUZZ
def test_http_random_completions_bodies(cluster, body, prompt):
    body = {"prompt": prompt} | body
    body["max_tokens"] = 3  # (short examples; the other fields as drawn)
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    r = httpx.post(cluster.openai_base_url + "/completions", json=body, timeout=120)
    _check_http_answer(r, body)
    _still_serving(cluster)


@given(raw=st.binary(max_size=40))
@fuzz_settings(15)
def test_http_garbage_bodies(cluster, raw):
    r = httpx.post(cluster.openai_base_url + "/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()


def test_http_body_over_the_limit_is_refused_before_it_is_parsed(cluster):
    from tandem.services.server import PUBLIC_MAX_RECEIVE_BYTES

    big = b'{"prompt": "' + b"a" * PUBLIC_MAX_RECEIVE_BYTES + b'", "max_tokens": 1}'
    r = httpx.post(cluster.openai_base_url + "/completions", content=big, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and str(PUBLIC_MAX_RECEIVE_BYTES) in r.json()["error"]["message"]

    def chunks():  # (no Content-Length: counted as it arrives)
        yield b'{"prompt": "'
        for _ in range(PUBLIC_MAX_RECEIVE_BYTES // 2**20 + 1):
            yield b"a" * 2**20
        yield b'"}'

    r = httpx.post(cluster.openai_base_url + "/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413
    ok = httpx.post(cluster.openai_base_url + "/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"]


def _check_http_answer(r, body: dict) -> None:
    """A success with choices (a JSON body) or a 400 / 404 in OpenAI's shape whose param names the field."""
    if r.status_code != 200:
        assert r.status_code in (400, 404), (body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["param"], (body, error)
    elif not body.get("stream"):
        assert r.json()["choices"], body


def _still_serving(cluster):
    assert generate(cluster.gateway_address, make_request("Hi", raw=True, max_tokens=1, temperature=0.0),
                    timeout=120).completion_tokens == 1  # fmt: skip
    loads = wait_all_blocks_free(cluster, timeout_s=10)
    assert all(l.num_free_blocks == l.num_blocks for l in loads.values())


pytestmark = [pytest.mark.fuzz, pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")]


# -- hand-encoded and oversized requests ---------------------------------------------------------------------
def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2), encoded by hand: Python protobuf refuses to build a
    message whose string is not valid UTF-8, so these bytes go out with an identity serializer."""
    tag, length = number << 3 | 2, len(payload)
    varint = bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return bytes([tag]) + bytes(varint) + payload


BAD_UTF8 = b"caf\xc3(\xff\xfe"
RAW_REQUESTS = {  # GenerateRequest: prompt 1, chat 2 (ChatMessages: messages 1; ChatMessage: role 1, content 2),
    # sampling_params 3 (SamplingParams.stop 7), request_id 4, cache_salt 5
    "prompt": _field(1, BAD_UTF8),
    "chat content": _field(2, _field(1, _field(1, b"user") + _field(2, BAD_UTF8))),
    "chat role": _field(2, _field(1, _field(1, BAD_UTF8) + _field(2, b"Hi"))),
    "request_id": _field(1, b"Hi") + _field(4, BAD_UTF8),
    "cache_salt": _field(1, b"Hi") + _field(5, BAD_UTF8),
    "stop": _field(1, b"Hi") + _field(3, _field(7, BAD_UTF8)),
    "truncated": _field(1, b"Hi")[:-1],
}


@pytest.mark.parametrize("where", sorted(RAW_REQUESTS))
def test_grpc_invalid_utf8_and_broken_bytes_are_invalid_argument(cluster, where):
    from tandem.v1 import gateway_pb2

    with grpc.insecure_channel(cluster.gateway_address) as channel:
        call = channel.unary_stream("/tandem.v1.Gateway/Generate", request_serializer=lambda b: b,
                                    response_deserializer=gateway_pb2.GenerateResponse.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(call(RAW_REQUESTS[where], timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
    assert "could not be parsed" in err.value.details()
    if where != "truncated":
        assert "UTF-8" in err.value.details()
    _still_serving(cluster)


def _oversized(model_config) -> dict:
    """Requests over each limit (docs/api.md "Limits") -> the field their error must name."""
    from tandem.services.gateway import validation

    cases = {
        "stop": make_request("Hi", stop=["x"] * (validation.MAX_STOP + 1)),
        "stop strings": make_request("Hi", stop=["y" * (validation.MAX_STOP_CHARS + 1)]),
        "stop_token_ids": make_request("Hi"),
        "logit_bias": make_request("Hi"),
        "structured_output": make_request("Hi"),
        "structured_output.choice": make_request("Hi"),
        "request_id": make_request("Hi"),
        "cache_salt": make_request("Hi"),
        "tokens; the model's context": make_request("hello " * 9000, raw=True),
        "characters": make_request("z" * (validation.MAX_CHARS_PER_TOKEN * model_config.max_model_len + 1), raw=True),
        "n must be": make_request("Hi"),
        "logprobs": make_request("Hi"),
    }
    cases["stop_token_ids"].sampling_params.stop_token_ids.extend([1] * (validation.MAX_STOP_TOKEN_IDS + 1))
    for t in range(validation.MAX_LOGIT_BIAS + 1):
        cases["logit_bias"].sampling_params.logit_bias[t] = 1.0
    cases["structured_output"].sampling_params.structured_output.regex = "a" * (validation.MAX_STRUCTURED_OUTPUT_CHARS + 1)
    cases["structured_output.choice"].sampling_params.structured_output.choice.choices.extend(
        ["c"] * (validation.MAX_CHOICES + 1))
    cases["request_id"].request_id = "r" * (validation.MAX_ID_CHARS + 1)
    cases["cache_salt"].cache_salt = "s" * (validation.MAX_ID_CHARS + 1)
    cases["n must be"].sampling_params.n = 2**31 - 1
    cases["logprobs"].sampling_params.logprobs = 2**31 - 1
    return cases


def test_grpc_requests_over_each_limit_name_the_field(cluster, model_config):
    assert model_config.max_model_len < 9000  # (the token case below is over the context)
    for words, request in _oversized(model_config).items():
        with pytest.raises(grpc.RpcError) as err:
            generate(cluster.gateway_address, request, timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, err.value.details())
        assert words in err.value.details(), (words, err.value.details())
    _still_serving(cluster)


HTTP_CASES = [  # (endpoint, raw JSON body, the param the 400 must name or None)
    ("completions", '{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ("completions", '{"prompt": "Hi", "top_p": Infinity}', "top_p"),
    ("completions", '{"prompt": "Hi", "presence_penalty": -Infinity}', "presence_penalty"),
    ("completions", '{"prompt": "Hi", "n": 100000000000000000000}', "n"),
    ("completions", '{"prompt": "Hi", "n": 17}', "n"),
    ("completions", '{"prompt": "Hi", "logprobs": 100000000000000000000}', "logprobs"),
    ("completions", '{"prompt": "Hi", "logprobs": 21}', "logprobs"),
    ("completions", '{"prompt": "Hi", "max_tokens": 1000000000000000000000000000000}', "max_tokens"),
    ("completions", '{"prompt": "Hi", "seed": 1e400}', "seed"),
    ("completions", '{"prompt": "Hi", "stop": ' + json.dumps(["s"] * 33) + "}", "stop"),
    ("completions", '{"prompt": "Hi", "stop": ' + json.dumps("x" * 257) + "}", "stop"),
    ("completions", '{"prompt": "Hi", "stop_token_ids": ' + json.dumps([1] * 257) + "}", "stop_token_ids"),
    ("completions", '{"prompt": "Hi", "logit_bias": ' + json.dumps({str(i): 1 for i in range(1025)}) + "}",
     "logit_bias"),
    ("completions", '{"prompt": ' + json.dumps(["Hi"] * 65) + "}", "prompt"),
    ("completions", '{"prompt": "Hi", "cache_salt": ' + json.dumps("s" * 257) + "}", "cache_salt"),
    ("completions", '{"prompt": "Hi", "structured_outputs": {"regex": ' + json.dumps("a" * 262145) + "}}",
     "structured_outputs"),
    ("completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    ("completions", '{"prompt": "Hi", "stop": ' + "[" * 5000 + "]" * 5000 + "}", None),
    ("chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 99, "logprobs": true}',
     "top_logprobs"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": -1}',
     "max_completion_tokens"),
    ("chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    # (found by the breaker: 500s) lone UTF-16 surrogates, which JSON can escape; token ids past 2^32
    ("completions", '{"prompt": "\\ud800 lone surrogate"}', None),
    ("completions", '{"prompt": "Hi", "stop": ["\\udc00"]}', None),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', None),
    ("completions", '{"prompt": "Hi", "stop_token_ids": [8589934592]}', "stop_token_ids"),
    # booleans are JSON's true and false only (pydantic's lax mode took "yes", "off", 1 and 0 as booleans)
    ("completions", '{"prompt": "Hi", "stream": "yes"}', "stream"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "logprobs": 1}', "logprobs"),
    ("responses", '{"input": "Hi", "stream": "false"}', "stream"),
    # numbers are JSON numbers (lax mode took true as 1 and "0.5" as 0.5); an integer field refuses 1.5
    ("completions", '{"prompt": "Hi", "temperature": true}', "temperature"),
    ("completions", '{"prompt": "Hi", "temperature": "0.5"}', "temperature"),
    ("completions", '{"prompt": "Hi", "max_tokens": true}', "max_tokens"),
    ("completions", '{"prompt": "Hi", "logprobs": true}', "logprobs"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "n": 1.5}', "n"),
    ("messages", '{"model": "SmolLM2-135M-Instruct", "max_tokens": true, '
                 '"messages": [{"role": "user", "content": "Hi"}]}', None),
    # the field as the request spelled it, not the gRPC API's name (found by the breaker)
    ("chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2147483648}',
     "max_completion_tokens"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "logprobs": true, '
                         '"top_logprobs": 2147483648}', "top_logprobs"),
    ("responses", '{"input": "Hi", "max_output_tokens": 0}', "max_output_tokens"),
    ("responses", '{"input": []}', "input"),
    ("completions", '{"prompt": "Hi", "stream_options": {"include_usage": true}}', "stream_options"),
    ("responses", '{"input": "Hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}', "tools"),
    ("responses", '{"input": "Hi", "tools": [{"type": "function", "name": 5}]}', "tools"),
    ("responses", '{"input": "Hi", "tools": [{"type": "function", "name": "f", "cache_control": {}}]}', "tools"),
    # (found by the breaker: 500s; a path from the server's root)
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/embeddings", '{"input": ["a\\ud800b"]}', "input"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "cache_salt": "a\\ud800b"}', "cache_salt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "x\\udc00": 1}', "x\\udc00"),
    ("/v1/embeddings", '{"input": "Hi", "priority": 2147483648}', "priority"),
    ("/v1/responses", '{"input": [{"role": ["user"], "content": "x"}], "max_output_tokens": 2}', "input"),
    ("/v1/responses", '{"input": [{"role": {"a": 1}, "content": "x"}], "stream": true}', "input"),
    ("/detokenize", '{"tokens": [true]}', "tokens"),
    ("/tokenize", '{"messages": [{"role": "wizard", "content": "Hi"}]}', "messages"),
]  # fmt: skip


ASK = [{"role": "user", "content": "Hi"}]
MESSAGE_CASES = [  # (endpoint, body, what the 400's message holds)
    # a finite JSON number that the gRPC API's float32 fields would turn into inf: the value sent is quoted
    ("completions", {"prompt": "Hi", "temperature": 1e308}, "temperature is out of range: 1e+308"),
    ("completions", {"prompt": "Hi", "repetition_penalty": 1e308}, "repetition_penalty is out of range: 1e+308"),
    ("chat/completions", {"messages": ASK, "top_p": 1e308}, "top_p is out of range: 1e+308"),
    ("responses", {"input": "Hi", "temperature": 1e308}, "temperature is out of range: 1e+308"),
    ("messages", {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "messages": ASK, "top_p": 1e308},
     "top_p is out of range: 1e+308"),
    # inside a union: the nested field the value broke, not pydantic's branch tags (messages.0.content.str)
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text: "),
    ("chat/completions", {"messages": ASK, "tool_choice": {"type": "function"}},
     "tool_choice.function: Field required"),
    ("messages", {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "x", "is_error": "true"}]}]},
     "messages.0.content.0.is_error: "),
]  # fmt: skip


@pytest.mark.parametrize("endpoint,body,words", MESSAGE_CASES, ids=[f"{i}" for i in range(len(MESSAGE_CASES))])
def test_http_refusals_say_what_was_sent_and_where(cluster, endpoint, body, words):
    r = httpx.post(f"{cluster.openai_base_url}/{endpoint}", json=body, timeout=120)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("endpoint,body,param", HTTP_CASES, ids=[f"{i}" for i in range(len(HTTP_CASES))])
def test_http_hostile_bodies_are_400_naming_the_field(cluster, endpoint, body, param):
    url = cluster.openai_base_url.removesuffix("/v1") + endpoint if endpoint.startswith("/") else \
        f"{cluster.openai_base_url}/{endpoint}"
    r = httpx.post(url, content=body, timeout=120,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, (body[:200], r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["message"], error
    if param is not None:
        assert error["param"] == param, (body[:200], error)
    _still_serving(cluster)
