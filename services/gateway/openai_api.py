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

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.client import finish_name
from services.grpc_errors import status_for
from shared.errors import InvalidRequestError, TandemError
from services.gateway.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, SamplingFields,
                                              Totals, format_logprobs, format_prompt_logprobs, param_named, prompts,
                                              sampling_params)
from tandem.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


def api_error(error: Exception, instance_id: str) -> APIError:
    """A project error (or any other exception: a bug, logged) as an APIError with its HTTP status."""
    if isinstance(error, APIError):
        return error
    code, message = status_for(error, "gateway", instance_id)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, TandemError):
        log.error("unhandled error", exc_info=error)
    return APIError(HTTP_STATUS.get(code, 500), message, code=code.name.lower())


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
                param = param_named(str(e))
                if param == "structured_output":
                    param = "structured_outputs" if body.structured_outputs else "response_format"
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
        prompt_logprobs: dict[int, list] = {}
        usage = Totals()
        try:
            for p, stream in enumerate(streams):
                async for msg in stream:
                    index = p * params.n + msg.index
                    choice = choices.setdefault(index, {"index": index, "text": "", "logprobs": [],
                                                        "finish_reason": None})  # fmt: skip
                    choice["text"] += msg.text
                    choice["logprobs"].extend(msg.logprobs)
                    if msg.prompt_logprobs:  # (completion 0 of each prompt; every choice of that prompt shows them)
                        prompt_logprobs[p] = format_prompt_logprobs(msg.prompt_logprobs, tokenizer)
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
            if params.HasField("prompt_logprobs"):
                out[-1]["prompt_logprobs"] = prompt_logprobs.get(index // params.n)
        return JSONResponse(base | {"choices": out, "usage": usage.as_json()})

    return app


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
                if msg.prompt_logprobs:
                    choice["prompt_logprobs"] = format_prompt_logprobs(msg.prompt_logprobs, tokenizer)
                if finish is not None:
                    usage.add(msg.usage, msg.index == 0)
                if msg.text or msg.token_ids or msg.prompt_logprobs or finish is not None:
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
