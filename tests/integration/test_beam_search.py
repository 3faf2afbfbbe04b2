"""Beam search through the cluster against HF transformers fp32 generate(num_beams=..., num_return_sequences=...)
on the same weights: every returned beam, token for token and in HF's order, with length penalties on both
sides of 1; the prompt's KV blocks are shared through the decode's prefix cache; bad combinations are
INVALID_ARGUMENT."""
import grpc
import pytest
import torch

from tandem.services.client import Client
from tests.integration.helpers import wait_all_blocks_free
from tests.prompts import prompt_token_ids

CASES = [  # (prompt name, kind, text, beam width, max tokens, length penalty)
    ("capital", "chat", "What is the capital of France?", 2, 24, 1.0),
    ("story", "raw", "Once upon a time, in a small village by the mountains,", 4, 16, 1.0),
    ("haiku", "chat", "Write a haiku about the sea.", 3, 20, 0.5),
]


def hf_beams(hf_model, ids: list[int], width: int, max_tokens: int, length_penalty: float) -> list[list[int]]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                                max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=False)
    beams = []
    for seq in out[:, len(ids):].tolist():  # (padded with EOS after a beam's own EOS)
        beams.append(seq[: seq.index(2) + 1] if 2 in seq else seq)
    return beams


@pytest.mark.parametrize("name, kind, text, width, max_tokens, length_penalty", CASES)
def test_beams_equal_hf(cluster, tokenizer, hf_model, name, kind, text, width, max_tokens, length_penalty):
    ids = prompt_token_ids(tokenizer, kind, text)
    expected = hf_beams(hf_model, ids, width, max_tokens, length_penalty)
    sampling = dict(max_tokens=max_tokens, beam_width=width, n=width, length_penalty=length_penalty)
    with Client(cluster.gateway_address) as client:
        kwargs = {"prompt": text} if kind == "raw" else {"messages": [{"role": "user", "content": text}]}
        messages = list(client.stream(**kwargs, timeout=600, **sampling))
    beams = [[t for m in messages if m.index == i for t in m.token_ids] for i in range(width)]
    assert beams == expected
    finals = [m for m in messages if m.HasField("finish_reason")]
    assert [m.index for m in finals] == list(range(width))
    for beam, final in zip(beams, finals):
        assert final.usage.completion_tokens == len(beam)
        stop = beam[-1] == 2
        assert final.finish_reason == (2 if not stop else 1)  # LENGTH, or STOP at EOS
    texts = ["".join(m.text for m in messages if m.index == i) for i in range(width)]
    assert texts == [tokenizer.decode(b, skip_special_tokens=True) for b in beams]
    wait_all_blocks_free(cluster)


def test_beam_search_shares_the_prompt_blocks(cluster, tokenizer):
    """Every step after the first finds the prompt's full blocks (and the beams' common ones) in the decode's
    prefix cache, and a copy of its parent beam's last partial block (copy-on-write): each beam computes one token
    per step, so the decode's hits grow by every token but the last of each beam's request."""
    from tests.integration.helpers import load

    text = "Summarize: the quick brown fox jumps over the lazy dog, again and again, all day long. " * 3
    ids = prompt_token_ids(tokenizer, "raw", text)
    decode = next(addr for name, addr in cluster.addresses.items() if name.startswith("decode"))
    before = load(decode).prefix_cache_hits
    with Client(cluster.gateway_address) as client:
        client.generate(text, max_tokens=6, beam_width=2, timeout=600)
    # steps 1-5 send 2 beams each, of len(ids) + step tokens (without the partial-block copies: only the 64 tokens
    # of full blocks each)
    assert load(decode).prefix_cache_hits - before == sum(2 * (len(ids) + step - 1) for step in range(1, 6))


@pytest.mark.parametrize("fields, words", [
    ({"beam_width": 9}, "beam_width must be"),
    ({"beam_width": 2, "n": 3}, "n must be"),
    ({"beam_width": 2, "temperature": 0.7}, "temperature"),
    ({"beam_width": 2, "presence_penalty": 1.0}, "presence_penalty"),
    ({"beam_width": 2, "stop": ["x"]}, "stop"),
    ({"beam_width": 2, "logprobs": 2}, "logprobs"),
    ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty"),
    ({"beam_width": 2, "length_penalty": 1e6}, "length_penalty"),
])  # fmt: skip
def test_bad_beam_search_requests_are_invalid_argument(cluster, fields, words):
    with Client(cluster.gateway_address) as client, pytest.raises(grpc.RpcError) as e:
        list(client.stream("Hello", max_tokens=4, timeout=60, **fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_openai_use_beam_search_returns_the_same_beams(cluster):
    import openai

    name, kind, text, width, max_tokens, length_penalty = CASES[0]
    with Client(cluster.gateway_address) as client:
        messages = list(client.stream(messages=[{"role": "user", "content": text}], timeout=600, temperature=0.0,
                                      max_tokens=max_tokens, beam_width=width, n=width))  # fmt: skip
    texts = ["".join(m.text for m in messages if m.index == i) for i in range(width)]
    http = openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused")
    reply = http.chat.completions.create(model="", messages=[{"role": "user", "content": text}], n=width,
                                         max_tokens=max_tokens, temperature=0, extra_body={"use_beam_search": True})
    assert [c.message.content for c in reply.choices] == texts and len(set(texts)) == width
    one = http.chat.completions.create(model="", messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                       extra_body={"use_beam_search": True})  # (one beam: greedy, HF num_beams=1)
    greedy = http.chat.completions.create(model="", messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0)
    assert one.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("fields, param", [
    ({"n": 9}, "n"), ({"n": 2, "temperature": 0.5}, "temperature"), ({"n": 2, "stop": ["x"]}, "stop"),
    ({"n": 2, "logprobs": 1}, "logprobs"), ({"n": 2, "presence_penalty": 1.0}, "presence_penalty"),
])  # fmt: skip
def test_bad_http_beam_searches_name_their_field(cluster, fields, param):
    import httpx2 as httpx

    body = {"prompt": "Hello", "max_tokens": 4, "use_beam_search": True} | fields
    reply = httpx.post(cluster.openai_base_url + "/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.json()


def test_a_deadline_ends_a_beam_search_with_deadline_exceeded(cluster):
    with Client(cluster.gateway_address) as client, pytest.raises(grpc.RpcError) as e:
        list(client.stream("Once upon a time", max_tokens=200, beam_width=4, deadline_ms=1500, timeout=120))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_blocks_free(cluster)
