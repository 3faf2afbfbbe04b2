"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client against a running cluster:
answers equal the gRPC API's for the same greedy request (and HF's tokens), streaming semantics, n, logprobs,
the completions API's echo and best_of, errors in OpenAI's shape, and a client that disconnects (mid-stream or
before a JSON answer) frees the request on both tiers."""
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # (the HTTP client the openai package is built on)
import openai
import pytest

from tandem.services.client import generate, make_request
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
    # a batch of prompts runs at once: prompt 1's chunks start before prompt 0's last (one after the other, never)
    chunks = list(client.completions.create(model=MODEL, prompt=[STORY, CAPITAL], max_tokens=40, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    order = [c.choices[0].index for c in chunks]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), order
    assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == 0).startswith(expected.text)


def test_sampling_parameters_reach_the_engine(cluster, client):
    """Each OpenAI name maps to its gRPC field: the HTTP answer equals the gRPC one with that field set, and
    differs from the answer without it."""
    base = {"model": MODEL, "prompt": STORY, "max_tokens": 24}
    cases = [
        ({"temperature": 1.0, "seed": 7}, {"temperature": 1.0, "seed": 7}),
        ({"temperature": 0, "presence_penalty": 2.0}, {"temperature": 0.0, "presence_penalty": 2.0}),
        ({"temperature": 0, "frequency_penalty": 2.0}, {"temperature": 0.0, "frequency_penalty": 2.0}),
        ({"temperature": 0, "extra_body": {"repetition_penalty": 1.5}},
         {"temperature": 0.0, "repetition_penalty": 1.5}),
        ({"temperature": 1.0, "seed": 7, "top_p": 0.5}, {"temperature": 1.0, "seed": 7, "top_p": 0.5}),
        ({"temperature": 1.0, "seed": 7, "extra_body": {"top_k": 2}}, {"temperature": 1.0, "seed": 7, "top_k": 2}),
        ({"temperature": 1.0, "seed": 7, "extra_body": {"min_p": 0.5}}, {"temperature": 1.0, "seed": 7, "min_p": 0.5}),
    ]  # fmt: skip

    def over_http(args: dict) -> str:
        return client.completions.create(**base, **args).choices[0].text

    def over_grpc(fields: dict) -> str:
        req = make_request(STORY, raw=True, max_tokens=24)
        for name, value in fields.items():
            setattr(req.sampling_params, name, value)
        return generate(cluster.gateway_address, req, timeout=300).text

    # all at once (the engine batches them; each answer is the same in any batch)
    with ThreadPoolExecutor(8) as pool:
        http_texts = pool.map(over_http, [{"temperature": 0}, {"temperature": 1.0, "seed": 7}] + [a for a, _ in cases])
        grpc_texts = pool.map(over_grpc, [grpc_fields for _, grpc_fields in cases])
    greedy, seeded, *texts = http_texts
    for (http_args, grpc_fields), text, grpc_text in zip(cases, texts, grpc_texts, strict=True):
        assert text == grpc_text, http_args
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
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None, error  # (not the character it failed at)
    assert error["message"].startswith("the body is not valid JSON: ") and "at character 1" in error["message"], error
    r = httpx.post(cluster.openai_base_url + "/completions", content=b'{"prompt": "Hi', timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.json()["error"]["message"] == "the body is not valid JSON: Unterminated string starting at character 11"
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


def test_echo_puts_the_prompt_first(cluster, client, tokenizer):
    expected = grpc_greedy(cluster, STORY, raw=True, max_tokens=8)
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == STORY + expected.text and r.usage.completion_tokens == 8
    ids = tokenizer(STORY, add_special_tokens=False).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + expected.text
    # streamed (vLLM's way): each choice's first chunk starts with the prompt
    chunks = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=8, temperature=0, echo=True, n=2,
                                            stream=True))  # fmt: skip
    for index in (0, 1):
        texts = [c.choices[0].text for c in chunks if c.choices[0].index == index]
        assert texts[0].startswith(STORY) and "".join(texts) == STORY + expected.text


def test_echo_with_logprobs_covers_the_prompt(cluster, client, tokenizer):
    ids = tokenizer(STORY, add_special_tokens=False).input_ids
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids] and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # the prompt's entries are the prompt logprobs the gRPC API gives, the completion's those of a plain request
    req = make_request(STORY, raw=True, max_tokens=1, temperature=0.0)
    req.sampling_params.prompt_logprobs = 2
    reference = generate(cluster.gateway_address, req, timeout=300).prompt_logprobs
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([x.logprob for x in reference], abs=1e-5)
    for top, x in zip(lp.top_logprobs[1 : len(ids)], reference):
        assert list(top) == [tokenizer.decode([t.token_id]) for t in x.top]
        assert list(top.values()) == pytest.approx([t.logprob for t in x.top], abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0, logprobs=2)
    assert lp.tokens[len(ids) :] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    # streamed: the same entries, the prompt's in the first chunk, text_offset going on across chunks
    chunks = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0, echo=True,
                                            logprobs=2, stream=True))  # fmt: skip
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert len(streamed[0].tokens) == len(ids) + 1 and streamed[0].token_logprobs[0] is None
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


BEST_OF_SEED = 5  # (its best of 4 is completion 2)


def test_best_of_returns_the_most_likely_candidates(cluster, client):
    """best_of k with a seed generates the k completions n=k with that seed generates (completion i > 0 seeded
    with seed_for(seed, i)); the answer is the best of them by cumulative logprob, which is not completion 0
    here, so a server ignoring best_of fails."""
    common = {"model": MODEL, "prompt": STORY, "max_tokens": 12, "temperature": 1.0, "seed": BEST_OF_SEED}
    everything = client.completions.create(**common, n=4, logprobs=0)
    candidates = everything.choices
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    order = sorted(range(4), key=lambda i: -scores[i])
    assert order[0] != 0 and len({c.text for c in candidates}) == 4
    best = client.completions.create(**common, best_of=4)
    assert [(c.index, c.text) for c in best.choices] == [(0, candidates[order[0]].text)]
    assert best.choices[0].logprobs is None  # (used to rank, not asked for)
    assert best.usage.completion_tokens == everything.usage.completion_tokens  # all four are billed
    assert best.usage.prompt_tokens == everything.usage.prompt_tokens
    two = client.completions.create(**common, best_of=4, n=2, logprobs=1)
    assert [(c.index, c.text) for c in two.choices] == [(i, candidates[j].text) for i, j in enumerate(order[:2])]
    assert [sum(c.logprobs.token_logprobs) for c in two.choices] == pytest.approx([scores[j] for j in order[:2]])
    assert all(len(top) == 1 for c in two.choices for top in c.logprobs.top_logprobs)
    # greedy: every candidate is the greedy answer
    greedy = client.completions.create(model=MODEL, prompt=STORY, max_tokens=8, temperature=0, best_of=3)
    assert greedy.choices[0].text == grpc_greedy(cluster, STORY, raw=True, max_tokens=8).text
    assert greedy.usage.completion_tokens == 24


@pytest.mark.parametrize("body,param,words", [
    ({"best_of": 2, "n": 3}, "best_of", "n = 3"),
    ({"best_of": 17}, "best_of", "16"),
    ({"best_of": 2, "stream": True}, "best_of", "stream"),
    ({"best_of": 2, "n": 2, "use_beam_search": True, "temperature": 0}, "best_of", "use_beam_search"),
    ({"suffix": " and they lived happily ever after."}, "suffix", "insert"),
    ({"echo": True, "max_tokens": 0}, "max_tokens", "max_tokens"),
])  # fmt: skip
def test_completions_legacy_fields_refused(cluster, client, body, param, words):
    r = httpx.post(cluster.openai_base_url + "/completions", json={"model": MODEL, "prompt": STORY} | body,
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=body.get("max_tokens", 4),
                                  extra_body={k: v for k, v in body.items() if k != "max_tokens"})  # fmt: skip


def _busy(cluster) -> bool:
    """Whether any engine instance works on something: a request running, or prefix-cache lookups (new
    requests: beam search's steps) within 0.3 s."""
    before = {name: load(addr) for name, addr in cluster.addresses.items()}
    time.sleep(0.3)
    after = {name: load(addr) for name, addr in cluster.addresses.items()}
    return any(after[n].num_running or after[n].prefix_cache_queries != before[n].prefix_cache_queries
               for n in after)  # fmt: skip


def _idle_within(cluster, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _busy(cluster):
        if time.monotonic() > deadline:
            return False
    return True


@pytest.mark.parametrize("path,body", [
    ("/completions", {"prompt": STORY, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}),
    ("/chat/completions", {"messages": [{"role": "user", "content": CAPITAL}], "max_tokens": 3000, "temperature": 0,
                           "ignore_eos": True}),
    # (length_penalty 10 favours ever longer beams: the search runs to max_tokens)
    ("/completions", {"prompt": STORY, "max_tokens": 3000, "use_beam_search": True, "n": 2, "length_penalty": 10}),
], ids=["completions", "chat", "beam_search"])  # fmt: skip
def test_disconnect_before_the_answer_frees_the_request_on_both_tiers(cluster, client, path, body):
    assert _idle_within(cluster, 30)
    with ThreadPoolExecutor(1) as pool:  # (the client gives up after 2 s without an answer and closes the socket)
        answer = pool.submit(httpx.post, cluster.openai_base_url + path, json={"model": MODEL} | body,
                             timeout=httpx.Timeout(60, read=2.0))  # fmt: skip
        time.sleep(1.0)
        assert _busy(cluster)
        with pytest.raises(httpx.ReadTimeout):
            answer.result()
    assert _idle_within(cluster, 10)  # (unaborted, it would run for minutes)
    loads = wait_all_blocks_free(cluster, timeout_s=10)
    assert all(l.num_free_blocks == l.num_blocks for l in loads.values())
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_session_header_routes_by_affinity_and_a_bad_one_is_refused(cluster, client):
    """X-Session-Id (and the gRPC API's session_id): a session's second request stays on its pair (counted as
    reason="session_affinity"); a bad key is a 400 naming the header, on every endpoint (INVALID_ARGUMENT)."""
    import grpc

    base = cluster.openai_base_url.removesuffix("/v1")

    def stayed() -> float:
        text = httpx.get(base + "/metrics", timeout=60).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem:router_decisions_total{") and 'reason="session_affinity"' in line)

    before = stayed()
    for _ in range(2):
        r = client.with_options(default_headers={"X-Session-Id": "conv-42"}).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CAPITAL}], max_tokens=4, temperature=0)
        assert r.choices[0].message.content
    assert stayed() > before  # (the second request kept the first one's pair)
    chat = {"messages": [{"role": "user", "content": CAPITAL}], "max_tokens": 4}
    for path, body in (("/chat/completions", chat), ("/completions", {"prompt": STORY, "max_tokens": 4}),
                       ("/responses", {"input": CAPITAL, "max_output_tokens": 4})):  # fmt: skip
        for bad in ("has space", "x" * 257, "caf\u00e9"):
            r = httpx.post(cluster.openai_base_url + path, json=body, timeout=60,
                           headers={"X-Session-Id": bad.encode()})  # fmt: skip
            assert r.status_code == 400, (path, bad, r.text)
            assert r.json()["error"]["param"] == "X-Session-Id" and "X-Session-Id" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": CAPITAL}]},
                   headers={"X-Session-Id": "has space"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "X-Session-Id" in r.text, r.text
    assert generate(cluster.gateway_address, make_request(CAPITAL, max_tokens=4, session_id="conv-42"),
                    timeout=300).text  # fmt: skip
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.gateway_address, make_request(CAPITAL, max_tokens=4, session_id=""), timeout=300)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in e.value.details()
