"""The OpenAI-compatible API's routes (vLLM's OpenAIServingChat and OpenAIServingCompletion in one class): GET
/v1/models, POST /v1/chat/completions and POST /v1/completions. Each handler translates OpenAI's JSON into the
gateway's request record, one per prompt (SamplingParams from openai_protocol.py), runs it through the same
pipeline as a gRPC call (services/gateway/pipeline.py: one router, one tokenizer, one stream relay), so a greedy
request gets the same tokens over either API, and answers with one JSON body or an SSE stream
(openai_responses.py). A client that disconnects, mid-stream or before its JSON answer, aborts the request on both
tiers."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.services.gateway.lora_adapters import resolve_model
from tandem.services.gateway.openai_errors import APIError, api_error, counted, http_param, param_named
from tandem.services.gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                                     chat_messages, completion_sampling_params, prompts,
                                                     sampling_params, session_id)
from tandem.services.gateway.openai_responses import ResponseShape, collect, sse
from tandem.services.gateway.pipeline import STREAM_BUFFER, GatewayPipeline
from tandem.services.gateway.request import GatewayRequest
from tandem.shared.request import check_token_ids
from tandem.shared.errors import InvalidRequestError, UnknownLoRAError
from tandem.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
T = TypeVar("T")


class OpenAIServing:
    """The /v1 routes over a GatewayPipeline; model_name: the id /v1/models lists and requests may name;
    instance_id: the gateway's (errors name it)."""

    def __init__(self, pipeline: GatewayPipeline, model_name: str, instance_id: str):
        self.pipeline, self.model_name, self.instance_id = pipeline, model_name, instance_id
        self.created = int(time.time())

    def router(self) -> APIRouter:
        """The routes, for FastAPI.include_router."""
        router = APIRouter()
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return router

    async def models(self):
        """GET /v1/models: the base model this gateway serves, then the LoRA adapters of the cluster, each with
        its base as parent and its directory as root (vLLM's model cards)."""
        config = self.pipeline.model_config
        card = {"object": "model", "created": self.created, "owned_by": "tandem", "max_model_len": config.max_model_len}
        adapters = await self.pipeline.placer.router.adapters()
        return {"object": "list", "data": [{"id": self.model_name, **card, "root": config.model_id, "parent": None}] + [
            {"id": a.name, **card, "root": a.path, "parent": self.model_name} for a in adapters.values()]}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        """POST /v1/chat/completions: chat turns rendered with the tokenizer's chat template."""
        lora_name = await self._check_model(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        chat = chat_messages(body, ROLE_ALIASES)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        grpc_request = gateway_pb2.GenerateRequest(chat=chat, sampling_params=sampling_params(body, max_tokens,
                                                                                              logprobs))  # fmt: skip
        prompt_ids = await self._tokenize(grpc_request, "messages")
        try:
            params, parsers = self.pipeline.answer_format(grpc_request)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param_named(str(e))) from None
        shape = ResponseShape(chat=True, n=body.n, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
                              **parsers)  # fmt: skip
        return await self._respond(body, [prompt_ids], params, shape, request, lora_name)

    async def completions(self, body: CompletionRequest, request: Request):
        """POST /v1/completions: one or more prompts, as text or token ids, with the legacy echo and best_of."""
        lora_name = await self._check_model(body)
        params = completion_sampling_params(body)
        prompt_ids, texts = [], []
        for prompt in prompts(body.prompt):
            if isinstance(prompt, str):
                prompt_ids.append(await self._tokenize(gateway_pb2.GenerateRequest(prompt=prompt), "prompt"))
                texts.append(prompt)
            else:
                try:
                    check_token_ids("prompt token ids", prompt, self.pipeline.model_config.vocab_size)
                except InvalidRequestError as e:
                    raise APIError(400, str(e), "prompt") from None
                prompt_ids.append(prompt)
                texts.append(self.pipeline.tokenizer.decode(prompt) if body.echo else "")
        shape = ResponseShape(chat=False, n=body.n, best_of=(body.best_of or 1) > 1, logprobs=body.logprobs,
                              prompt_logprobs=body.prompt_logprobs, echo=texts if body.echo else None,
                              prompts=prompt_ids)  # fmt: skip
        return await self._respond(body, prompt_ids, params, shape, request, lora_name)

    async def _check_model(self, body: SamplingFields) -> str | None:
        """The LoRA adapter body.model names (None: the base model); APIError 404 naming an unknown model."""
        return await resolve_model(self.pipeline.placer.router, self.model_name, body.model)

    async def _tokenize(self, grpc_request: gateway_pb2.GenerateRequest, param: str) -> list[int]:
        try:
            return await self.pipeline.tokenize(grpc_request)
        except InvalidRequestError as e:  # (a chat's tools and tool_choice are checked with its turns)
            named = param_named(str(e))
            raise APIError(400, str(e), named if named in ("tools", "tool_choice") else param) from None

    async def _respond(self, body: SamplingFields, prompts: list[list[int]], params: common_pb2.SamplingParams,
                       shape: ResponseShape, request: Request, lora_name: str | None = None):
        """Run every prompt's completions (with the LoRA adapter lora_name); answer with one JSON body or an SSE
        stream of chunks."""
        kind = "chat.completion" if shape.chat else "text_completion"
        response_id = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex
        requests = await self._validated(body, prompts, params, shape, response_id, session_id(request.headers),
                                         lora_name)  # fmt: skip
        streams = [self.pipeline.run(r) for r in requests]
        base = {"id": response_id, "object": kind, "created": int(time.time()), "model": lora_name or self.model_name}
        if body.stream:
            return await self._stream(body, streams, base, shape, request)
        try:
            choices, usage = await unless_disconnected(request, collect(merge(streams), shape, self.pipeline.tokenizer))
        except ClientDisconnected:
            log.info("%s: the client disconnected; request aborted", response_id)
            self.pipeline.metrics.observe_error("CANCELLED")
            return Response(status_code=499)  # (nginx's "client closed request"; nobody reads it)
        except Exception as e:
            raise api_error(e, self.instance_id) from None
        return JSONResponse(base | {"choices": choices, "usage": usage.as_json()})

    async def _validated(self, body: SamplingFields, prompts: list[list[int]], params: common_pb2.SamplingParams,
                         shape: ResponseShape, response_id: str, session: str | None,
                         lora_name: str | None = None) -> list[GatewayRequest]:
        """Each prompt's request record (prompt p's id: response_id-p; session: its X-Session-Id; lora_name: its
        adapter), validated before any runs: bad parameters are a 400 naming the body's field."""
        admission = self.pipeline.admission  # (a slot per prompt: more than it can ever hold would be refused forever)
        if len(prompts) > (room := admission.max_running + admission.max_waiting):
            raise APIError(400, f"{len(prompts)} prompts: this gateway holds at most {room} at once "
                                "(--max-concurrent-requests + --max-waiting-requests)", "prompt")
        requests = []
        for i, prompt_ids in enumerate(prompts):
            request = GatewayRequest(request_id=f"{response_id}-{i}", prompt_token_ids=prompt_ids,
                                     sampling_params=params, cache_salt=body.cache_salt, priority=body.priority,
                                     tool_parser=shape.tool_parser, reasoning_parser=shape.reasoning_parser,
                                     session_id=session, lora_name=lora_name)
            try:
                requests.append(await self.pipeline.validate(request))
            except UnknownLoRAError as e:  # (unloaded since _check_model)
                raise APIError(404, str(e), "model", "model_not_found") from None
            except InvalidRequestError as e:
                raise APIError(400, str(e), http_param(param_named(str(e)), body, shape.chat)) from None
        return requests

    async def _stream(self, body: SamplingFields, streams: list, base: dict, shape: ResponseShape,
                      request: Request) -> Response:
        """The SSE answer; errors before any token get an HTTP status, and a client gone meanwhile aborts it."""
        messages = merge(streams)
        try:
            first = await unless_disconnected(request, _first_messages(messages, len(streams), self.instance_id))
        except ClientDisconnected:
            log.info("%s: the client disconnected before the first token; request aborted", base["id"])
            self.pipeline.metrics.observe_error("CANCELLED")
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        def on_error(e: Exception) -> dict:  # (an error mid-stream: the body of its error chunk)
            return counted(self.pipeline.metrics, api_error(e, self.instance_id)).body()

        return StreamingResponse(sse(messages, first, base, shape, include_usage, self.pipeline.tokenizer, on_error),
                                 media_type="text/event-stream")  # fmt: skip


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
