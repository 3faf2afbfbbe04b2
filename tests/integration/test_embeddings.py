"""Embeddings (last-token pooling of the final hidden state, L2-normalized) against HF transformers fp32: the
engine's pooling request in one process, then /v1/embeddings through the running cluster with the official openai
client; its refusals; /tokenize and /detokenize against the tokenizer."""
import base64

import numpy as np
import pytest
import torch

from tandem.shared.config import CacheConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import FinishReason, PoolingParams, Request, SamplingParams

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors; " * 12 + "the end."]
TOLERANCE = 1e-4
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def hf_embed(hf_model):
    """ids -> HF's final hidden state (after the final norm) at the last token, L2-normalized, fp32."""
    def embed(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden.float(), dim=-1)

    return embed


def pooling_request(request_id: str, ids: list[int]) -> Request:
    return Request(request_id, ids, SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def test_engine_pooling_request_in_chunks_beside_a_prompt(model_config, tokenizer, hf_embed):
    """Pooling requests (one longer than the step budget: chunked) batched with a sampled prompt: the pooled
    states equal HF's, no token is sampled for them, no KV is exported, every block is freed; a second run of the
    same input hits the prefix cache and still computes its last token."""
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(32, 8), export_kv=True)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert len(ids[1]) > 32
    engine.add_request(pooling_request("e0", ids[0]))
    engine.add_request(pooling_request("e1", ids[1]))
    engine.add_request(Request("g", ids[0], SamplingParams(max_tokens=1, temperature=0.0)))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != "g":
                assert not o.new_token_ids and o.kv is None
            if o.finished:
                outs[o.request_id] = o
    for i in range(2):
        out = outs[f"e{i}"]
        assert out.finish_reason == FinishReason.STOP and out.pooled.shape == (model_config.hidden_size,)
        assert torch.allclose(out.pooled, hf_embed(ids[i]), atol=TOLERANCE)
    assert len(outs["g"].new_token_ids) == 1 and outs["g"].pooled is None
    assert engine.num_free_blocks == 64 and not engine.requests
    again = pooling_request("e1-again", ids[1])
    engine.add_request(again)
    while engine.has_unfinished_requests():
        for o in engine.step():
            pooled = o.pooled
    assert again.num_cached_tokens == len(ids[1]) - 1  # (full blocks, then a copy of the partial one)
    assert torch.allclose(pooled, hf_embed(ids[1]), atol=TOLERANCE)
    assert engine.num_free_blocks == 64


def test_engine_pooling_request_takes_the_whole_context(model_config):
    """A pooling prompt may fill the model's context (no token follows it); one more token is refused."""
    engine = LLMEngine(model_config, CacheConfig(16, 8), SchedulerConfig(64, 8))
    max_len = model_config.max_model_len
    from tandem.shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(pooling_request("long", [1] * (max_len + 1)))
    assert not engine.requests


# -- through the cluster -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused", max_retries=0, timeout=300)


def post(cluster, path: str, body: dict) -> tuple[int, dict]:
    import httpx2 as httpx

    response = httpx.post(cluster.openai_base_url.removesuffix("/v1") + path, json=body, timeout=300)
    return response.status_code, response.json()


def test_embeddings_equal_hf_single_batched_and_base64(cluster, client, tokenizer, hf_embed, model_config):
    """One string, then both strings in one request (floats, then base64 decoded as little-endian float32), then
    token-id inputs (one list, and a list of lists): each equals HF's within TOLERANCE."""
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    expected = [hf_embed(x) for x in ids]
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    assert len(one.data[0].embedding) == model_config.hidden_size
    assert torch.allclose(torch.tensor(one.data[0].embedding), expected[0], atol=TOLERANCE)
    for encoding in ("float", "base64"):
        many = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in many.data] == [0, 1] and many.usage.prompt_tokens == sum(map(len, ids))
        for d, e in zip(many.data, expected):
            values = d.embedding if encoding == "float" else np.frombuffer(base64.b64decode(d.embedding), "<f4")
            assert torch.allclose(torch.tensor(values), e, atol=TOLERANCE)
    raw = post(cluster, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})[1]
    assert isinstance(raw["data"][0]["embedding"], str) and raw["data"][0]["object"] == "embedding"
    by_ids = client.embeddings.create(model=MODEL, input=ids[1])
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), expected[1], atol=TOLERANCE)
    by_lists = client.embeddings.create(model=MODEL, input=ids, dimensions=model_config.hidden_size)
    for d, e in zip(by_lists.data, expected):
        assert torch.allclose(torch.tensor(d.embedding), e, atol=TOLERANCE)


@pytest.mark.parametrize("body, param, message", [
    ({"input": ""}, "input", "input is empty"),
    ({"input": []}, "input", "input must be"),
    ({"input": ["a", ""]}, "input", "input[1] is empty"),
    ({"input": [[]]}, "input", "input is empty"),
    ({"input": [1, -2]}, "input", "input token ids must be in"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": "x", "dimensions": 64}, "dimensions", "dimensions 64"),
    ({"input": "x", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "not supported"),
    ({"input": ["x"] * 65}, "input", "at most 64"),
])
def test_embeddings_refusals_name_the_field(cluster, body, param, message):
    status, answer = post(cluster, "/v1/embeddings", body)
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_embeddings_refuse_an_input_past_the_context(cluster, client, model_config):
    import openai

    max_len = model_config.max_model_len
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, input=[[1] * (max_len + 1)])
    assert error.value.body["param"] == "input" and f"at most {max_len}" in error.value.body["message"]
    status, answer = post(cluster, "/v1/embeddings", {"input": "x", "model": "other"})
    assert status == 404 and answer["error"]["param"] == "model"


def test_tokenize_and_detokenize_round_trip(cluster, tokenizer, model_config):
    text = "Hello, tokenizer! Ünïcödé and 数字 123."
    status, answer = post(cluster, "/tokenize", {"prompt": text})
    assert status == 200, answer
    assert answer == {"count": len(tokenizer(text).input_ids), "max_model_len": model_config.max_model_len,
                      "tokens": tokenizer(text).input_ids}  # fmt: skip
    assert post(cluster, "/detokenize", {"tokens": answer["tokens"]}) == (200, {"prompt": text})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for add_generation_prompt in (True, False):
        status, answer = post(cluster, "/tokenize", {"messages": messages,
                                                     "add_generation_prompt": add_generation_prompt})
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)  # fmt: skip
        assert status == 200 and answer["tokens"] == list(expected) and answer["count"] == len(expected)
    strs = post(cluster, "/tokenize", {"prompt": "a b", "return_token_strs": True})[1]["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(tokenizer("a b").input_ids)
    assert post(cluster, "/tokenize", {})[1]["error"]["param"] == "prompt"
    status, answer = post(cluster, "/detokenize", {"tokens": [model_config.vocab_size]})
    assert status == 400 and answer["error"]["param"] == "tokens"
    status, answer = post(cluster, "/detokenize", {"tokens": "abc"})
    assert status == 400 and answer["error"]["param"] == "tokens"


def test_an_unreachable_prefill_is_routed_around(cluster, tokenizer, hf_embed):
    """Embedder's retry: the first prefill routed to listens nowhere (dead, still registered); the call goes to
    the next one (the cluster's), and the dead one is marked down."""
    import asyncio

    from tandem.services.channels import ChannelPool
    from tandem.services.gateway.embeddings import Embedder
    from tandem.services.launcher import free_port
    from tandem.shared.cluster_state.registry import InstanceInfo

    dead = InstanceInfo("dead", "prefill", f"127.0.0.1:{free_port()}", "m", 16)
    live = InstanceInfo("prefill0", "prefill", cluster.addresses["prefill0"], "m", 16)

    class Router:  # (stands in for router.Router: the dead prefill first, then the live one)
        marked_down = []

        async def route_prefill(self, prompt_ids, skip=frozenset()):
            return live if "dead" in skip else dead

        def mark_down(self, instance):
            self.marked_down.append(instance.instance_id)

    ids = tokenizer(TEXTS[0])["input_ids"]
    reply = asyncio.run(Embedder(Router(), ChannelPool()).embed("retry-test", [ids]))
    assert torch.allclose(torch.tensor(reply.embeddings[0].values), hf_embed(ids), atol=TOLERANCE)
    assert Router.marked_down == ["dead"]
