"""Tool calling for both public APIs (OpenAI's tools, tool_choice and parallel_tool_calls; vLLM's
--tool-call-parser): the tools checked, handed to the chat template as transformers does, the parser chosen, and
tool_choice "required" or a named function enforced on the structured-output engine, so even a small model
writes a valid call. The parsers themselves are tool_parsers.py.

- auto (the default when tools are given): the model writes what it wants; its answer is parsed in its family's
  format, and plain text when it holds no call.
- none: the tools still reach the template (as OpenAI and vLLM do), the answer is not parsed.
- required / a named function: the answer is constrained to the JSON schema of `{"name": <a tool's name, or the
  named one>, "arguments": <that tool's parameters schema>}` (an array of one or more of them when
  parallel_tool_calls is true and the choice is "required"), parsed with the json parser.

A chat template that never mentions tools cannot show them to the model; then they go in a system message of our
own (TOOLS_PROMPT) that asks for the json format, and the json parser reads the answer.
"""
from __future__ import annotations

import json
import re

from tandem.services.gateway.tool_parsers import PARSERS
from tandem.shared.errors import InvalidRequestError
from tandem.v1 import common_pb2, gateway_pb2

MAX_TOOLS = 128  # tools per request (OpenAI's documented limit)
MAX_TOOLS_CHARS = 256 * 1024  # the tools' names, descriptions and schemas together (as a structured output's)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names
TOOLS_PROMPT = ("You can call these tools (JSON schemas of their parameters):\n{tools}\nTo call tools, answer with "
                'only a JSON array of calls, each {{"name": <tool name>, "arguments": <object>}}; otherwise answer '
                "normally.")  # fmt: skip


def check_tools(chat: gateway_pb2.ChatMessages) -> list[dict]:
    """chat's tools as the chat template takes them ([{"type": "function", "function": {name, description,
    parameters}}]); InvalidRequestError naming the field: more than MAX_TOOLS, a bad or repeated name, parameters
    that are not a JSON schema object, more than MAX_TOOLS_CHARS in all, a tool_choice naming no tool."""
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools has {len(chat.tools)} entries; at most {MAX_TOOLS}")
    size = sum(len(t.name) + len(t.description) + len(t.parameters_json) for t in chat.tools)
    if size > MAX_TOOLS_CHARS:
        raise InvalidRequestError(f"tools has {size} characters of names, descriptions and schemas; at most "
                                  f"{MAX_TOOLS_CHARS}")  # fmt: skip
    tools, names = [], set()
    for i, tool in enumerate(chat.tools):
        if not NAME.fullmatch(tool.name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                      f"got {tool.name[:80]!r}")  # fmt: skip
        if tool.name in names:
            raise InvalidRequestError(f"tools[{i}].function.name {tool.name!r} is given twice")
        names.add(tool.name)
        parameters = {"type": "object", "properties": {}}
        if tool.parameters_json:
            try:
                parameters = json.loads(tool.parameters_json)
            except (ValueError, RecursionError) as e:
                raise InvalidRequestError(f"tools[{i}].function.parameters is not valid JSON: {e}") from None
            if not isinstance(parameters, dict):
                raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
            if parameters.get("type", "object") != "object":
                raise InvalidRequestError(f"tools[{i}].function.parameters must describe an object (the arguments), "
                                          f"not {str(parameters.get('type'))[:40]!r}")  # fmt: skip
        function = {"name": tool.name, "parameters": parameters}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    if chat.tool_choice == gateway_pb2.TOOL_CHOICE_FUNCTION and chat.tool_choice_function not in names:
        raise InvalidRequestError(f"tool_choice names the function {chat.tool_choice_function[:80]!r}, which is not "
                                  "in tools")  # fmt: skip
    if chat.tool_choice in (gateway_pb2.TOOL_CHOICE_REQUIRED, gateway_pb2.TOOL_CHOICE_FUNCTION) and not tools:
        raise InvalidRequestError("tool_choice asks for a tool call but tools is empty")
    return tools


def template_mentions_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list (Hermes, Qwen, Llama 3.1+, Mistral do)."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in texts)


def template_parser(tokenizer) -> str:
    """The tool-call format the chat template asks for: hermes (<tool_call>), mistral ([TOOL_CALLS]),
    llama3_json (<|python_tag|> / "parameters"), else json (also for a template without tools: TOOLS_PROMPT)."""
    template = tokenizer.chat_template
    text = " ".join(template.values()) if isinstance(template, dict) else template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "json"


def render_messages(chat: gateway_pb2.ChatMessages, tools: list[dict], tokenizer) -> tuple[list[dict], dict]:
    """The chat turns and the extra arguments of apply_chat_template: assistant tool_calls with their arguments
    as objects (as HF templates expect), tool results with their tool_call_id; tools in tools= or, when the
    template cannot show them, in a TOOLS_PROMPT system message (tool calls and results then written as text)."""
    native = template_mentions_tools(tokenizer)
    messages = []
    for i, m in enumerate(chat.messages):
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.arguments or "{}")
                except (ValueError, RecursionError):
                    raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid "
                                              "JSON") from None  # fmt: skip
                calls.append({"id": call.id, "type": "function", "function": {"name": call.name,
                                                                              "arguments": arguments}})
            if native:
                message["tool_calls"] = calls
            else:
                message["content"] = (m.content + "\n" if m.content else "") + json.dumps(
                    [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls])
        if m.role == "tool":
            if native:
                message["tool_call_id"] = m.tool_call_id
            else:
                message = {"role": "user", "content": f"Result of tool call {m.tool_call_id}: {m.content}"}
        messages.append(message)
    if not tools:
        return messages, {}
    if native:
        return messages, {"tools": tools}
    listing = json.dumps([t["function"] for t in tools], indent=1)
    prompt = TOOLS_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}


def tool_choice_constraint(chat: gateway_pb2.ChatMessages, tools: list[dict]) -> common_pb2.StructuredOutput | None:
    """The JSON schema a required or named tool_choice constrains the answer to (the module's docstring)."""
    if chat.tool_choice not in (gateway_pb2.TOOL_CHOICE_REQUIRED, gateway_pb2.TOOL_CHOICE_FUNCTION):
        return None
    chosen = [t["function"] for t in tools if chat.tool_choice == gateway_pb2.TOOL_CHOICE_REQUIRED
              or t["function"]["name"] == chat.tool_choice_function]  # fmt: skip
    # Each tool's schema moves to $defs/tool_<i> of the whole, its own references ("#/$defs/City", "#")
    # rewritten to point inside it there, so schemas with $defs and recursion (pydantic's, zod's) keep working
    defs = {f"tool_{i}": _rebased(f["parameters"], f"#/$defs/tool_{i}") for i, f in enumerate(chosen)}
    calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": f["name"]}, "arguments": {"$ref": f"#/$defs/tool_{i}"}}}
             for i, f in enumerate(chosen)]  # fmt: skip
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    schema = {"type": "array", "items": one, "minItems": 1} if (
        parallel and chat.tool_choice == gateway_pb2.TOOL_CHOICE_REQUIRED) else dict(one)  # fmt: skip
    schema["$defs"] = defs
    return common_pb2.StructuredOutput(json_schema=json.dumps(schema))


def _rebased(node, base: str):
    """A copy of a schema whose local references ("#...") point under base instead of its root."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in node.items()}  # fmt: skip
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


def tool_parser_for(chat: gateway_pb2.ChatMessages, tools: list[dict], tokenizer, configured: str) -> str | None:
    """The parser of this request's answers: None without tools or with tool_choice none; json when the choice
    constrains the answer or the template cannot show tools; else configured (--tool-call-parser), whose
    "auto" reads the template (template_parser)."""
    if not tools or chat.tool_choice == gateway_pb2.TOOL_CHOICE_NONE:
        return None
    if chat.tool_choice != gateway_pb2.TOOL_CHOICE_AUTO or not template_mentions_tools(tokenizer):
        return "json"
    return template_parser(tokenizer) if configured == "auto" else configured


def check_parser(name: str) -> str:
    """--tool-call-parser's value: auto or one of tool_parsers.PARSERS. ValueError otherwise."""
    if name != "auto" and name not in PARSERS:
        raise ValueError(f"--tool-call-parser must be auto or one of {', '.join(PARSERS)}, got {name!r}")
    return name
