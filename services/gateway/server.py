"""Gateway: the public gRPC API. Templating, tokenization and validation, routing, then the stream relay:
first token from the prefill at once, the rest from the decode, as UTF-8-safe text deltas."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import AsyncIterator

import grpc
import xxhash

from tandem.services.channels import ChannelPool
from tandem.services.client import finish_name
from tandem.services.gateway.admission import AdmissionQueue, OverloadedError, check_predicted_ttft
from tandem.services.gateway.beam_search import run_beam_search
from tandem.services.gateway.detokenizer import TextStream
from tandem.services.gateway.validation import check_sampling_params, tokenize_request
from tandem.services.gateway.router import Route, Router, SharedPrompt
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.prefill_watch import PrefillLostError, prefill_watching_decode
from tandem.services.flags import DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_QUEUE_TIMEOUT_S
from tandem.services.grpc_errors import error_code, peer_is_down, upstream_error
from tandem.services.tracing import bind_request, in_span, observe_generate, start_span, traced, traced_stream
from tandem.shared.config import ModelConfig
from tandem.shared.errors import DeadlineError, InvalidRequestError, NoInstanceError, UpstreamError
from tandem.shared.cluster_state.registry import InstanceInfo
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3  # failed placements of one request (a full decode is no failure: the request waits for room)
STREAM_BUFFER = 64  # messages a request's merged completions may hold for a client that reads slowly
ROOM_POLL_S, ROOM_POLL_MAX_S = 0.05, 1.0  # first and longest pause between placements while every decode is full
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def seed_for(seed: int, index: int) -> int:
    """The seed of completion index > 0 of a seeded request with n completions: a 64-bit hash of (seed, index),
    so the n completions differ and each is reproducible."""
    return xxhash.xxh64_intdigest(f"{seed}:{index}".encode())


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, model_config: ModelConfig, tokenizer, router: Router, default_max_tokens: int,
                 instance_id: str, channels: ChannelPool | None = None, admission: AdmissionQueue | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.router = router
        self.default_max_tokens = default_max_tokens
        self.channels = channels or ChannelPool()  # (the gateway's TLS settings: services/gateway/main.py)
        self.metrics = GatewayMetrics(model_config.name, instance_id)  # (served at /metrics on the HTTP port)
        self.admission = admission or AdmissionQueue(DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_WAITING_REQUESTS,
                                                     DEFAULT_QUEUE_TIMEOUT_S)  # fmt: skip

    async def Generate(self, request, context):
        """The public gRPC API; a request that fails is counted by status code (tandem:request_errors_total;
        the HTTP API counts its own)."""
        t0 = time.perf_counter()
        try:
            # (off the event loop: long prompts must not stall other streams)
            prompt_ids = await asyncio.to_thread(tokenize_request, self.tokenizer, request,
                                                 self.model_config.max_model_len)
            cache_salt = request.cache_salt if request.HasField("cache_salt") else None
            time_remaining = deadline_clock(context.time_remaining,
                                            request.deadline_ms if request.HasField("deadline_ms") else None)
            async for msg in self.generate_n(prompt_ids, request.sampling_params, request.request_id, cache_salt,
                                             time_remaining, t0, request.priority):  # fmt: skip
                yield msg
        except BaseException as e:
            self.metrics.observe_error(error_code(e).name)
            raise

    def check_params(self, num_prompt_tokens: int, p: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        """check_sampling_params with this gateway's model and default max_tokens."""
        return check_sampling_params(p, num_prompt_tokens, self.model_config, self.default_max_tokens)

    async def generate_n(self, prompt_ids: list[int], p: common_pb2.SamplingParams, request_id: str = "",
                         cache_salt: str | None = None, time_remaining=lambda: None,
                         t0: float | None = None, priority: int = 0) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """p.n completions of one prompt (default 1), as one stream of generate()'s messages with their index
        set; each completion ends with its own finish message, and the stream ends when all have. Completion 0
        places the prompt; the others wait until its decode holds the prompt's KV and then go to that decode,
        which reuses the prompt's blocks from its prefix cache (computing only the last partial block): the
        prompt is computed once, not n times. Completion i > 0 of a seeded request uses seed_for(seed, i).
        Completion ids are request_id, then request_id-1, request_id-2, ...
        The request holds one of the gateway's admission slots throughout (services/gateway/admission.py):
        OverloadedError when none comes free in time."""
        # (fail before anything starts or waits; off the event loop: a huge grammar takes seconds to check)
        await asyncio.to_thread(self.check_params, len(prompt_ids), p)
        async with self.admission.slot(priority, time_remaining):
            async for msg in self._generate_n(prompt_ids, p, request_id, cache_salt, time_remaining, t0, priority):
                yield msg

    async def _generate_n(self, prompt_ids: list[int], p: common_pb2.SamplingParams, request_id: str,
                          cache_salt: str | None, time_remaining, t0: float | None,
                          priority: int) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        if p.beam_width > 1:
            async for msg in run_beam_search(self, prompt_ids, p, request_id or uuid.uuid4().hex, cache_salt,
                                             time_remaining, t0 or time.perf_counter(), priority):  # fmt: skip
                yield msg
            return
        n = p.n if p.HasField("n") else 1
        request_id = request_id or uuid.uuid4().hex
        if n == 1:
            async for msg in self.generate(prompt_ids, p, request_id, cache_salt, time_remaining, t0,
                                           priority=priority):  # fmt: skip
                yield msg
            return
        shared = SharedPrompt()
        messages: asyncio.Queue = asyncio.Queue(STREAM_BUFFER)  # (bounded: a slow reader holds back the decodes)

        async def run(index: int) -> None:
            params = common_pb2.SamplingParams()
            params.CopyFrom(p)
            if index and params.HasField("seed"):
                params.seed = seed_for(params.seed, index)
            if index:  # (the prompt's logprobs come once, with completion 0)
                params.ClearField("prompt_logprobs")
            try:
                async for msg in self.generate(prompt_ids, params, f"{request_id}-{index}" if index else request_id,
                                               cache_salt, time_remaining, t0, shared, index, priority):  # fmt: skip
                    msg.index = index
                    await messages.put(msg)
            except Exception as e:
                await messages.put(e)
                raise
            await messages.put(None)

        tasks = [asyncio.create_task(run(i)) for i in range(n)]
        try:
            for _ in range(n):
                while (msg := await messages.get()) is not None:
                    if isinstance(msg, BaseException):
                        raise msg
                    yield msg
        finally:
            for task in tasks:
                task.cancel()  # (each one's generate() cancels its decode call)
            await asyncio.gather(*tasks, return_exceptions=True)

    @traced_stream("generate", observe=observe_generate)
    async def generate(self, prompt_ids: list[int], p: common_pb2.SamplingParams, request_id: str = "",
                       cache_salt: str | None = None, time_remaining=lambda: None, t0: float | None = None,
                       shared: SharedPrompt | None = None, index: int = 0,
                       priority: int = 0, metrics: bool = True) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One request through the cluster, as the public stream: text deltas with their token ids (and
        logprobs), then a last message with finish_reason, usage and timings. Both public APIs (this service's
        Generate and the OpenAI-compatible HTTP server) run through here. time_remaining() -> seconds left
        before the client's deadline, or None; t0: when the request arrived (perf_counter seconds); shared and
        index: completion index of n sharing one prompt (generate_n); priority: the engines' scheduling priority
        (lower first); metrics: record it in the gateway's request metrics (beam search records its beams
        instead of its steps).
        Raises InvalidRequestError on bad input and the errors of _start and _read."""
        t0 = time.perf_counter() if t0 is None else t0
        proto_params = self.check_params(len(prompt_ids), p)
        text = TextStream(self.tokenizer, tuple(p.stop), p.include_stop_str_in_output)
        request_id = request_id or uuid.uuid4().hex
        bind_request(request_id, prompt_tokens=len(prompt_ids), max_tokens=proto_params.max_tokens)
        pinned = None
        if shared is not None and index:
            await shared.ready.wait()
            pinned = shared.decode
        try:
            decode_call, reply, route, prefill_reply = await self._start(request_id, prompt_ids, proto_params,
                                                                         cache_salt, time_remaining, pinned,
                                                                         priority)  # fmt: skip
        except BaseException:
            if shared is not None:
                shared.ready.set()  # (the others place themselves)
            raise
        decode = route.decode
        decoding = start_span("decoding", decode_instance_id=decode.instance_id)  # (ended below)
        if shared is not None and not index:
            shared.decode = decode
            if prefill_reply is None:  # the decode computed the prompt: its blocks are cached now
                shared.ready.set()
        num_cached_tokens = prefill_reply.num_cached_tokens if prefill_reply else 0
        if prefill_reply is not None and metrics:
            self.metrics.queue_time.observe(prefill_reply.queue_ms / 1000)
        num_draft_tokens = num_accepted_tokens = 0
        last_sent = time.perf_counter()
        ttft_ms = (last_sent - t0) * 1000
        finish_reason = None
        prompt_logprobs = prefill_reply.prompt_logprobs if prefill_reply else ()  # (sent with the first message)
        try:
            while True:  # reply: the first token's message, then each of the decode's
                if reply.HasField("finish_reason"):
                    finish_reason = reply.finish_reason
                if prefill_reply is None:
                    num_cached_tokens = reply.num_cached_tokens
                num_before = len(text.token_ids)
                delta = text.push(list(reply.token_ids))
                new_ids = text.token_ids[num_before:]  # (none past a stop string)
                num_draft_tokens += reply.num_draft_tokens
                num_accepted_tokens += min(reply.num_accepted_tokens, len(new_ids))  # (those sent)
                if metrics and new_ids and len(text.token_ids) > len(new_ids):  # (the first token's: the TTFT)
                    now = time.perf_counter()
                    self.metrics.observe_tokens(len(new_ids), now - last_sent)
                    last_sent = now
                if new_ids or prompt_logprobs:
                    yield gateway_pb2.GenerateResponse(request_id=request_id, text=delta, token_ids=new_ids,
                                                       logprobs=reply.logprobs[: len(new_ids)],
                                                       prompt_logprobs=prompt_logprobs)  # fmt: skip
                    prompt_logprobs = ()
                if text.stopped:
                    finish_reason = common_pb2.FINISH_REASON_STOP
                if finish_reason is not None:
                    break
                reply = await self._read(decode_call, decode, route.prefill)
                if shared is not None:  # a decode message: the prompt's KV arrived and is in its prefix cache
                    shared.ready.set()
        except BaseException as e:
            log.info("request %s ended early (%s)", request_id, type(e).__name__)
            raise
        finally:
            decode_call.cancel()  # no-op when finished; otherwise aborts on the decode and frees its blocks
            decoding.end()
            if shared is not None:
                shared.ready.set()
        e2e_ms = (time.perf_counter() - t0) * 1000
        if metrics:
            self.metrics.observe_finished(finish_name(finish_reason), len(prompt_ids), num_cached_tokens,
                                          len(text.token_ids), ttft_ms / 1000, e2e_ms / 1000)  # fmt: skip
        where = (f"prefill {prefill_reply.prefill_ms:.0f} ms on {route.prefill.instance_id}, "
                 f"{prefill_reply.num_blocks_sent} KV blocks sent" if prefill_reply else "prompt computed on the decode")
        log.info("request %s: %d prompt (%d cached) + %d completion tokens, %s, TTFT %.0f ms (%s), E2E %.0f ms "
                 "(decode %s)", request_id, len(prompt_ids), num_cached_tokens, len(text.token_ids),
                 common_pb2.FinishReason.Name(finish_reason), ttft_ms, where, e2e_ms, decode.instance_id)  # fmt: skip
        yield gateway_pb2.GenerateResponse(
            request_id=request_id,
            text=text.finish(),
            finish_reason=finish_reason,
            usage=gateway_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(text.token_ids),
                                    cached_tokens=num_cached_tokens, num_draft_tokens=num_draft_tokens,
                                    num_accepted_tokens=num_accepted_tokens),  # fmt: skip
            timings=gateway_pb2.Timings(ttft_ms=ttft_ms, e2e_ms=e2e_ms),
        )

    async def _read(self, decode_call, decode: InstanceInfo,
                    prefill: InstanceInfo | None = None) -> decode_pb2.DecodeResponse:
        """The decode's next message; UpstreamError if the call failed, ended early or the decode failed it: a
        decode found dead is routed around from then on (Router.mark_down), and one whose prompt KV never came
        whole (its prefill, named, died after sending the first token) says UNAVAILABLE: the client may retry."""
        try:
            reply = await decode_call.read()
        except grpc.aio.AioRpcError as e:
            if peer_is_down(e):
                self.router.mark_down(decode)
            raise upstream_error(e, "decode", decode.instance_id, "decoding") from None
        if reply is grpc.aio.EOF:
            raise UpstreamError("INTERNAL", f"decode {decode.instance_id} ended the stream without a finish reason")
        if reply.error:
            status = ("INVALID_ARGUMENT" if reply.error_is_invalid_request else
                      "UNAVAILABLE" if reply.error_is_unavailable else "INTERNAL")  # fmt: skip
            source = f" (the prompt's KV came from prefill {prefill.instance_id})" if (
                reply.error_is_unavailable and prefill is not None) else ""  # fmt: skip
            raise UpstreamError(status, f"decode {decode.instance_id}: {reply.error}{source}")
        return reply

    @traced("place")
    async def _start(self, request_id: str, prompt_ids: list[int], params: common_pb2.SamplingParams,
                     cache_salt: str | None, time_remaining, pinned: InstanceInfo | None = None, priority: int = 0):
        """Route, reserve on the decode, then prefill on the prefill naming that decode (only the blocks the
        decode lacks are sent), or let the decode compute the prompt itself (Route.prefill None). Returns
        (decode stream, the message carrying the first token, route, prefill reply or None); the first token
        comes from the prefill reply or the decode's stream. An instance that is unreachable (dead but still in
        the registry until its TTL) or fails is skipped and the request is placed again, up to MAX_ATTEMPTS
        failures. When every decode is full, the request waits for room (polling, with backoff) for as long as
        the admission queue lets a request wait, then OverloadedError (DeadlineError when its deadline comes
        first). The client's deadline, if it set one, bounds every call; a prefill whose queue would already
        take longer refuses the request at once (DeadlineError). pinned: a decode to try first, computing the
        prompt there (it holds the prompt's blocks: generate_n)."""
        skipped: set[str] = set()
        last_error: UpstreamError | None = None
        num_failures, room_wait_s, started = 0, ROOM_POLL_S, time.monotonic()
        for attempt in itertools.count(1):
            timeout = time_remaining()
            if timeout is not None and timeout <= 0:
                raise DeadlineError("the request's deadline passed before it was placed")
            try:
                if pinned is not None and attempt == 1:
                    route = Route(pinned, None, explanation=[f"decode {pinned.instance_id}: holds this prompt"],
                                  reason="pinned")  # fmt: skip
                else:
                    route = await self.router.route(prompt_ids, len(prompt_ids) + params.max_tokens, cache_salt,
                                                    skipped, local=not params.HasField("prompt_logprobs"))
            except NoInstanceError:
                if last_error is None:
                    raise
                if last_error.status != "RESOURCE_EXHAUSTED":  # every instance left was tried: say why one failed
                    raise last_error from None
                # Every decode is full: wait for room (requests finish), within the admission queue's bound
                waited_s = time.monotonic() - started
                if waited_s >= self.admission.max_wait_s:
                    raise OverloadedError(f"no decode has room for the request's KV after {waited_s:.1f} s "
                                          f"({last_error})", self.admission.retry_after_s()) from None
                left_s = self.admission.max_wait_s - waited_s
                if timeout is not None and timeout - ROOM_POLL_S < left_s:  # (the answer must reach the client)
                    if (left_s := timeout - ROOM_POLL_S) <= 0:
                        raise DeadlineError(f"the request's deadline passed while it waited {waited_s:.1f} s for "
                                            f"room on a decode ({last_error})") from None
                await asyncio.sleep(min(room_wait_s, left_s))
                room_wait_s = min(2 * room_wait_s, ROOM_POLL_MAX_S)
                skipped.clear()
                last_error = None
                continue
            check_predicted_ttft(route, len(prompt_ids), timeout)
            # Each placement its own id on the engines: a failed attempt's teardown (its broken KV stream) must not
            # touch the next attempt's reservation when that lands on the same decode.
            placement_id = request_id if attempt == 1 else f"{request_id}.{attempt}"
            log.info("request %s routed: %s", placement_id, route.explain())
            self.metrics.observe_route(route)
            decode, prefill = route.decode, route.prefill
            decode_stub = decode_pb2_grpc.DecodeStub(self.channels.get(decode.address, decode.instance_id))
            decode_call = decode_stub.Generate(
                decode_pb2.DecodeRequest(request_id=placement_id, prompt_token_ids=prompt_ids, sampling_params=params,
                                         cache_salt=cache_salt, compute_prompt=prefill is None, priority=priority),
                timeout=timeout,
            )  # fmt: skip
            failed, doing = decode, "reserving KV blocks"
            try:
                reply = await in_span("reserve", decode_call.read(), decode_instance_id=decode.instance_id)
                if reply is grpc.aio.EOF or not reply.reserved:
                    raise UpstreamError("INTERNAL", f"decode {decode.instance_id} did not reserve the request")
                if prefill is None:
                    doing = "computing the prompt"
                    first = await self._read(decode_call, decode)
                    return decode_call, first, route, None
                failed, doing = prefill, "prefilling"
                skip_blocks = reply.num_cached_tokens // decode.block_size
                prefill_stub = prefill_pb2_grpc.PrefillStub(self.channels.get(prefill.address, prefill.instance_id))
                prefill_call = prefill_stub.Prefill(
                    prefill_pb2.PrefillRequest(request_id=placement_id, prompt_token_ids=prompt_ids,
                                               sampling_params=params, decode_address=decode.address,
                                               decode_instance_id=decode.instance_id, num_skip_blocks=skip_blocks,
                                               cache_salt=cache_salt, priority=priority),
                    timeout=timeout,
                )  # fmt: skip
                prefill_reply, decode_call = await prefill_watching_decode(prefill_call, decode_call, prefill)
                first = decode_pb2.DecodeResponse(token_ids=[prefill_reply.first_token_id])
                if prefill_reply.HasField("first_token_logprobs"):
                    first.logprobs.append(prefill_reply.first_token_logprobs)
                return decode_call, first, route, prefill_reply
            except PrefillLostError as e:  # (the decode freed the reservation: the prefill died or stalls)
                decode_call.cancel()
                last_error = UpstreamError("UNAVAILABLE", str(e))
                if (num_failures := num_failures + 1) == MAX_ATTEMPTS:
                    raise last_error from None
                log.warning("request %s: %s; placing it again", request_id, e)
                skipped.add(prefill.instance_id)
                self.router.mark_down(prefill)
            except (grpc.aio.AioRpcError, UpstreamError) as e:
                decode_call.cancel()
                if isinstance(e, UpstreamError):  # (from _read: the decode failed while computing the prompt)
                    raise
                last_error = upstream_error(e, failed.tier, failed.instance_id, doing)
                full = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # (a decode's pool: not a failure)
                if e.code() not in RETRY_CODES or (not full and (num_failures := num_failures + 1) == MAX_ATTEMPTS):
                    raise last_error from None
                if failed is prefill and not peer_is_down(e):
                    failed = decode  # (the prefill answered: its transfer to the decode failed; try another decode)
                log.warning("request %s: %s %s %s; placing it again", request_id, failed.tier, failed.instance_id,
                            "is full" if full else "failed")  # fmt: skip
                skipped.add(failed.instance_id)
                if peer_is_down(e):
                    self.router.mark_down(failed)
            except BaseException:
                decode_call.cancel()
                raise


def deadline_clock(time_remaining, deadline_ms: int | None):
    """time_remaining() -> seconds left (or None) folded with a request's own deadline_ms from now: a function
    giving the earlier of the two. InvalidRequestError for a deadline_ms that is not positive."""
    if deadline_ms is None:
        return time_remaining
    if deadline_ms <= 0:
        raise InvalidRequestError(f"deadline_ms must be > 0, got {deadline_ms}")
    deadline = time.monotonic() + deadline_ms / 1000

    def remaining() -> float:
        left, call_left = deadline - time.monotonic(), time_remaining()
        return left if call_left is None else min(left, call_left)

    return remaining
