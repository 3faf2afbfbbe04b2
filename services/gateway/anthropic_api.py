"""Anthropic's Messages API on the gateway: POST /v1/messages (Anthropic's API reference, "Messages"), whole or
streamed as its server-sent events, translated into the same chat request as the OpenAI API's (one pipeline,
one chat template, the tool calling of tool_calls.py). Authenticated by `x-api-key` (or a bearer token) against
the gateway's --api-key keys; errors in Anthropic's shape ({"type": "error", "error": {"type", "message"}}).

Supported: system (a string or text blocks), user and assistant turns of text, tool_use and tool_result blocks,
max_tokens, stop_sequences, tools (name, description, input_schema), tool_choice (auto, any, tool, none;
disable_parallel_tool_use), metadata (its user_id is not used), and the sampling fields of the API's earlier
versions, temperature, top_p and top_k (today's SDK sends them in extra_body; unset, temperature is 1 as
Anthropic's was). Refused by name: images and documents in content, thinking (the gateway's --reasoning-parser
gives thinking blocks instead), and every other field (output_config, service_tier, container, ...).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict

from tandem.services.gateway.chat_endpoint import ChatEndpoint
from tandem.services.gateway.openai_errors import APIError, api_error, counted
from tandem.services.gateway.openai_protocol import Body, set_fields
from tandem.services.gateway.openai_responses import ChatDeltas, ResponseShape, answer_parts
from tandem.v1 import common_pb2, gateway_pb2

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
UNSUPPORTED = ("thinking", "service_tier", "container", "mcp_servers")


def error_body(e: APIError) -> dict:
    """An APIError in Anthropic's error shape (the field, when named, leads the message)."""
    message = e.message if not e.param or e.message.startswith(e.param) else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": message}}


class Block(Body):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Body):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Body):
    model_config = ConfigDict(extra="allow")  # (fields Anthropic defines that we do not serve: refused by name)
    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None


def _text(content: str | list[Block] | None, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    for i, block in enumerate(content):
        if block.type != "text":
            raise APIError(400, f"{where}[{i}].type {block.type!r} is not supported here (text only)", "messages")
    return "".join(block.text or "" for block in content)


def chat_messages(body: MessagesRequest) -> gateway_pb2.ChatMessages:
    """The body as the gRPC API's ChatMessages: tool_result blocks become tool turns, tool_use blocks an
    assistant turn's tool calls. APIError 400 naming the field for a block or field we do not serve."""
    for name in UNSUPPORTED:
        if getattr(body, name, None) is not None:
            raise APIError(400, f"{name} is not supported by this server", name)
    chat = gateway_pb2.ChatMessages()
    if body.system:
        chat.messages.add(role="system", content=_text(body.system, "system"))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            chat.messages.add(role=m.role, content=m.content)
            continue
        turn = gateway_pb2.ChatMessage(role=m.role)
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                turn.content += block.text or ""
            elif block.type == "tool_use" and m.role == "assistant":
                turn.tool_calls.add(id=block.id or "", name=block.name or "", arguments=json.dumps(block.input or {}))
            elif block.type == "tool_result" and m.role == "user":
                result = _text(block.content, f"{where}.content")
                chat.messages.add(role="tool", tool_call_id=block.tool_use_id or "",
                                  content=("Error: " if block.is_error else "") + result)  # fmt: skip
            else:
                raise APIError(400, f"{where}.type {block.type!r} is not supported in {m.role} turns", "messages")
        if turn.content or turn.tool_calls:
            chat.messages.append(turn)
    for tool in body.tools or ():
        chat.tools.add(name=tool.name, description=tool.description or "",
                       parameters_json=json.dumps(tool.input_schema))
    choice = body.tool_choice
    if choice is not None:
        kinds = {"auto": gateway_pb2.TOOL_CHOICE_AUTO, "none": gateway_pb2.TOOL_CHOICE_NONE,
                 "any": gateway_pb2.TOOL_CHOICE_REQUIRED, "tool": gateway_pb2.TOOL_CHOICE_FUNCTION}  # fmt: skip
        chat.tool_choice = kinds[choice.type]
        if choice.type == "tool":
            chat.tool_choice_function = choice.name or ""
        if choice.disable_parallel_tool_use is not None:
            chat.parallel_tool_calls = not choice.disable_parallel_tool_use
    return chat


def stop_reason(msg: gateway_pb2.GenerateResponse) -> str:
    if msg.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS:
        return "tool_use"
    if msg.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return "max_tokens"
    return "stop_sequence" if msg.stop_string else "end_turn"


class AnthropicMessages(ChatEndpoint):
    """POST /v1/messages over a GatewayPipeline."""

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/messages", self.messages, methods=["POST"])
        return router

    async def messages(self, body: MessagesRequest, request: Request):
        lora_name = await self.check_body(body, body.model)
        params = common_pb2.SamplingParams(stop=body.stop_sequences or ())
        set_fields(params, {name: (name, getattr(body, name)) for name in ("max_tokens", "temperature", "top_p",
                                                                           "top_k")})  # fmt: skip
        grpc_request = gateway_pb2.GenerateRequest(chat=chat_messages(body), sampling_params=params)
        message_id = "msg_" + uuid.uuid4().hex[:24]
        constrained = body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
        named = {"prompt": "messages"} | ({"structured_output": "tools"} if constrained else {})
        num_prompt, shape, stream = await self.start(grpc_request, message_id, request, named, lora_name)
        base = {"id": message_id, "type": "message", "role": "assistant", "model": lora_name or self.model_name}
        if body.stream:
            return StreamingResponse(self._events(stream, base, shape, num_prompt), media_type="text/event-stream")
        if (whole := await self.whole(stream, request)) is None:
            return Response(status_code=499)  # (nobody reads it)
        text, last = whole
        return JSONResponse(base | {"content": content_blocks(shape, text), "stop_reason": stop_reason(last),
                                    "stop_sequence": last.stop_string or None,
                                    "usage": {"input_tokens": last.usage.prompt_tokens,
                                              "output_tokens": last.usage.completion_tokens,
                                              "cache_read_input_tokens": last.usage.cached_tokens}})  # fmt: skip

    async def _events(self, stream, base: dict, shape: ResponseShape, num_prompt: int):
        """Anthropic's stream: message_start, content blocks (start, deltas, stop), message_delta, message_stop;
        an error mid-stream is an error event."""
        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps({'type': name} | data)}\n\n"

        yield event("message_start", {"message": base | {"content": [], "stop_reason": None, "stop_sequence": None,
                                                          "usage": {"input_tokens": num_prompt, "output_tokens": 0}}})
        deltas, index, open_kind = ChatDeltas(shape), -1, None
        try:
            async for msg in stream:
                final = msg.HasField("finish_reason")
                for kind, value in deltas.pieces(msg.text, final):
                    starts_call = kind == "tool_call" and "id" in value
                    if kind != open_kind or starts_call:
                        if open_kind is not None:
                            yield event("content_block_stop", {"index": index})
                        index, open_kind = index + 1, kind
                        block = ({"type": "thinking", "thinking": ""} if kind == "reasoning" else
                                 {"type": "text", "text": ""} if kind == "content" else
                                 {"type": "tool_use", "id": "toolu_" + value["id"].removeprefix("call_"),
                                  "name": value["function"]["name"], "input": {}})  # fmt: skip
                        yield event("content_block_start", {"index": index, "content_block": block})
                    if kind == "reasoning":
                        yield event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                      "thinking": value}})
                    elif kind == "content":
                        yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                      "text": value}})
                    elif value["function"].get("arguments"):
                        yield event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": value["function"]["arguments"]}})
                if final:
                    if open_kind is not None:
                        yield event("content_block_stop", {"index": index})
                    yield event("message_delta", {"delta": {"stop_reason": stop_reason(msg),
                                                            "stop_sequence": msg.stop_string or None},
                                                  "usage": {"output_tokens": msg.usage.completion_tokens,
                                                            "cache_read_input_tokens": msg.usage.cached_tokens}})
            yield event("message_stop", {})
        except Exception as e:
            error = counted(self.pipeline.metrics, api_error(e, self.instance_id))
            yield event("error", {"error": error_body(error)["error"]})
        finally:
            await stream.aclose()


def content_blocks(shape: ResponseShape, text: str) -> list[dict]:
    """A whole answer as Anthropic's content blocks: thinking (with a reasoning parser), text, tool_use."""
    reasoning, content, calls = answer_parts(shape, text)
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    if content:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:  # (cut by max_tokens)
            arguments = {}
        blocks.append({"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                       "input": arguments})  # fmt: skip
    return blocks

