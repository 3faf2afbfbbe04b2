"""The OpenAI-compatible HTTP API of the gateway (FastAPI, served by uvicorn in the gateway's own event loop).

POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Each request is translated into
the gRPC API's SamplingParams and runs through the same GatewayServicer.generate_n as a gRPC call (one router,
one tokenizer, one stream relay), so a greedy request gets the same tokens over either API. Field names and
shapes follow OpenAI's API reference, plus the extensions vLLM's server accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, cache_salt). Errors come
in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the HTTP status of the project's error
type; a client that disconnects mid-stream aborts the request on both tiers.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.client import finish_name
from services.grpc_errors import status_for
from shared.errors import InvalidRequestError, TandemError
from tandem.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def api_error(error: Exception, instance_id: str) -> APIError:
    """A project error (or any other exception: a bug, logged) as an APIError with its HTTP status."""
    if isinstance(error, APIError):
        return error
    code, message = status_for(error, "gateway", instance_id)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, TandemError):
        log.error("unhandled error", exc_info=error)
    return APIError(HTTP_STATUS.get(code, 500), message, code=code.name.lower())


# -- request bodies ------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share (OpenAI's, then vLLM's extensions). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Any  # a string, a list of strings, token ids, or a list of token id lists (prompts())
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
    """The request's fields as the gRPC API's SamplingParams (validated there: generate_n raises
    InvalidRequestError naming the field)."""
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    p = common_pb2.SamplingParams(ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    p.stop.extend(stop)
    for t in body.stop_token_ids or ():
        if t < 0:
            raise APIError(400, f"stop_token_ids must be >= 0, got {t}", "stop_token_ids")
        p.stop_token_ids.append(t)
    fields = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "min_p": body.min_p, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
              "min_tokens": body.min_tokens, "logprobs": logprobs}  # fmt: skip
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, int) and not -(2**31) <= value < 2**31:
            raise APIError(400, f"{name} is out of range: {value}", name)
        setattr(p, name, value)
    if body.seed is not None:
        p.seed = body.seed % 2**64  # (any integer: OpenAI's seed is signed)
    if body.n < 1 or body.n > 2**31:
        raise APIError(400, f"n must be >= 1, got {body.n}", "n")
    p.n = body.n
    return p


# -- the app -------------------------------------------------------------------------------------------------
def create_app(servicer, model_name: str, instance_id: str) -> FastAPI:
    """The FastAPI app over a GatewayServicer (services/gateway/server.py); model_name: the id /v1/models
    lists and requests may name."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None)
    tokenizer = servicer.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # (unknown paths, unreadable bodies, ...)
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = where[0] if where else None  # (later items name nested fields and pydantic's union branches)
        message = f"{'.'.join(where)}: {first.get('msg')}" if where else f"the body is not a JSON object: {first.get('msg')}"
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tandem", "root": servicer.model_config.model_id,
                                            "max_model_len": servicer.model_config.max_model_len}]}  # fmt: skip

    def check_model(body: SamplingFields) -> None:
        if body.model not in (None, "", model_name):
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format other than text is not supported yet", "response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        chat = gateway_pb2.ChatMessages()
        for m in body.messages:
            content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content or ())
            chat.messages.add(role=ROLE_ALIASES.get(m.role, m.role), content=content)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        prompt_ids = await tokenize(gateway_pb2.GenerateRequest(chat=chat), "messages")
        return await respond(body, [prompt_ids], params, "chat.completion", request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        for name in ("suffix", "best_of"):
            if getattr(body, name) not in (None, 1 if name == "best_of" else None):
                raise APIError(400, f"{name} is not supported", name)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        params = sampling_params(body, body.max_tokens, body.logprobs)
        prompt_ids = []
        for prompt in prompts(body.prompt, servicer.model_config.vocab_size):
            if isinstance(prompt, str):
                prompt_ids.append(await tokenize(gateway_pb2.GenerateRequest(prompt=prompt), "prompt"))
            else:
                prompt_ids.append(prompt)
        return await respond(body, prompt_ids, params, "text_completion", request)

    async def tokenize(grpc_request: gateway_pb2.GenerateRequest, param: str) -> list[int]:
        try:
            return await asyncio.to_thread(servicer.tokenize, grpc_request)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param) from None

    async def respond(body: SamplingFields, prompts: list[list[int]], params: common_pb2.SamplingParams,
                      kind: str, request: Request):
        """Run every prompt's n completions; answer with one JSON body or an SSE stream of chunks."""
        chat = kind == "chat.completion"
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        cache_salt = body.cache_salt
        for prompt_ids in prompts:  # (bad parameters fail before anything runs)
            try:
                servicer.check_params(len(prompt_ids), params)
            except InvalidRequestError as e:
                param = _param_named(str(e))
                raise APIError(400, str(e), "messages" if chat and param == "prompt" else param) from None
        streams = [servicer.generate_n(prompt_ids, params, f"{response_id}-{i}", cache_salt)
                   for i, prompt_ids in enumerate(prompts)]  # fmt: skip
        base = {"id": response_id, "object": kind, "created": int(time.time()), "model": model_name}
        if body.stream:
            first = await _first_messages(streams, instance_id)  # errors before the first token get a status
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(streams, first, base, params.n, chat, include_usage, tokenizer,
                                          instance_id), media_type="text/event-stream")  # fmt: skip
        choices: dict[int, dict] = {}
        usage = Totals()
        try:
            for p, stream in enumerate(streams):
                async for msg in stream:
                    index = p * params.n + msg.index
                    choice = choices.setdefault(index, {"index": index, "text": "", "logprobs": [],
                                                        "finish_reason": None})  # fmt: skip
                    choice["text"] += msg.text
                    choice["logprobs"].extend(msg.logprobs)
                    if msg.HasField("finish_reason"):
                        choice["finish_reason"] = finish_name(msg.finish_reason)
                        usage.add(msg.usage, msg.index == 0)
        except Exception as e:
            raise api_error(e, instance_id) from None
        out = []
        for index in sorted(choices):
            c = choices[index]
            logprobs = format_logprobs(c["logprobs"], chat, tokenizer) if params.HasField("logprobs") else None
            if chat:
                out.append({"index": index, "message": {"role": "assistant", "content": c["text"]},
                            "logprobs": logprobs, "finish_reason": c["finish_reason"]})  # fmt: skip
            else:
                out.append({"index": index, "text": c["text"], "logprobs": logprobs,
                            "finish_reason": c["finish_reason"]})  # fmt: skip
        return JSONResponse(base | {"choices": out, "usage": usage.as_json()})

    return app


def prompts(prompt, vocab_size: int) -> list[str | list[int]]:
    """The completions API's prompt field as a list of prompts: a string, a list of strings, a list of token
    ids (one prompt) or a list of token id lists. APIError 400 for anything else or an empty prompt."""
    def is_ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or (is_ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not (all(isinstance(p, str) for p in prompt)
                                                          or all(is_ids(p) for p in prompt)):  # fmt: skip
        raise APIError(400, "prompt must be a non-empty string, list of strings, list of token ids, or list of token "
                            "id lists", "prompt")  # fmt: skip
    for p in prompt:
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        if not isinstance(p, str) and any(not 0 <= t < vocab_size for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return prompt


def _param_named(message: str) -> str | None:
    """The field an InvalidRequestError's message starts with or names ("min_p must be ...")."""
    word = message.split(" ", 1)[0].strip("(),:")
    return word if word.replace("_", "").isalpha() and word.islower() else None


class Totals:
    """OpenAI usage over a response's completions: each prompt counted once, every completion's tokens."""

    def __init__(self):
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, usage: gateway_pb2.Usage, count_prompt: bool) -> None:
        self.completion_tokens += usage.completion_tokens
        if count_prompt:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens

    def as_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}  # fmt: skip


def format_logprobs(logprobs, chat: bool, tokenizer) -> dict:
    """TokenLogprobs protos -> OpenAI's logprobs object: chat's {"content": [{token, logprob, bytes,
    top_logprobs}]}, or the completions API's {tokens, token_logprobs, top_logprobs, text_offset}."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    if chat:
        return {"content": [{"token": text(lp.token_id), "logprob": lp.logprob, "bytes": list(text(lp.token_id).encode()),
                             "top_logprobs": [{"token": text(t.token_id), "logprob": t.logprob,
                                               "bytes": list(text(t.token_id).encode())} for t in lp.top]}
                            for lp in logprobs]}  # fmt: skip
    tokens = [text(lp.token_id) for lp in logprobs]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text(t.token_id): t.logprob for t in lp.top} for lp in logprobs],
            "text_offset": offsets}  # fmt: skip


async def _first_messages(streams, instance_id: str) -> list:
    """The first message of each stream, so that an error before any token (bad input, no instance) is
    answered with its HTTP status instead of inside a 200 stream."""
    first = []
    try:
        for stream in streams:
            first.append(await anext(stream))
    except Exception as e:
        for stream in streams:
            await stream.aclose()
        raise api_error(e, instance_id) from None
    return first


async def _sse(streams, first: list, base: dict, n: int, chat: bool, include_usage: bool, tokenizer,
               instance_id: str):
    """Server-sent events: one chunk per message of each completion (chat's first chunk of a completion
    carries the assistant role), its finish chunk, then with include_usage a last chunk with empty choices and
    the usage (every other chunk has "usage": null), then [DONE]. An error mid-stream is sent as an error
    chunk."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage = Totals()
    started: set[int] = set()

    def chunk(choices: list, usage_json=None) -> str:
        body = base | {"object": kind, "choices": choices}
        if include_usage:
            body["usage"] = usage_json
        return f"data: {json.dumps(body)}\n\n"

    async def messages(p: int):
        yield first[p]
        async for msg in streams[p]:
            yield msg

    try:
        for p in range(len(streams)):
            async for msg in messages(p):
                index = p * n + msg.index
                finish = finish_name(msg.finish_reason) if msg.HasField("finish_reason") else None
                logprobs = format_logprobs(msg.logprobs, chat, tokenizer) if msg.logprobs else None
                if chat:
                    delta = {"content": msg.text}
                    if index not in started:
                        started.add(index)
                        delta = {"role": "assistant"} | delta
                    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                else:
                    choice = {"index": index, "text": msg.text, "logprobs": logprobs, "finish_reason": finish}
                if finish is not None:
                    usage.add(msg.usage, msg.index == 0)
                if msg.text or msg.token_ids or finish is not None:
                    yield chunk([choice])
        if include_usage:
            yield chunk([], usage.as_json())
    except Exception as e:
        yield f"data: {json.dumps(api_error(e, instance_id).body())}\n\n"
    finally:
        for stream in streams:
            await stream.aclose()  # a client gone mid-stream: each completion's decode call is cancelled
    yield "data: [DONE]\n\n"


async def serve_http(app: FastAPI, host: str, port: int):
    """Start uvicorn for app on host:port (0: any free port) inside the running event loop, without its own
    signal handling (the gateway's Server handles SIGTERM). Returns (uvicorn.Server, bound port, serving task).
    OSError if the address cannot be bound."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    server.capture_signals = _no_signals  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    return server, sock.getsockname()[1], task


def _no_signals():
    return contextlib.nullcontext()
