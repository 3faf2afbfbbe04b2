"""Tool-call parsers: a model's answer split into content and tool calls, whole (parse) or as it streams
(ToolCallStream), for the formats of the families we serve (vLLM's tool parsers of the same names):

- hermes (Hermes 2/3, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  after optional content;
- llama3_json (Llama 3.1-3.3): an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects
  separated by ";", from the start of the answer;
- mistral: an optional `[TOOL_CALLS]`, then a JSON array of `{"name": ..., "arguments": {...}}`, from the start;
- json (any model; what a `required` or named tool_choice is constrained to, tool_calls.py): the whole answer is
  one `{"name": ..., "arguments": {...}}` object or an array of them.

A call's arguments are the JSON text the model wrote for them, exactly (streamed as it comes: the argument
deltas of a call add up to its arguments). An answer that does not have the format's shape is content. Only
the JSON scanning here is hand-written (it must work on a prefix); no grammar is involved.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral", "json")
HERMES_START = "<tool_call>"


@dataclass(slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (all of it once complete); id: OpenAI's."""

    name: str
    arguments: str
    complete: bool = True
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


# -- JSON on a prefix ----------------------------------------------------------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at text[i], or None when text ends inside it. Strings,
    escapes and nesting are followed; the value is not validated (json.loads does that once complete)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if text[i] in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false, null: ends at a delimiter
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


@dataclass(slots=True)
class ScannedCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' text so far (complete when end is set)
    end: int | None  # index after the object's closing brace; None while it goes on
    valid: bool = True  # False: an object that is not a call (another first key, bad JSON)


def scan_call(text: str, i: int, arguments_key: str) -> ScannedCall:
    """The call object starting at text[i] ("{"), as far as text goes: {"name": "...", "<arguments_key>": {...}}
    in either order; other keys make it no call."""
    call = ScannedCall(None, "", None)
    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            call.end = j + 1
            call.valid = call.name is not None and (call.arguments != "" or arguments_key == "")
            return call
        key_end = value_end(text, j) if text[j] == '"' else -1
        if key_end == -1:
            call.valid = False
            return call
        if key_end is None:
            return call
        key = text[j + 1 : key_end - 1]
        if key not in ("name", arguments_key):
            call.valid = False
            return call
        j = _skip_ws(text, key_end)
        if j >= len(text):
            return call
        if text[j] != ":":
            call.valid = False
            return call
        start = _skip_ws(text, j + 1)
        end = value_end(text, start)
        if key == "name":
            if end is None:
                return call
            try:
                call.name = json.loads(text[start:end])
            except ValueError:
                call.valid = False
                return call
            if not isinstance(call.name, str):
                call.valid = False
                return call
        else:
            if start < len(text) and text[start] != "{":
                call.valid = False
                return call
            call.arguments = text[start:end] if end is not None else text[start:]
            if end is None:
                return call
        j = _skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = _skip_ws(text, j + 1)
    return call


# -- the formats ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Parsed:
    """content: the answer's text outside tool calls (None when there are calls and nothing else); calls;
    undecided: the answer may still turn out to be a call (streaming holds its text back)."""

    content: str
    calls: list[ScannedCall]
    undecided: bool = False


def parse_prefix(parser: str, text: str) -> Parsed:
    """What text, an answer or its prefix so far, holds in parser's format."""
    if parser == "hermes":
        return _parse_hermes(text)
    start = _skip_ws(text, 0)
    marker = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}.get(parser)
    marked = bool(marker) and text.startswith(marker, start)
    if marked:
        start = _skip_ws(text, start + len(marker))
    elif marker and marker.startswith(text[start:]) and start < len(text):
        return Parsed("", [], undecided=True)
    if start >= len(text):
        return Parsed("" if marked else text, [], undecided=True)
    key = "parameters" if parser == "llama3_json" else "arguments"
    if text[start] == "[" and parser in ("mistral", "json"):
        calls, j = _scan_calls(text, _skip_ws(text, start + 1), key, ",")
        if calls is None or j >= len(text):
            return Parsed(text, []) if calls is None else Parsed("", calls)
        done = text[j] == "]" and calls and _skip_ws(text, j + 1) == len(text)
        return Parsed("", calls) if done else Parsed(text, [])
    if text[start] == "{" and parser in ("llama3_json", "json"):
        calls, j = _scan_calls(text, start, key, ";" if parser == "llama3_json" else None)
        if calls is None:
            return Parsed(text, [])
        return Parsed("", calls) if j >= len(text) else Parsed(text, [])
    return Parsed(text, [])


def _scan_calls(text: str, j: int, key: str, separator: str | None) -> tuple[list[ScannedCall] | None, int]:
    """The call objects from text[j] on, each followed by an optional separator: (calls, the index after them),
    (calls, len(text)) when text ends inside one, (None, j) when an object is not a call."""
    calls = []
    while j < len(text) and text[j] == "{":
        call = scan_call(text, j, key)
        if not call.valid:
            return None, j
        calls.append(call)
        if call.end is None:
            return calls, len(text)
        j = _skip_ws(text, call.end)
        if separator is not None and j < len(text) and text[j] == separator:
            j = _skip_ws(text, j + 1)
    return calls, j


def _parse_hermes(text: str) -> Parsed:
    at = text.find(HERMES_START)
    if at == -1:  # (a tail that may begin the tag is held back while streaming)
        hold = next((k for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                     if HERMES_START.startswith(text[-k:])), 0)  # fmt: skip
        return Parsed(text[: len(text) - hold], [], undecided=hold > 0)
    content, calls, j = text[:at], [], at
    while j < len(text):
        if not text.startswith(HERMES_START, j):
            break
        k = _skip_ws(text, j + len(HERMES_START))
        if k >= len(text):
            break
        call = scan_call(text, k, "arguments") if text[k] == "{" else ScannedCall(None, "", None, valid=False)
        if not call.valid:
            return Parsed(text, [])
        calls.append(call)
        if call.end is None:
            break
        j = _skip_ws(text, call.end)
        if text.startswith("</tool_call>", j):
            j = _skip_ws(text, j + len("</tool_call>"))
    return Parsed(content, calls)


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (content, tool calls). Content is None when there are calls and only whitespace
    besides; a call cut short (max_tokens) keeps the arguments it has, complete False."""
    parsed = parse_prefix(parser, text)
    calls = [ToolCall(c.name, c.arguments, c.end is not None and _is_json(c.arguments))
             for c in parsed.calls if c.name is not None]  # fmt: skip
    if not calls:
        return text, []
    return (parsed.content if parsed.content.strip() else None), calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


class ToolCallStream:
    """An answer's text deltas in -> OpenAI's chat deltas out: content deltas, and tool_calls deltas (a call's
    first delta has its index, id, type and name; the ones after carry more of its arguments). Whatever the
    deltas, what it sends adds up to parse()'s result on the whole text."""

    def __init__(self, parser: str):
        self.parser, self.text = parser, ""
        self.content_sent = 0
        self.calls_sent: list[tuple[str, int]] = []  # (id, characters of arguments sent) per call begun

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        """The chat deltas for delta (final: the answer is complete, hold nothing back)."""
        self.text += delta
        parsed = parse_prefix(self.parser, self.text)
        out = []
        calls = [c for c in parsed.calls if c.name is not None]
        content = self.text if final and parsed.undecided and not calls else parsed.content
        # (trailing whitespace waits: before a call, whitespace alone is no content, as parse() says)
        safe = len(content) if final or calls else len(content.rstrip())
        if calls and not content.strip():
            safe = self.content_sent
        if safe > self.content_sent:
            out.append({"content": content[self.content_sent : safe]})
            self.content_sent = safe
        for index, call in enumerate(calls):
            if index == len(self.calls_sent):
                call_id = "call_" + uuid.uuid4().hex[:24]
                self.calls_sent.append((call_id, 0))
                out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})  # fmt: skip
            call_id, sent = self.calls_sent[index]
            if len(call.arguments) > sent:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent:]}}]})
                self.calls_sent[index] = (call_id, len(call.arguments))
        return out

    @property
    def num_calls(self) -> int:
        return len(self.calls_sent)
