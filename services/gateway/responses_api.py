"""OpenAI's Responses API, its stateless subset: POST /v1/responses (OpenAI's API reference, "Responses"), whole
or streamed in the Responses event vocabulary, translated into the same chat request as /v1/chat/completions
(one pipeline, one chat template, the tool calling of tool_calls.py).

Supported: input as a string or items (messages with input_text / output_text parts, function_call and
function_call_output items; reasoning items are accepted and not shown to the model, as chat templates drop
earlier reasoning), instructions, function tools, tool_choice, parallel_tool_calls, text.format (text,
json_object, json_schema: structured output), max_output_tokens, temperature, top_p, metadata (echoed), user,
and store false. Nothing is stored: store true is refused (so are previous_response_id and conversation, which
need stored state), and so are background, include, built-in tools (web search, file search, ...), images and
files in input, and every other field, each by name.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field

from tandem.services.gateway.chat_endpoint import ChatEndpoint
from tandem.services.gateway.openai_errors import APIError, api_error, counted
from tandem.services.gateway.openai_protocol import TOOL_CHOICES, Body, set_fields
from tandem.services.gateway.openai_responses import ChatDeltas, ResponseShape, answer_parts
from tandem.v1 import common_pb2, gateway_pb2

TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesTool(Body):
    """A tools[] entry: a function tool's fields typed (strictly, as the rest of the body); other tool types (web
    search, file search, ...) are refused by chat_messages, naming their type."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(Body):
    model_config = ConfigDict(extra="allow")  # (fields OpenAI defines that we do not serve: refused by name)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of parts", "input")
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{i}].type {kind!r} is not supported (text parts only)", "input")
    return "".join(str(part.get("text", "")) for part in content)


def chat_messages(body: ResponsesRequest) -> gateway_pb2.ChatMessages:
    """The body as the gRPC API's ChatMessages (the module's docstring says what is taken)."""
    chat = gateway_pb2.ChatMessages()
    if body.instructions:
        chat.messages.add(role="system", content=body.instructions)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            role = {"developer": "system"}.get(role, role) if isinstance(role, str) else None
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", "input")
            chat.messages.add(role=role, content=_content_text(item.get("content", ""), f"{where}.content"))
        elif kind == "function_call":
            last = chat.messages[-1] if chat.messages else None
            if last is None or last.role != "assistant" or (last.content and not last.tool_calls):
                last = chat.messages.add(role="assistant")
            last.tool_calls.add(id=str(item.get("call_id", "")), name=str(item.get("name", "")),
                                arguments=str(item.get("arguments", "{}")))  # fmt: skip
        elif kind == "function_call_output":
            output = item.get("output", "")
            chat.messages.add(role="tool", tool_call_id=str(item.get("call_id", "")),
                              content=output if isinstance(output, str) else json.dumps(output))  # fmt: skip
        elif kind != "reasoning":
            raise APIError(400, f"{where}.type {kind!r} is not supported", "input")
    for i, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise APIError(400, f"tools[{i}].type {tool.type!r} is not supported (function tools only)", "tools")
        if tool.model_extra:
            raise APIError(400, f"tools[{i}].{sorted(tool.model_extra)[0]} is not supported by this server", "tools")
        chat.tools.add(name=tool.name or "", description=tool.description or "",
                       parameters_json=json.dumps(tool.parameters) if tool.parameters is not None else "")
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, f"tool_choice type {choice.get('type')!r} is not supported", "tool_choice")
        chat.tool_choice, chat.tool_choice_function = gateway_pb2.TOOL_CHOICE_FUNCTION, str(choice.get("name", ""))
    elif choice is not None:
        chat.tool_choice = TOOL_CHOICES[choice]
    if body.parallel_tool_calls is not None:
        chat.parallel_tool_calls = body.parallel_tool_calls
    return chat


def sampling_params(body: ResponsesRequest) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams()
    set_fields(p, {"max_tokens": ("max_output_tokens", body.max_output_tokens),
                   "temperature": ("temperature", body.temperature), "top_p": ("top_p", body.top_p)})
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        p.structured_output.json_object = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs its schema", "text")
        p.structured_output.json_schema = json.dumps(fmt.schema_)
    return p


def output_items(shape: ResponseShape, text: str) -> list[dict]:
    """A whole answer as Responses output items: reasoning, a message, function calls."""
    reasoning, content, calls = answer_parts(shape, text)
    items = [{"type": "reasoning", "id": _id("rs"), "summary": [],
              "content": [{"type": "reasoning_text", "text": reasoning}]}] if reasoning else []  # fmt: skip
    if content:
        items.append(_message(_id("msg"), content, "completed"))
    items += [_call(_id("fc"), c.id, c.name, c.arguments, "completed") for c in calls]
    return items


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


class Responses(ChatEndpoint):
    """POST /v1/responses over a GatewayPipeline."""

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/responses", self.create, methods=["POST"])
        return router

    async def create(self, body: ResponsesRequest, request: Request):
        lora_name = await self.check_body(body, body.model, {name: " (nothing is stored here)"
                                                             for name in ("previous_response_id", "conversation")})
        if body.store:
            raise APIError(400, "store true is not supported: this server keeps no responses (send store: false)",
                           "store")  # fmt: skip
        grpc_request = gateway_pb2.GenerateRequest(chat=chat_messages(body), sampling_params=sampling_params(body))
        response_id = _id("resp")
        constrained = body.tool_choice is not None and body.tool_choice not in ("auto", "none")
        _, shape, stream = await self.start(grpc_request, response_id, request,
                                            {"structured_output": "tools" if constrained else "text",
                                             "max_tokens": "max_output_tokens", "prompt": "input"}, lora_name)
        base = {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": lora_name or self.model_name,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
                "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
                "tools": [tool.model_dump(exclude_unset=True) for tool in body.tools or ()],
                "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if body.text and body.text.format else {"type": "text"})},
                "metadata": body.metadata or {}, "store": False, "error": None, "incomplete_details": None,
                "user": body.user}  # fmt: skip
        if body.stream:
            return StreamingResponse(self._events(stream, base, shape), media_type="text/event-stream")
        if (whole := await self.whole(stream, request)) is None:
            return Response(status_code=499)  # (nobody reads it)
        text, last = whole
        return JSONResponse(base | finished(last) | {"output": output_items(shape, text)})

    async def _events(self, stream, base: dict, shape: ResponseShape):
        """The Responses events: response.created / in_progress, each output item's events (OutputItems), then
        response.completed (or incomplete) with the whole response; an error mid-stream is an error event."""
        events = EventStream()
        pending = base | {"status": "in_progress", "output": [], "usage": None}
        yield events("response.created", {"response": pending})
        yield events("response.in_progress", {"response": pending})
        deltas, items = ChatDeltas(shape), OutputItems(events)
        try:
            async for msg in stream:
                final = msg.HasField("finish_reason")
                for kind, value in deltas.pieces(msg.text, final):
                    for e in items.add(kind, value):
                        yield e
                if final:
                    for e in items.close():
                        yield e
                    response = base | finished(msg) | {"output": items.done}
                    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
                    yield events(done, {"response": response})
        except Exception as e:
            error = counted(self.pipeline.metrics, api_error(e, self.instance_id))
            yield events("error", {"code": error.code, "message": error.message, "param": error.param})
        finally:
            await stream.aclose()


class EventStream:
    """Server-sent events numbered by sequence_number from 0: events(name, data) -> the event's text."""

    def __init__(self):
        self.seq = 0

    def __call__(self, name: str, data: dict) -> str:
        self.seq += 1
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': self.seq - 1} | data)}\n\n"


class OutputItems:
    """A streamed answer's output items, built from ChatDeltas.pieces: add() opens an item when the kind changes
    (or a new call starts; reasoning, a message, a function call) and sends its delta event; close() sends the
    open item's done events. done: the finished items."""

    DELTAS = {"reasoning": "response.reasoning_text.delta", "content": "response.output_text.delta",
              "tool_call": "response.function_call_arguments.delta"}  # fmt: skip

    def __init__(self, events: EventStream):
        self.events, self.done = events, []
        self.kind, self.item, self.text = None, None, ""  # the open item

    def add(self, kind: str, value) -> list[str]:
        out = []
        if kind != self.kind or (kind == "tool_call" and "id" in value):
            out += self.close()
            out += self._open(kind, value)
        text = value["function"].get("arguments", "") if kind == "tool_call" else value
        if text:
            self.text += text
            where = {"item_id": self.item["id"], "output_index": len(self.done)}
            extra = {} if kind == "tool_call" else {"content_index": 0}
            out.append(self.events(self.DELTAS[kind], where | extra | {"delta": text} | (
                {"logprobs": []} if kind == "content" else {})))  # fmt: skip
        return out

    def _open(self, kind: str, value) -> list[str]:
        index = len(self.done)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}
        elif kind == "content":
            item = _message(_id("msg"), "", "in_progress") | {"content": []}
        else:
            item = _call(_id("fc"), value["id"], value["function"]["name"], "", "in_progress")
        self.kind, self.item, self.text = kind, item, ""
        out = [self.events("response.output_item.added", {"output_index": index, "item": item})]
        if kind == "content":
            out.append(self.events("response.content_part.added", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        kind, item, text, index = self.kind, self.item, self.text, len(self.done)
        done, where = dict(item, status="completed"), {"item_id": item["id"], "output_index": index}
        if kind == "content":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done["content"] = [part]
            out = [self.events("response.output_text.done", where | {"content_index": 0, "text": text,
                                                                      "logprobs": []}),
                   self.events("response.content_part.done", where | {"content_index": 0, "part": part})]
        elif kind == "reasoning":
            done["content"] = [{"type": "reasoning_text", "text": text}]
            out = [self.events("response.reasoning_text.done", where | {"content_index": 0, "text": text})]
        else:
            done["arguments"] = text
            out = [self.events("response.function_call_arguments.done", where | {"name": item["name"],
                                                                                 "arguments": text})]
        self.done.append(done)
        self.kind = None
        return out + [self.events("response.output_item.done", {"output_index": index, "item": done})]


def finished(last: gateway_pb2.GenerateResponse) -> dict:
    """status, incomplete_details and usage of a response from its completion's last message."""
    usage = {"input_tokens": last.usage.prompt_tokens, "output_tokens": last.usage.completion_tokens,
             "total_tokens": last.usage.prompt_tokens + last.usage.completion_tokens,
             "input_tokens_details": {"cached_tokens": last.usage.cached_tokens},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    if last.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "usage": usage}
    return {"status": "completed", "usage": usage}
