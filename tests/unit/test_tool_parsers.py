"""The tool-call parsers (services/gateway/tool_parsers.py) and the reasoning split (services/gateway/reasoning.py):
each format's answers whole and streamed in random pieces (what a stream sends adds up to the whole parse),
answers that only look like calls, hostile text (fuzzed), and tool checks, template rendering and the
constraint a required or named tool_choice compiles to (tool_calls.py), fuzzed with hostile schemas."""
import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.services.gateway.reasoning import ReasoningStream, split_prefix, split_reasoning
from tandem.services.gateway.tool_calls import (check_tools, render_messages, template_parser,
                                                tool_choice_constraint)
from tandem.services.gateway.tool_parsers import PARSERS, ToolCallStream, parse
from tandem.shared.errors import InvalidRequestError
from tandem.shared.structured_output import check_grammar
from tandem.shared.request import StructuredOutputParams
from tandem.v1 import gateway_pb2
from tests.passes import fuzz_settings

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# parser -> [(answer, expected content, expected [(name, arguments)])]
CASES = {
    "hermes": [
        ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>{"arguments": {"q": "a \\"}\\" b"}, "name": "search"}</tool_call>',
         "Let me look.\n", [("weather", '{"city": "Paris"}'), ("search", '{"q": "a \\"}\\" b"}')]),
        ("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", None, [("f", "{}")]),
        ("Plain text with a <tool but no call.", "Plain text with a <tool but no call.", []),
        ('<tool_call>{"nom": "f"}</tool_call>', '<tool_call>{"nom": "f"}</tool_call>', []),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": "}"}]}}; {"name": "g", "parameters": {}}', None,
         [("f", '{"a": [1, {"b": "}"}]}'), ("g", "{}")]),
        ('{"name": "f", "parameters": {"x": 1}}', None, [("f", '{"x": 1}')]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('The JSON is {"name": "f"}', 'The JSON is {"name": "f"}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "c"}}]', None,
         [("f", '{"a": 1}'), ("g", '{"b": "c"}')]),
        ("[1, 2, 3]", "[1, 2, 3]", []),
    ],
    "json": [
        ('{"name": "weather", "arguments": {"city": "Oslo"}}', None, [("weather", '{"city": "Oslo"}')]),
        ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": null}}]', None,
         [("a", "{}"), ("b", '{"n": null}')]),
        ('{"name": 3, "arguments": {}}', '{"name": 3, "arguments": {}}', []),
        ("Sure! It is sunny.", "Sure! It is sunny.", []),
    ],
}  # fmt: skip


def streamed(parser: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) that a ToolCallStream sends for text cut into random pieces."""
    stream, deltas, i = ToolCallStream(parser), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        deltas += stream.feed(text[i : i + k])
        i += k
    deltas += stream.feed("", final=True)
    content, names, arguments = "", {}, {}
    for d in deltas:
        content += d.get("content", "")
        for call in d.get("tool_calls", []):
            index = call["index"]
            if "id" in call:
                assert index not in names and call["id"].startswith("call_") and call["type"] == "function"
                names[index] = call["function"]["name"]
            arguments[index] = arguments.get(index, "") + call["function"]["arguments"]
    return content, [(names[i], arguments[i]) for i in sorted(names)]


@pytest.mark.parametrize("parser,text,content,calls", [(p, *c) for p, cases in CASES.items() for c in cases])
def test_each_format_whole_and_streamed(parser, text, content, calls):
    got_content, got_calls = parse(parser, text)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.complete for c in got_calls)
    rng = random.Random(0)
    for _ in range(20):
        assert streamed(parser, text, rng) == ((content or "") if calls else text, calls)


def test_a_call_cut_short_keeps_what_it_has():
    content, calls = parse("hermes", '<tool_call>{"name": "f", "arguments": {"city": "Par')
    assert content is None and [(c.name, c.arguments, c.complete) for c in calls] == [("f", '{"city": "Par', False)]


PIECES = list('{}[]":,; \\abnx<>/_|') + ["<tool_call>", "</tool_call>", '"name"', '"arguments"', '"parameters"',
                                         "[TOOL_CALLS]", "<|python_tag|>"]


@given(st.lists(st.sampled_from(PIECES), max_size=60).map("".join), st.sampled_from(PARSERS),
       st.randoms(use_true_random=False))
@fuzz_settings(200)
def test_hostile_text_never_breaks_a_parser(text, parser, rng):
    content, calls = parse(parser, text)
    assert calls or content == text
    assert streamed(parser, text, rng) == ((content or "") if calls else text, [(c.name, c.arguments) for c in calls])


# -- reasoning -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("qwen3", "<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4.", "First, 2 + 2.", "It is 4."),
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", None, "It is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("qwen3", "It is 4 </think> really", None, "It is 4 </think> really"),
    ("deepseek_r1", "First, 2 + 2.\n</think>\n\nIt is 4.", "First, 2 + 2.", "It is 4."),
    ("deepseek_r1", "<think>Hmm</think>It is 4.", "Hmm", "It is 4."),
    ("deepseek_r1", "Still thinking when max_tokens came", "Still thinking when max_tokens came", ""),
])  # fmt: skip
def test_reasoning_is_split_whole_and_streamed(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)
    whole = split_prefix(parser, text, final=True)[:2]
    rng = random.Random(1)
    for _ in range(20):
        stream, got, i = ReasoningStream(parser), ["", ""], 0
        while i < len(text):
            k = rng.randint(1, 5)
            for j, part in enumerate(stream.feed(text[i : i + k])):
                got[j] += part
            i += k
        for j, part in enumerate(stream.feed("", final=True)):
            got[j] += part
        assert tuple(got) == whole


# -- tools, templates and tool_choice ------------------------------------------------------------------------
def chat(tools=(), choice=gateway_pb2.TOOL_CHOICE_AUTO, function="", parallel=None, messages=()):
    c = gateway_pb2.ChatMessages(tool_choice=choice, tool_choice_function=function, messages=list(messages))
    for name, parameters in tools:
        c.tools.add(name=name, description=f"the {name} tool", parameters_json=json.dumps(parameters))
    if parallel is not None:
        c.parallel_tool_calls = parallel
    return c


@pytest.mark.parametrize("tools,choice,function,words", [
    ([("a b", {})], gateway_pb2.TOOL_CHOICE_AUTO, "", r"tools\[0\].function.name must be"),
    ([("f", {}), ("f", {})], gateway_pb2.TOOL_CHOICE_AUTO, "", r"tools\[1\].function.name 'f' is given twice"),
    ([("f", [1])], gateway_pb2.TOOL_CHOICE_AUTO, "", r"tools\[0\].function.parameters must be a JSON schema"),
    ([("f", {"type": "array"})], gateway_pb2.TOOL_CHOICE_AUTO, "", r"parameters must describe an object"),
    ([("f", {})], gateway_pb2.TOOL_CHOICE_FUNCTION, "g", "tool_choice names the function 'g'"),
    ([], gateway_pb2.TOOL_CHOICE_REQUIRED, "", "tools is empty"),
    ([(f"f{i}", {}) for i in range(129)], gateway_pb2.TOOL_CHOICE_AUTO, "", "at most 128"),
])  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(tools, choice, function, words):
    with pytest.raises(InvalidRequestError, match=words):
        check_tools(chat(tools, choice, function))


def test_required_and_named_choices_compile_to_a_call_schema():
    tools = [("weather", WEATHER), ("time", {"type": "object", "properties": {}})]
    for choice, function, parallel, names, array in [
        (gateway_pb2.TOOL_CHOICE_REQUIRED, "", None, {"weather", "time"}, True),
        (gateway_pb2.TOOL_CHOICE_REQUIRED, "", False, {"weather", "time"}, False),
        (gateway_pb2.TOOL_CHOICE_FUNCTION, "time", None, {"time"}, False),
    ]:  # fmt: skip
        c = chat(tools, choice, function, parallel)
        schema = json.loads(tool_choice_constraint(c, check_tools(c)).json_schema)
        one = schema["items"] if array else schema
        assert (schema.get("type") == "array") == array
        alternatives = one.get("anyOf", [one])
        assert {a["properties"]["name"]["const"] for a in alternatives} == names
        check_grammar(StructuredOutputParams(json=json.dumps(schema)))  # (llguidance compiles it)
    # local references ($defs, as pydantic writes them, and recursion to the root) still resolve inside a call
    defs = {"$defs": {"City": {"type": "string"}}, "type": "object", "properties": {
        "city": {"$ref": "#/$defs/City"}, "near": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}}}
    c = chat([("weather", defs)], gateway_pb2.TOOL_CHOICE_FUNCTION, "weather")
    schema = json.loads(tool_choice_constraint(c, check_tools(c)).json_schema)
    assert schema["$defs"]["tool_0"]["properties"]["city"] == {"$ref": "#/$defs/tool_0/$defs/City"}
    assert schema["$defs"]["tool_0"]["properties"]["near"]["items"] == {"$ref": "#/$defs/tool_0"}
    check_grammar(StructuredOutputParams(json=json.dumps(schema)))
    assert tool_choice_constraint(chat(tools), check_tools(chat(tools))) is None


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                               st.sampled_from(["type", "properties", "items", "enum", "const", "anyOf", "$ref",
                                                "required", "minItems", "pattern", "x"]), inner, max_size=4),
                           max_leaves=20)  # fmt: skip


@given(JSON_VALUES)
@fuzz_settings(200)
def test_hostile_tool_schemas_are_refused_or_compiled_never_crash(parameters):
    c = chat([("f", parameters)], gateway_pb2.TOOL_CHOICE_REQUIRED)
    try:
        tools = check_tools(c)
        check_grammar(StructuredOutputParams(json=tool_choice_constraint(c, tools).json_schema))
    except InvalidRequestError:
        pass


class Tokenizer:
    def __init__(self, template):
        self.chat_template = template


def test_templates_choose_the_parser_and_how_tools_are_shown():
    assert template_parser(Tokenizer("{% for t in tools %}<tool_call>{% endfor %}")) == "hermes"
    assert template_parser(Tokenizer("{{ '[TOOL_CALLS]' }} {{ tools }}")) == "mistral"
    assert template_parser(Tokenizer("{{ '<|python_tag|>' }}{{ tools }}")) == "llama3_json"
    history = [gateway_pb2.ChatMessage(role="user", content="Weather in Paris?"),
               gateway_pb2.ChatMessage(role="assistant", tool_calls=[gateway_pb2.ToolCall(
                   id="call_1", name="weather", arguments='{"city": "Paris"}')]),
               gateway_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]  # fmt: skip
    c = chat([("weather", WEATHER)], messages=history)
    tools = check_tools(c)
    messages, extra = render_messages(c, tools, Tokenizer("{{ tools }} <tool_call>"))
    assert extra == {"tools": tools} and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    messages, extra = render_messages(c, tools, Tokenizer("{{ messages }}"))  # (no tools in the template)
    assert extra == {} and messages[0]["role"] == "system" and '"weather"' in messages[0]["content"]
    assert messages[2]["content"] == '[{"name": "weather", "arguments": {"city": "Paris"}}]'
    assert messages[3] == {"role": "user", "content": "Result of tool call call_1: sunny"}
    bad = chat([("weather", WEATHER)], messages=[gateway_pb2.ChatMessage(role="assistant", tool_calls=[
        gateway_pb2.ToolCall(id="x", name="weather", arguments="{oops")])])  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        render_messages(bad, check_tools(bad), Tokenizer("{{ tools }}"))


def test_openai_messages_and_deltas_hold_reasoning_content_and_calls():
    """The OpenAI answer (openai_responses.py) of a Qwen3-style answer: reasoning, then content and a call, whole
    and streamed."""
    from tandem.services.gateway.openai_responses import ChatDeltas, ResponseShape, chat_message

    text = ('<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')  # fmt: skip
    shape = ResponseShape(chat=True, n=1, tool_parser="hermes", reasoning_parser="qwen3")
    message = chat_message(shape, text)
    assert message["reasoning_content"] == "The user wants weather." and message["content"] == "Checking.\n"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    deltas, i, rng = ChatDeltas(shape), 0, random.Random(2)
    merged = {"reasoning_content": "", "content": "", "arguments": "", "names": []}
    while i <= len(text):
        k = rng.randint(1, 7)
        delta = deltas.feed(text[i : i + k], final=i + k >= len(text))
        i += k
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        merged["content"] += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            merged["names"] += [c["function"]["name"]] if "name" in c["function"] else []
            merged["arguments"] += c["function"].get("arguments", "")
    assert merged == {"reasoning_content": "\nThe user wants weather.\n", "content": "Checking.\n",
                      "arguments": '{"city": "Paris"}', "names": ["weather"]}  # fmt: skip
