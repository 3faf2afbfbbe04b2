"""OpenAI's Responses API (services/gateway/responses_api.py, the stateless subset) through the shared test
cluster, driven by the official `openai` client: a text answer equals the chat API's for the same greedy turns,
streaming events add up to the whole response, function calls (forced, streamed) and a function_call_output
round trip, text.format json_schema, max_output_tokens making the response incomplete, and refusals by name."""
import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]  # fmt: skip


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused", max_retries=0, timeout=300)


def test_a_text_response_equals_the_chat_answer_whole_and_streamed(client):
    r = client.responses.create(model=MODEL, input=ASK, instructions="You are brief.", max_output_tokens=24,
                                temperature=0, store=False)  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "You are brief."}, {"role": "user", "content": ASK}])  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model=MODEL, input=ASK, instructions="You are brief.", max_output_tokens=24,
                                          temperature=0, store=False, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_function_calls_forced_streamed_and_answered(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=64, temperature=0, store=False)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(model=MODEL, input=ask, tools=TOOLS, tool_choice={
        "type": "function", "name": "get_weather"}, max_output_tokens=64, temperature=0, store=False, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == call.arguments
    answer = client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=16, temperature=0, store=False,
                                     input=ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                                                   "arguments": call.arguments},
                                                  {"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "18 degrees and sunny"}])  # fmt: skip
    assert answer.output and answer.usage.input_tokens > r.usage.input_tokens


def test_text_format_and_max_output_tokens(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=48, temperature=0, store=False,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    cut = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, temperature=0, store=False)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_a_client_gone_before_its_answer_frees_the_request(cluster):
    import httpx2 as httpx

    from tests.integration.helpers import wait_all_blocks_free

    with pytest.raises(httpx.TimeoutException):
        httpx.post(cluster.openai_base_url + "/responses", timeout=1.5, json={
            "model": MODEL, "input": "List numbers.", "max_output_tokens": 2000, "temperature": 0,
            # (an answer that cannot end early: at least 600 numbers, some 2,000 tokens)
            "text": {"format": {"type": "json_schema", "name": "numbers", "schema": {
                "type": "array", "items": {"type": "integer"}, "minItems": 600}}}})
    loads = wait_all_blocks_free(cluster, timeout_s=15)  # (2,000 tokens would take a minute)
    assert all(l.num_free_blocks == l.num_blocks and not l.num_running for l in loads.values()), loads


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"background": True}, "background"),
    ({"max_output_tokens": 2**31}, "max_output_tokens"),
])  # fmt: skip
def test_what_is_not_served_is_refused_by_name(client, fields, param):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4} | fields
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.body["param"] == param, e.value.body
