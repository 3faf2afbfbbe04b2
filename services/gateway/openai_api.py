"""The OpenAI-compatible HTTP API of the gateway (FastAPI, served by uvicorn in the gateway's own event loop).

POST /v1/chat/completions, POST /v1/completions, GET /v1/models (openai_serving.py), POST /v1/responses
(responses_api.py) and Anthropic's POST /v1/messages (anthropic_api.py) (each request translated into
the gateway's request record and run through the same pipeline as a gRPC call), POST /v1/embeddings, /tokenize
and /detokenize (openai_embeddings.py), vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(lora_adapters.py; a request's `model` may name a LoRA adapter), GET /health and GET /metrics.
Field names and shapes follow OpenAI's API reference, plus the extensions vLLM's server accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, cache_salt), and the
completions API's legacy echo and best_of (services/gateway/openai_responses.py). Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the HTTP status of the project's error type
(openai_errors.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.services.gateway import anthropic_api
from tandem.services.gateway.anthropic_api import AnthropicMessages
from tandem.services.gateway.http_middleware import APIKeyMiddleware, BodyLimitMiddleware
from tandem.services.gateway.lora_adapters import LoRAAdapters
from tandem.services.gateway.openai_embeddings import OpenAIEmbeddings
from tandem.services.gateway.openai_errors import counted
from tandem.services.gateway.openai_errors import APIError
from tandem.services.gateway.openai_serving import OpenAIServing
from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.responses_api import Responses
from tandem.services.security import APIKeys, TLSConfig


def create_app(pipeline: GatewayPipeline, model_name: str, instance_id: str,
               api_keys: APIKeys | None = None) -> FastAPI:
    """The FastAPI app over the gateway's pipeline (services/gateway/pipeline.py); model_name: the id /v1/models
    lists and requests may name. With api_keys, every /v1 path, /tokenize and /detokenize answer 401 (OpenAI's
    invalid_api_key error)
    unless the request has "Authorization: Bearer <key>", as vLLM's --api-key; /health and /metrics stay open."""
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app, pipeline)
    app.add_middleware(BodyLimitMiddleware)
    if api_keys is not None:  # (added last: runs first, so no body of an unauthenticated client is read)
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():  # (services/gateway/metrics.py)
        return Response(generate_latest(pipeline.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(OpenAIServing(pipeline, model_name, instance_id).router())
    app.include_router(AnthropicMessages(pipeline, model_name, instance_id).router())
    app.include_router(Responses(pipeline, model_name, instance_id).router())
    app.include_router(OpenAIEmbeddings(pipeline, model_name, instance_id).router())
    app.include_router(LoRAAdapters(pipeline.placer.router, pipeline.placer.channels, instance_id,
                                    model_name).routes())  # fmt: skip
    return app


def add_error_handlers(app: FastAPI, pipeline: GatewayPipeline) -> None:
    """Every refusal of app as OpenAI's error body with its status, counted in the pipeline's metrics: APIError,
    Starlette's HTTP errors (unknown paths, unreadable bodies, ...), strings that are not Unicode and bodies that do
    not parse as the route's model (400 naming the field)."""
    def error_response(e: APIError, request: Request) -> JSONResponse:  # (Anthropic's shape on its path)
        body = anthropic_api.error_body(e) if request.url.path.startswith("/v1/messages") else e.body()
        counted(pipeline.metrics, e)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail)), request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0]
        if first.get("type") == "json_invalid":  # (its loc is the character the parse failed at, no field)
            reason = (first.get("ctx") or {}).get("error", first.get("msg")).removesuffix(" at")  # (json's own)
            at = [x for x in first.get("loc", ()) if isinstance(x, int)]
            return error_response(APIError(400, f"the body is not valid JSON: {reason}"
                                                + (f" at character {at[0]}" if at else "")), request)
        # the error that got furthest into the body (of a union's branches, the one the value was meant for),
        # named without pydantic's branch tags
        deepest = max(errors, key=lambda error: len(error.get("loc", ())))
        where = [str(x) for x in deepest.get("loc", ()) if x != "body" and not _union_branch(x)]
        param = where[0] if where else None  # (later items name the nested field)
        message = (f"{'.'.join(where)}: {deepest.get('msg')}" if where else
                   f"the body is not a JSON object: {deepest.get('msg')}")  # fmt: skip
        return error_response(APIError(400, message, param), request)


TYPE_TAGS = ("str", "int", "float", "bool", "dict", "list")


def _union_branch(item) -> bool:
    """Whether an item of a pydantic error's loc is a union branch's tag ("str", "list[TextPart]",
    "literal['none','auto','required']", "NamedToolChoice"), not a field name: the bodies' field names are
    lowercase, without brackets."""
    return isinstance(item, str) and (item in TYPE_TAGS or item[:1].isupper() or "[" in item or "(" in item)


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
