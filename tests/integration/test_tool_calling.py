"""Tool calling through the cluster (the shared test cluster, the default model), over the OpenAI API with the
official client and over gRPC. SmolLM2's chat template shows no tools, so they reach the model in the gateway's
own system message and answers are read with the json parser (tool_calls.py); the other formats' parsing is
tests/unit/test_tool_parsers.py. Checked: tool_choice required and a named function always give calls that
validate against the tools' schemas (the grammar enforces them), streamed deltas add up to the whole answer,
auto parses what the model writes (the same text a tool_choice none request gets), a history with tool calls
and results renders, and bad input is a 400 naming its field."""
import json

import jsonschema
import openai
import pytest

from tandem.services.client import build_request, generate
from tandem.services.gateway.tool_parsers import parse
from tandem.v1 import gateway_pb2

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris and what time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused", max_retries=0, timeout=300)


def ask(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", ASK), tools=TOOLS,
                                          max_tokens=fields.pop("max_tokens", 80), temperature=0, **fields)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_required_and_named_choices_give_valid_calls(client):
    r = ask(client, tool_choice="required")
    calls = calls_of(r.choices[0].message)
    assert r.choices[0].finish_reason == "tool_calls" and calls and r.choices[0].message.content is None
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.id.startswith("call_") and c.type == "function" for c in r.choices[0].message.tool_calls)
    r = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (name, arguments), = calls_of(r.choices[0].message)
    assert name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(arguments, TIME)
    r = ask(client, tool_choice="required", parallel_tool_calls=False)
    assert len(calls_of(r.choices[0].message)) == 1


def test_schemas_with_defs_are_enforced_and_a_cut_call_is_not_a_tool_call(client):
    """pydantic-style $defs references resolve inside the enforced call; a stop string that cuts the call short
    leaves finish_reason "stop" (its arguments are not whole JSON)."""
    city = {"$defs": {"City": {"type": "string", "maxLength": 20}}, "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                       max_tokens=64, temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    for name, arguments in calls_of(r.choices[0].message):
        assert name == "get_weather" and isinstance(arguments["city"], str)
    cut = ask(client, tool_choice="required", stop=["city"])
    assert cut.choices[0].finish_reason == "stop"


def test_streamed_calls_add_up_to_the_whole_answer(client):
    whole = ask(client, tool_choice="required")
    chunks = list(ask(client, tool_choice="required", stream=True))
    names, arguments, ids, finish = {}, {}, {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        assert not choice.delta.content
        for call in choice.delta.tool_calls or ():
            if call.id:
                ids[call.index], names[call.index] = call.id, call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    assert streamed == calls_of(whole.choices[0].message)
    assert len(chunks) > len(streamed) + 2, "the arguments came in one piece, not as they were generated"


def test_auto_reads_what_the_model_writes(client):
    plain = ask(client, tool_choice="none")  # (the same prompt: tools are shown either way)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    auto = ask(client)
    content, calls = parse("json", plain.choices[0].message.content)
    assert auto.choices[0].message.content == content
    assert calls_of(auto.choices[0].message) == [(c.name, json.loads(c.arguments)) for c in calls]


def test_a_history_with_tool_calls_and_results_is_answered(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]  # fmt: skip
    r = ask(client, messages=history, tool_choice="none", max_tokens=16)
    assert r.choices[0].message.content and r.usage.prompt_tokens > ask(client, max_tokens=1).usage.prompt_tokens


def grpc_tool_request(choice: int, function: str = "") -> gateway_pb2.GenerateRequest:
    """The gRPC API's form of ask(): TOOLS, greedy, this tool_choice."""
    request = build_request(messages=ASK, max_tokens=80, temperature=0.0)
    for tool in TOOLS:
        f = tool["function"]
        request.chat.tools.add(name=f["name"], description=f["description"],
                               parameters_json=json.dumps(f["parameters"]))
    request.chat.tool_choice, request.chat.tool_choice_function = choice, function
    return request


def test_grpc_answers_carry_the_calls(cluster):
    out = generate(cluster.gateway_address, grpc_tool_request(gateway_pb2.TOOL_CHOICE_FUNCTION, "get_weather"),
                   timeout=300)  # fmt: skip
    assert out.finish_reason == "tool_calls"
    call = json.loads(out.text)
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER)


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot combine"),
    ({"tool_choice": "required", "tools": []}, "tool_choice", "needs tools"),
    ({"chat_template_kwargs": {"add_vision_id": True}}, "chat_template_kwargs", "only enable_thinking"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
      "tool_choice": "required"}, "tools", ""),
])  # fmt: skip
def test_bad_tool_fields_are_a_400_naming_them(client, fields, param, words):
    body = {"tools": TOOLS} | fields
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
