"""The OpenAI-compatible HTTP API of the gateway (FastAPI, served by uvicorn in the gateway's own event loop).

POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Each request is translated into
the gRPC API's SamplingParams and runs through the same GatewayServicer.generate_n as a gRPC call (one router,
one tokenizer, one stream relay), so a greedy request gets the same tokens over either API. Field names and
shapes follow OpenAI's API reference, plus the extensions vLLM's server accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, cache_salt), and the
completions API's legacy echo and best_of (services/gateway/openai_responses.py). Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the HTTP status of the project's error type; a client that
disconnects, mid-stream or before its JSON answer, aborts the request on both tiers.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from typing import AsyncIterator, Awaitable, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.services.gateway.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, SamplingFields,
                                              completion_sampling_params, param_named, prompts, sampling_params)
from tandem.services.gateway.openai_responses import ResponseShape, collect, sse
from tandem.services.gateway.server import STREAM_BUFFER
from tandem.services.gateway.validation import tokenize_request
from tandem.services.grpc_errors import status_for
from tandem.services.security import APIKeys, TLSConfig
from tandem.services.server import PUBLIC_MAX_RECEIVE_BYTES
from tandem.shared.errors import InvalidRequestError, TandemError
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
GRPC_CODE_NAME = {status: code.name for code, status in HTTP_STATUS.items()} | {499: "CANCELLED"}
T = TypeVar("T")


def api_error(error: Exception, instance_id: str) -> APIError:
    """A project error (or any other exception: a bug, logged) as an APIError with its HTTP status; a 400 names
    the field its message names (after a "decode ID: " prefix of an error from a tier)."""
    if isinstance(error, APIError):
        return error
    code, message = status_for(error, "gateway", instance_id)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, TandemError):
        log.error("unhandled error", exc_info=error)
    status = HTTP_STATUS.get(code, 500)
    param = param_named(message.split(": ", 1)[-1]) if status == 400 else None
    retry_after_s = getattr(error, "retry_after_s", None)  # (an OverloadedError)
    headers = {"Retry-After": str(int(retry_after_s))} if retry_after_s is not None else None
    return APIError(status, message, http_param(param, None, False), code=code.name.lower(), headers=headers)


def http_param(param: str | None, body: SamplingFields | None, chat: bool) -> str | None:
    """The HTTP API's name of a gRPC field an error names (the request body says which spelling it used)."""
    if param == "structured_output":
        return "structured_outputs" if body is not None and body.structured_outputs else "response_format"
    if param == "beam_width":  # (use_beam_search's beams are n)
        return "n"
    if param == "prompt" and chat:
        return "messages"
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if param == "logprobs" and chat and getattr(body, "top_logprobs", None) is not None:
        return "top_logprobs"
    return param


# -- the app -------------------------------------------------------------------------------------------------
def create_app(servicer, model_name: str, instance_id: str, api_keys: APIKeys | None = None) -> FastAPI:
    """The FastAPI app over a GatewayServicer (services/gateway/server.py); model_name: the id /v1/models
    lists and requests may name. With api_keys, every /v1 path answers 401 (OpenAI's invalid_api_key error)
    unless the request has "Authorization: Bearer <key>", as vLLM's --api-key; /health and /metrics stay open."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = servicer.tokenizer
    created = int(time.time())

    def counted(e: APIError) -> APIError:
        """e, counted in tandem:request_errors_total (by its gRPC status name)."""
        servicer.metrics.observe_error(GRPC_CODE_NAME.get(e.status, "INTERNAL"))
        return e

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(counted(e).body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # (unknown paths, unreadable bodies, ...)
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(UnicodeEncodeError)
    async def _not_utf8(request: Request, e: UnicodeEncodeError):  # (JSON may escape lone surrogates: "\ud800")
        bad = e.object[e.start : e.end].encode("unicode_escape").decode()
        return error_response(APIError(400, f"a string of the request is not valid Unicode: it holds {bad} (a lone "
                                            "UTF-16 surrogate)"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = where[0] if where else None  # (later items name nested fields and pydantic's union branches)
        message = f"{'.'.join(where)}: {first.get('msg')}" if where else f"the body is not a JSON object: {first.get('msg')}"
        return error_response(APIError(400, message, param))

    app.add_middleware(BodyLimitMiddleware)
    if api_keys is not None:  # (added last: runs first, so no body of an unauthenticated client is read)
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():  # (services/gateway/metrics.py)
        return Response(generate_latest(servicer.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs)
        prompt_ids = await tokenize(gateway_pb2.GenerateRequest(chat=chat), "messages")
        shape = ResponseShape(chat=True, n=body.n, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs)
        return await respond(body, [prompt_ids], params, shape, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        params = completion_sampling_params(body)
        prompt_ids, texts = [], []
        for prompt in prompts(body.prompt, servicer.model_config.vocab_size):
            if isinstance(prompt, str):
                prompt_ids.append(await tokenize(gateway_pb2.GenerateRequest(prompt=prompt), "prompt"))
                texts.append(prompt)
            else:
                prompt_ids.append(prompt)
                texts.append(tokenizer.decode(prompt) if body.echo else "")
        shape = ResponseShape(chat=False, n=body.n, best_of=(body.best_of or 1) > 1, logprobs=body.logprobs,
                              prompt_logprobs=body.prompt_logprobs, echo=texts if body.echo else None,
                              prompts=prompt_ids)  # fmt: skip
        return await respond(body, prompt_ids, params, shape, request)

    async def tokenize(grpc_request: gateway_pb2.GenerateRequest, param: str) -> list[int]:
        try:
            return await asyncio.to_thread(tokenize_request, tokenizer, grpc_request,
                                           servicer.model_config.max_model_len)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param) from None

    async def respond(body: SamplingFields, prompts: list[list[int]], params: common_pb2.SamplingParams,
                      shape: ResponseShape, request: Request):
        """Run every prompt's completions; answer with one JSON body or an SSE stream of chunks."""
        kind = "chat.completion" if shape.chat else "text_completion"
        response_id = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex
        admission = servicer.admission  # (a slot per prompt: more than it can ever hold would be refused forever)
        if len(prompts) > (room := admission.max_running + admission.max_waiting):
            raise APIError(400, f"{len(prompts)} prompts: this gateway holds at most {room} at once "
                                "(--max-concurrent-requests + --max-waiting-requests)", "prompt")
        for prompt_ids in prompts:  # (bad parameters fail before anything runs; off the event loop: a huge
            try:                     # grammar takes seconds to check)
                await asyncio.to_thread(servicer.check_params, len(prompt_ids), params)
            except InvalidRequestError as e:
                raise APIError(400, str(e), http_param(param_named(str(e)), body, shape.chat)) from None
        streams = [servicer.generate_n(prompt_ids, params, f"{response_id}-{i}", body.cache_salt,
                                       priority=body.priority)
                   for i, prompt_ids in enumerate(prompts)]  # fmt: skip
        base = {"id": response_id, "object": kind, "created": int(time.time()), "model": model_name}
        if body.stream:
            messages = merge(streams)
            try:  # (errors before any token get an HTTP status; a client gone meanwhile aborts it)
                first = await unless_disconnected(request, _first_messages(messages, len(streams), instance_id))
            except ClientDisconnected:
                log.info("%s: the client disconnected before the first token; request aborted", response_id)
                servicer.metrics.observe_error("CANCELLED")
                return Response(status_code=499)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(messages, first, base, shape, include_usage, tokenizer,
                                         lambda e: counted(api_error(e, instance_id)).body()),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            choices, usage = await unless_disconnected(request, collect(merge(streams), shape, tokenizer))
        except ClientDisconnected:
            log.info("%s: the client disconnected; request aborted", response_id)
            servicer.metrics.observe_error("CANCELLED")
            return Response(status_code=499)  # (nginx's "client closed request"; nobody reads it)
        except Exception as e:
            raise api_error(e, instance_id) from None
        return JSONResponse(base | {"choices": choices, "usage": usage.as_json()})

    return app


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work, unless the HTTP client disconnects first: then cancel it (a completion's cancelled stream
    cancels its calls, which aborts the request on both tiers) and raise ClientDisconnected. Once FastAPI has
    read the body, the ASGI receive channel yields nothing more until uvicorn's http.disconnect, so one task
    waiting on it sees the client leave at once (Starlette's is_disconnected() would have to be polled)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.create_task(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def merge(streams) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
    """Every stream's messages as (its index in streams, message) in arrival order, the streams running at once
    (a request's prompts are served concurrently, like the n completions of one prompt). The first error is
    raised; closing the merge cancels every stream, and so their calls on both tiers."""
    arrivals: asyncio.Queue = asyncio.Queue(STREAM_BUFFER)  # (bounded: a slow client holds back the streams)

    async def pump(p: int, stream) -> None:
        try:
            async for msg in stream:
                await arrivals.put((p, msg))
        except Exception as e:
            await arrivals.put((p, e))
        await arrivals.put((p, None))

    tasks = [asyncio.create_task(pump(p, stream)) for p, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            p, msg = await arrivals.get()
            if isinstance(msg, Exception):
                raise msg
            if msg is None:
                running -= 1
            else:
                yield p, msg
    finally:
        for task in tasks:
            task.cancel()  # (a stream cancelled mid-call cancels its calls)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first_messages(messages, num_streams: int, instance_id: str) -> list:
    """The messages of merge() up to the first of every stream, so that an error before any token (bad input,
    no instance) is answered with its HTTP status instead of inside a 200 stream."""
    first, started = [], set()
    try:
        while len(started) < num_streams:
            p, msg = await anext(messages)
            first.append((p, msg))
            started.add(p)
    except Exception as e:
        await messages.aclose()
        raise api_error(e, instance_id) from None
    return first


class BodyLimitMiddleware:
    """ASGI middleware: a request body over PUBLIC_MAX_RECEIVE_BYTES (the public gRPC port's message limit) gets
    413 before any of it is parsed; the body is read here (at most that much) and replayed to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        size, chunks, more = int(length) if length.isdigit() else 0, [], True
        while more and size <= PUBLIC_MAX_RECEIVE_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # (nobody to answer)
            chunks.append(message.get("body", b""))
            size = max(size, sum(map(len, chunks)))
            more = message.get("more_body", False)
        if size > PUBLIC_MAX_RECEIVE_BYTES:
            error = APIError(413, f"the request body has more than {PUBLIC_MAX_RECEIVE_BYTES} bytes, the limit")
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # (later reads: the client's disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class APIKeyMiddleware:
    """ASGI middleware (not BaseHTTPMiddleware, which would stand between a stream and its disconnect): a /v1
    request without "Authorization: Bearer <key>" of api_keys gets 401 and OpenAI's invalid_api_key error."""

    def __init__(self, app, api_keys: APIKeys):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        refusal = self.api_keys.refusal(header)
        if refusal is None:
            return await self.app(scope, receive, send)
        error = APIError(401, f"{refusal} (the gateway's --api-key)", code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


async def serve_http(app: FastAPI, host: str, port: int, drain_timeout_s: float, tls: TLSConfig | None = None):
    """Start uvicorn for app on host:port (0: any free port) inside the running event loop, without its own
    signal handling (the gateway's Server handles SIGTERM; once should_exit is set, requests in flight get
    drain_timeout_s to finish); HTTPS with tls's certificate (and client certificates when it requires them).
    Returns (uvicorn.Server, bound port, serving task).
    OSError if the address cannot be bound or a TLS file cannot be loaded."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=drain_timeout_s, **(tls.uvicorn_settings() if tls else {}),
                            log_config=None)  # (its lines go through the gateway's own log format: services/logs.py)
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
