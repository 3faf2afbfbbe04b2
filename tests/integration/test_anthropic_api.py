"""Anthropic's Messages API (services/gateway/anthropic_api.py) through the shared test cluster, driven by the
official `anthropic` client: a text answer equals the OpenAI API's for the same greedy chat, streaming events add
up to it, stop sequences are reported, tool use (forced with tool_choice any / tool, and a tool_result round
trip), and refusals in Anthropic's error shape."""
import anthropic
import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
GREEDY = {"temperature": 0}  # (an older Messages API field: today's SDK passes it in extra_body)
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def client(cluster):
    return anthropic.Anthropic(base_url=cluster.openai_base_url.removesuffix("/v1"), api_key="unused",
                               max_retries=0, timeout=300)  # fmt: skip


def test_a_text_answer_equals_the_openai_apis(cluster, client):
    r = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, system="You are brief.", messages=ASK)
    oai = openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused", max_retries=0, timeout=300)
    expected = oai.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "You are brief."}] + ASK)  # fmt: skip
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == expected.choices[0].message.content
    assert r.stop_reason == ("end_turn" if expected.choices[0].finish_reason == "stop" else "max_tokens")
    assert r.usage.input_tokens == expected.usage.prompt_tokens
    assert r.usage.output_tokens == expected.usage.completion_tokens
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, system="You are brief.",
                                messages=ASK) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == r.content[0].text
        final = stream.get_final_message()
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens


def test_stop_sequences_are_reported(client):
    whole = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK).content[0].text
    word = whole.split()[2]
    r = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == whole[: whole.index(word)]


def test_tool_use_and_a_tool_result_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask, tools=TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and (streamed_use.name, streamed_use.input) == ("get_weather", use.input)
    answer = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, tools=TOOLS, messages=ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 and sunny"}]}])
    assert answer.content and answer.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("fields,words", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' is not supported"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].function.name"),
    ({"model": "claude-x"}, "does not exist"),
    ({"max_tokens": 2**31}, "max_tokens is out of range"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "$ref": "#/$defs/Nope"}}],
      "tool_choice": {"type": "any"}}, "tools"),
])  # fmt: skip
def test_refusals_come_in_anthropics_shape(client, fields, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK} | fields
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**body)
    assert e.value.body["type"] == "error" and words in e.value.body["error"]["message"], e.value.body
