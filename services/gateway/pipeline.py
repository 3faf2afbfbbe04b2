"""The gateway's request pipeline, the same for both public APIs (the gRPC servicer, server.py, and the
OpenAI-compatible HTTP API, openai_serving.py, only translate to and from it):

    validate -> admission -> fan-out (n completions, or beam search) -> placement -> relay

- validate: the sampling parameters against the prompt and the model (validation.check_sampling_params:
  max_tokens is resolved there, once);
- admission: the request holds one of the gateway's slots for its whole life (admission.py);
- fan-out: with n > 1, completion 0 places the prompt and the others wait until its decode holds the prompt's KV,
  then go to that decode, which reuses the prompt's blocks from its prefix cache: the prompt is computed once,
  not n times; beam search (beam_search.py) runs its steps the same way;
- placement (placement.py): route, reserve on the decode, prefill, with retries and waits for room;
- relay (relay.py): first token from the prefill at once, the rest from the decode, as UTF-8-safe text deltas;
- migration: when the decode fails after tokens were sent (it died, froze, stopped while draining, or the
  prompt's KV never came whole: placement.DecodeLostError), the request is placed again with every token it
  has so far as output (GatewayRequest.output_token_ids; the engines restore what counts generated tokens), and
  the stream goes on with the next token: no error, no token lost or repeated. At most max_migrations times per
  completion (then UNAVAILABLE). Dynamo's request migration does the same.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import xxhash

from tandem.services.channels import ChannelPool
from tandem.services.flags import (DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_MIGRATIONS,
                                   DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_QUEUE_TIMEOUT_S)
from tandem.services.gateway import beam_search
from tandem.services.gateway.admission import AdmissionQueue
from tandem.services.gateway.detokenizer import TextStream
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.placement import DecodeLostError, Placement, Placer
from tandem.services.gateway.relay import Relay
from tandem.services.gateway.request import GatewayRequest
from tandem.services.gateway.router import Router, SharedPrompt
from tandem.services.gateway.tool_calls import check_tools, tool_choice_constraint, tool_parser_for
from tandem.services.gateway.validation import check_sampling_params, tokenize_request
from tandem.services.tracing import bind_request, in_span, observe_generate, start_span, traced_stream
from tandem.shared.config import ModelConfig
from tandem.shared.errors import InvalidRequestError, UpstreamError
from tandem.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)
STREAM_BUFFER = 64  # messages a request's merged completions may hold for a client that reads slowly
STREAMS_END_MARGIN_S = 1.0  # a draining gateway ends the requests still running this long before its drain timeout


def seed_for(seed: int, index: int) -> int:
    """The seed of completion index > 0 of a seeded request with n completions: a 64-bit hash of (seed, index),
    so the n completions differ and each is reproducible."""
    return xxhash.xxh64_intdigest(f"{seed}:{index}".encode())


class GatewayPipeline:
    """One gateway's request pipeline. Public for the APIs that translate to it: model_config, tokenizer,
    metrics (served at /metrics on the HTTP port) and admission; default_max_tokens: a request's max_tokens
    when it sets none; max_migrations: times a completion may migrate (the module's docstring; 0: never);
    tool_call_parser, reasoning_parser: the gateway's --tool-call-parser and --reasoning-parser."""

    def __init__(self, model_config: ModelConfig, tokenizer, router: Router, default_max_tokens: int,
                 instance_id: str, channels: ChannelPool | None = None, admission: AdmissionQueue | None = None,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, tool_call_parser: str = "auto",
                 reasoning_parser: str | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.max_migrations = max_migrations
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.metrics = GatewayMetrics(model_config.name, instance_id)
        self.admission = admission or AdmissionQueue(DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_WAITING_REQUESTS,
                                                     DEFAULT_QUEUE_TIMEOUT_S)  # fmt: skip
        # (the gateway's TLS settings for its calls to the engines: services/gateway/main.py)
        self.placer = Placer(router, channels or ChannelPool(), self.admission, self.metrics)
        # set by drain(): when the requests still running end (loop time), and their error's message
        self._end: tuple[float, str] | None = None
        self._waiting: set[asyncio.Timeout] = set()  # run()'s waits for a message, each while it waits

    def drain(self, timeout_s: float) -> None:
        """The gateway drains (SIGTERM): the requests still running STREAMS_END_MARGIN_S before timeout_s (seconds
        from now; at half of it when shorter) end with an UNAVAILABLE error saying so, wherever they wait (run()),
        through each API's error path (an HTTP error or SSE error event, a gRPC status), instead of being cut off
        when the servers stop."""
        loop = asyncio.get_running_loop()
        end_in_s = timeout_s - STREAMS_END_MARGIN_S if timeout_s > 2 * STREAMS_END_MARGIN_S else timeout_s / 2
        self._end = (loop.time() + end_in_s, f"the gateway is shutting down: its drain timeout ({timeout_s:g} s) ran "
                                             "out before this request ended; send it again")  # fmt: skip
        for waiting in self._waiting:
            waiting.reschedule(self._end[0])

    async def tokenize(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        """The prompt (text or chat turns) of a public request as token ids (validation.tokenize_request), off the
        event loop: long prompts must not stall other streams. InvalidRequestError on bad input."""
        return await asyncio.to_thread(tokenize_request, self.tokenizer, request, self.model_config.max_model_len)

    def answer_format(self, request: gateway_pb2.GenerateRequest) -> tuple[common_pb2.SamplingParams, dict]:
        """A public request's sampling parameters with its tool_choice's constraint (tool_calls.py), and the
        GatewayRequest fields saying how its answers are read (tool_parser, reasoning_parser).
        InvalidRequestError naming the field when tool_choice would constrain an answer that structured output
        constrains already."""
        params, parsers = request.sampling_params, {"reasoning_parser": self.reasoning_parser}
        if request.WhichOneof("input") != "chat":
            return params, parsers
        chat = request.chat
        tools = check_tools(chat)
        constraint = tool_choice_constraint(chat, tools)
        if constraint is not None:
            if params.HasField("structured_output"):
                raise InvalidRequestError("tool_choice (required or a function) constrains the answer: it cannot "
                                          "combine with structured_output")  # fmt: skip
            params = common_pb2.SamplingParams()
            params.CopyFrom(request.sampling_params)
            params.structured_output.CopyFrom(constraint)
        parsers["tool_parser"] = tool_parser_for(chat, tools, self.tokenizer, self.tool_call_parser)
        return params, parsers

    async def validate(self, request: GatewayRequest) -> GatewayRequest:
        """request with the sampling parameters the tiers get (validation.check_sampling_params: max_tokens
        defaulted and clamped to the context), checked off the event loop (a huge grammar takes seconds to
        check). InvalidRequestError naming the field on bad input; UnknownLoRAError naming its adapter when no live
        instance has it loaded."""
        if request.lora_name is not None:
            await self.placer.router.adapter(request.lora_name)
        params = await asyncio.to_thread(check_sampling_params, request.sampling_params, request.num_prompt_tokens,
                                         self.model_config, self.default_max_tokens)  # fmt: skip
        return request.replace(sampling_params=params)

    async def generate(self, request: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The whole pipeline for one prompt: validate (before anything starts or waits), then run()."""
        request = await self.validate(request)
        async for msg in self.run(request):
            yield msg

    async def run(self, request: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """A validated request's n completions (or beam search's n best beams) as one stream of relay()'s
        messages with their index set; each completion ends with its own finish message, and the stream ends
        when all have. The request holds one of the gateway's admission slots throughout: OverloadedError when
        none comes free in time, DeadlineError when its deadline comes first. Once the gateway drains, drain()'s
        error ends it wherever it waits: for a slot, its placement, a beam step or the decode's next token."""
        stream = self._run(request)
        try:
            while True:
                # (the wait for each message, not the yield: the consumer's code runs outside it)
                waiting = asyncio.timeout_at(self._end and self._end[0])
                try:
                    async with waiting:
                        self._waiting.add(waiting)
                        try:
                            msg = await anext(stream)
                        finally:
                            self._waiting.discard(waiting)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not waiting.expired():  # (one of the stream's own)
                        raise
                    raise UpstreamError("UNAVAILABLE", self._end[1]) from None
                yield msg
        finally:
            await stream.aclose()

    async def _run(self, request: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with self.admission.slot(request.priority, request.time_remaining):
            if request.sampling_params.beam_width > 1:
                stream = beam_search.run_beam_search(self, request)
            elif request.n == 1:
                stream = self.relay(request)
            else:
                stream = self._completions(request)
            async for msg in stream:
                yield msg

    async def _completions(self, request: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """n > 1 completions sharing the prompt's placement (the module's docstring). Completion i > 0 of a
        seeded request uses seed_for(seed, i); completion ids are request_id, then request_id-1, -2, ..."""
        shared = SharedPrompt()
        messages: asyncio.Queue = asyncio.Queue(STREAM_BUFFER)  # (bounded: a slow reader holds back the decodes)

        def completion(index: int) -> GatewayRequest:
            if not index:
                return request.replace(shared_prompt=shared)
            params = common_pb2.SamplingParams()
            params.CopyFrom(request.sampling_params)
            if params.HasField("seed"):
                params.seed = seed_for(params.seed, index)
            params.ClearField("prompt_logprobs")  # (the prompt's logprobs come once, with completion 0)
            return request.replace(request_id=f"{request.request_id}-{index}", sampling_params=params,
                                   shared_prompt=shared, index=index)  # fmt: skip

        async def run(index: int) -> None:
            try:
                async for msg in self.relay(completion(index)):
                    msg.index = index
                    await messages.put(msg)
            except Exception as e:
                await messages.put(e)
                raise
            await messages.put(None)

        tasks = [asyncio.create_task(run(i)) for i in range(request.n)]
        try:
            for _ in range(request.n):
                while (msg := await messages.get()) is not None:
                    if isinstance(msg, BaseException):
                        raise msg
                    yield msg
        finally:
            for task in tasks:
                task.cancel()  # (each one's relay() cancels its decode call)
            await asyncio.gather(*tasks, return_exceptions=True)

    @traced_stream("generate", observe=observe_generate)
    async def relay(self, request: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One validated completion through the cluster, as the public stream: text deltas with their token ids
        (and logprobs), then a last message with finish_reason, usage and timings (relay.Relay). A completion
        that follows a shared prompt waits for it and goes to its decode first; the first of a shared prompt
        says where it went. Beam search runs each step's beams through here (record_metrics False). Raises the
        errors of Placer.place and Placer.read_decode."""
        arrival_time = time.perf_counter() if request.arrival_time is None else request.arrival_time
        params, shared = request.sampling_params, request.shared_prompt
        text = TextStream(self.tokenizer, tuple(params.stop), params.include_stop_str_in_output)
        bind_request(request.request_id, prompt_tokens=request.num_prompt_tokens, max_tokens=params.max_tokens)
        placement = await self._place(request)
        decode, prefill = placement.route.decode, placement.route.prefill
        decoding = start_span("decoding", decode_instance_id=decode.instance_id)  # (ended below)
        if shared is not None and not request.index:
            shared.decode = decode
            if placement.prefill_reply is None:  # the decode computed the prompt: its blocks are cached now
                shared.ready.set()
        relay = Relay(request, placement, text, arrival_time, self.metrics if request.record_metrics else None)
        reply = placement.first  # the first token's message, then each of the decode's
        try:
            while True:
                if (msg := relay.push(reply)) is not None:
                    yield msg
                if relay.finish_reason is not None:
                    if reply.HasField("finish_reason"):
                        await self.placer.end_of(placement.decode_call)  # (the decode ended it: its call ends OK)
                    break
                try:
                    reply = await self.placer.read_decode(placement.decode_call, decode, prefill)
                except DecodeLostError as e:
                    placement.decode_call.cancel()  # (frees its blocks where the decode still runs)
                    placement = await self._migrate(request, relay, e)
                    decode, prefill, reply = placement.route.decode, placement.route.prefill, placement.first
                    continue
                if shared is not None:  # a decode message: the prompt's KV arrived and is in its prefix cache
                    shared.ready.set()
        except BaseException as e:
            log.info("request %s ended early (%s)", request.request_id, type(e).__name__)
            raise
        finally:
            placement.decode_call.cancel()  # no-op when finished; otherwise aborts on the decode and frees its blocks
            decoding.end()
            if shared is not None:
                shared.ready.set()
        yield relay.final()

    async def _migrate(self, request: GatewayRequest, relay: Relay, error: DecodeLostError) -> Placement:
        """Place request again with the tokens relay has received as its output (the module's docstring), under
        a new placement id; error (UNAVAILABLE) when it has migrated max_migrations times already, else the
        errors of Placer.place."""
        tokens, num = relay.text.token_ids, len(relay.migrations)
        if num >= self.max_migrations:
            if num:
                raise UpstreamError("UNAVAILABLE", f"{error}; the request has migrated {num} times already "
                                                   f"(--max-migrations {self.max_migrations})") from None  # fmt: skip
            raise error
        params = common_pb2.SamplingParams()
        params.CopyFrom(request.sampling_params)
        params.ClearField("prompt_logprobs")  # (sent with the first token)
        migrated = request.replace(request_id=f"{request.request_id}.m{num + 1}", output_token_ids=tuple(tokens),
                                   sampling_params=params, shared_prompt=None)  # fmt: skip
        log.warning("request %s: %s after %d tokens; migrating it with them (%d of at most %d)",
                    request.request_id, error, len(tokens), num + 1, self.max_migrations)  # fmt: skip
        self.metrics.migrations.labels(**self.metrics.labels, reason=error.reason).inc()
        failed, started = relay.placement.route.decode.instance_id, time.perf_counter()
        placement = await in_span("migrate", self.placer.place(migrated), reason=error.reason,
                                  num_output_tokens=len(tokens), failed_decode_instance_id=failed)  # fmt: skip
        relay.resume(placement, error.reason)
        log.info("request %s migrated in %.0f ms (to its next token): %s", request.request_id,
                 (time.perf_counter() - started) * 1000, relay.migrations[-1])  # fmt: skip
        return placement

    async def _place(self, request: GatewayRequest) -> Placement:
        """Placer.place, after the shared prompt's placement for a completion that follows it (pinned to its
        decode); a shared prompt's first completion that fails lets the others place themselves."""
        shared, pinned = request.shared_prompt, None
        if request.follows_shared_prompt:
            await shared.ready.wait()
            pinned = shared.decode
        try:
            return await self.placer.place(request, pinned)
        except BaseException:
            if shared is not None:
                shared.ready.set()  # (the others place themselves)
            raise

