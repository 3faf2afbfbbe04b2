"""Property tests (hypothesis): random and malformed requests through both public APIs never crash a service.
Each answer is a success or a client error (gRPC INVALID_ARGUMENT / HTTP 400 or 404) whose message names the
field at fault, and after every example the cluster still answers a plain request and every KV block is free."""
import math

import grpc
import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.client import generate, make_request
from tests.integration.helpers import wait_all_blocks_free

FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "logprobs", "n", "seed", "prompt_logprobs", "beam_width",
          "length_penalty")  # fmt: skip
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

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
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_http_garbage_bodies(cluster, raw):
    r = httpx.post(cluster.openai_base_url + "/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()


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


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
