"""Placement: start one request on the cluster. Route it (services/gateway/router.py), reserve its blocks on the
decode, then prefill it on the prefill naming that decode (only the blocks the decode lacks are sent), or let the
decode compute the prompt itself (Route.prefill None). An instance that is unreachable (dead but still in the
registry until its TTL) or fails is skipped and the request is placed again, up to MAX_ATTEMPTS failures; while
every decode is full the request waits for room, within the admission queue's wait bound
(services/gateway/admission.py). A request's LoRA adapter is loaded first on each chosen instance that lacks it
(Route.lora_loads: Instance.LoadLoRAAdapter from the directory the other instances list, with the digest they list:
files changed on disk since are refused there, never served); one that refuses it is skipped as a failed instance
is."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from tandem.services.channels import ChannelPool
from tandem.services.gateway.admission import AdmissionQueue, OverloadedError, check_predicted_ttft
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.prefill_watch import PrefillLostError, prefill_watching_decode
from tandem.services.gateway.request import GatewayRequest
from tandem.services.gateway.router import Route, Router
from tandem.services.grpc_errors import peer_is_down, upstream_error
from tandem.services.tracing import in_span, traced
from tandem.shared.cluster_state.registry import InstanceInfo
from tandem.shared.errors import DeadlineError, NoInstanceError, UpstreamError
from tandem.v1 import common_pb2, common_pb2_grpc, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3  # failed placements of one request (a full decode is no failure: the request waits for room)
ROOM_POLL_S, ROOM_POLL_MAX_S = 0.05, 1.0  # first and longest pause between placements while every decode is full
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(slots=True)
class Placement:
    """A request started on the cluster."""

    decode_call: object  # the decode's Generate stream (read() -> DecodeResponse; cancel())
    first: decode_pb2.DecodeResponse  # the message carrying the first token (from the prefill or the decode)
    route: Route
    prefill_reply: prefill_pb2.PrefillResponse | None  # None: the decode computed the prompt


class AttemptFailed(Exception):
    """One placement attempt failed (its decode call already cancelled). error: the request's error should it
    fail for good; instance: the one to route around next; retryable: whether placing it again may help;
    counts: whether it counts towards MAX_ATTEMPTS (a full decode does not); mark_down: whether the instance
    seems gone (Router.mark_down); reason: for the log."""

    def __init__(self, error: UpstreamError, instance: InstanceInfo, retryable: bool, counts: bool, mark_down: bool,
                 reason: str):
        super().__init__(reason)
        self.error, self.instance, self.retryable, self.counts = error, instance, retryable, counts
        self.mark_down, self.reason = mark_down, reason


class DecodeLostError(UpstreamError):
    """A placed request's decode stream failed in a way another decode may cure (UNAVAILABLE), so the request can
    migrate (pipeline.py). reason: "decode_failed" (the call broke: the decode died, froze past the keepalive
    pings, or stopped while draining) or "kv_transfer_failed" (the decode is alive but the prompt's KV never came
    whole: its prefill died after sending the first token)."""

    def __init__(self, message: str, reason: str):
        super().__init__("UNAVAILABLE", message)
        self.reason = reason


class Placer:
    """Places requests (place) and reads a placed request's decode stream (read_decode)."""

    def __init__(self, router: Router, channels: ChannelPool, admission: AdmissionQueue, metrics: GatewayMetrics):
        self.router, self.channels, self.admission, self.metrics = router, channels, admission, metrics

    @traced("place")
    async def place(self, request: GatewayRequest, pinned: InstanceInfo | None = None) -> Placement:
        """Start request (validated) on the cluster; the first token comes from the prefill reply or the decode's
        stream. Failed attempts are placed again (see the module's docstring). When every decode is full, the
        request waits for room (polling, with backoff) for as long as the admission queue lets a request wait,
        then OverloadedError (DeadlineError when its deadline comes first). The client's deadline, if it set one,
        bounds every call; a prefill whose queue would already take longer refuses the request at once
        (DeadlineError). pinned: a decode to try first, computing the prompt there (it holds the prompt's
        blocks: the pipeline's n completions and beam-search steps). Raises UpstreamError when an instance fails
        for good, NoInstanceError when there is none."""
        skipped: set[str] = set()
        last_error: UpstreamError | None = None
        num_failures, room_wait_s, started = 0, ROOM_POLL_S, time.monotonic()
        for attempt in itertools.count(1):
            timeout = request.time_remaining()
            if timeout is not None and timeout <= 0:
                raise DeadlineError("the request's deadline passed before it was placed")
            try:
                route = await self._route(request, pinned if attempt == 1 else None, skipped)
            except NoInstanceError:
                if last_error is None:
                    raise
                if last_error.status != "RESOURCE_EXHAUSTED":  # every instance left was tried: say why one failed
                    raise last_error from None
                await self._wait_for_room(started, room_wait_s, timeout, last_error)
                room_wait_s = min(2 * room_wait_s, ROOM_POLL_MAX_S)
                skipped.clear()
                last_error = None
                continue
            check_predicted_ttft(route, request.num_tokens, timeout)
            # Each placement its own id on the engines: a failed attempt's teardown (its broken KV stream) must not
            # touch the next attempt's reservation when that lands on the same decode.
            placement_id = request.request_id if attempt == 1 else f"{request.request_id}.{attempt}"
            log.info("request %s routed: %s", placement_id, route.explain())
            self.metrics.observe_route(route)
            try:
                return await self._attempt(request, route, placement_id, timeout)
            except AttemptFailed as failure:
                last_error = failure.error
                if not failure.retryable or (failure.counts and (num_failures := num_failures + 1) == MAX_ATTEMPTS):
                    raise last_error from None
                log.warning("request %s: %s; placing it again", request.request_id, failure.reason)
                skipped.add(failure.instance.instance_id)
                if failure.mark_down:
                    self.router.mark_down(failure.instance)

    async def _route(self, request: GatewayRequest, pinned: InstanceInfo | None, skipped: set[str]) -> Route:
        if pinned is not None:
            return Route(pinned, None, explanation=[f"decode {pinned.instance_id}: holds this prompt"], reason="pinned")
        params = request.sampling_params
        # (a migrated request's session moves to wherever the cost model sends it: its decode just failed)
        return await self.router.route(request.token_ids, request.num_prompt_tokens + params.max_tokens,
                                       request.cache_salt, skipped, local=not params.HasField("prompt_logprobs"),
                                       session_id=request.session_id, keep_session=not request.output_token_ids,
                                       lora_name=request.lora_name)

    async def _load_adapter(self, route: Route, timeout: float | None) -> None:
        """Load the route's adapter on the chosen instances that lack it (at once on both); AttemptFailed naming
        the first that could not (skipped next: it is down, or refuses the adapter's directory)."""
        async def load(instance: InstanceInfo) -> None:
            stub = common_pb2_grpc.InstanceStub(self.channels.get(instance.address, instance.instance_id))
            try:
                reply = await stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
                    lora_name=route.lora.name, lora_path=route.lora.path, expected_digest=route.lora.digest),
                    timeout=timeout)  # (only the cluster's files: the engine refuses others, loading nothing)
            except grpc.aio.AioRpcError as e:
                error = upstream_error(e, instance.tier, instance.instance_id, f"loading adapter {route.lora.name}")
                raise AttemptFailed(error, instance, retryable=True, counts=True, mark_down=peer_is_down(e),
                                    reason=f"{instance.tier} {instance.instance_id} did not load adapter "
                                           f"{route.lora.name}") from None  # fmt: skip
            if reply.adapter.digest != route.lora.digest:  # (its files changed since the others loaded them)
                raise AttemptFailed(UpstreamError("INVALID_ARGUMENT", f"{instance.tier} {instance.instance_id}: "
                                                  f"adapter {route.lora.name}'s files differ from the cluster's"),
                                    instance, retryable=True, counts=True, mark_down=False,
                                    reason=f"{instance.tier} {instance.instance_id} loaded other files as adapter "
                                           f"{route.lora.name}")  # fmt: skip
            self.router.lora_changes.loaded(instance.instance_id, route.lora)
            log.info("adapter %s loaded on %s %s in %.0f ms (routing chose it)", route.lora.name, instance.tier,
                     instance.instance_id, reply.load_ms)  # fmt: skip

        results = await asyncio.gather(*(load(i) for i in route.lora_loads), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _wait_for_room(self, started: float, room_wait_s: float, timeout: float | None,
                             last_error: UpstreamError) -> None:
        """Every decode is full: wait room_wait_s for room (requests finish), within the admission queue's bound
        counted from started (monotonic seconds); OverloadedError past it, DeadlineError past the deadline."""
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

    async def _attempt(self, request: GatewayRequest, route: Route, placement_id: str,
                       timeout: float | None) -> Placement:
        """Reserve on route's decode, then prefill (or compute the prompt there). AttemptFailed for a failure
        placing the request again may cure; UpstreamError when the decode failed computing the prompt."""
        decode, prefill = route.decode, route.prefill
        params, prompt_ids = request.sampling_params, request.prompt_token_ids
        if route.lora_loads:
            await in_span("load_adapter", self._load_adapter(route, timeout), lora_name=route.lora.name)
        decode_stub = decode_pb2_grpc.DecodeStub(self.channels.get(decode.address, decode.instance_id))
        decode_call = decode_stub.Generate(
            decode_pb2.DecodeRequest(request_id=placement_id, prompt_token_ids=prompt_ids, sampling_params=params,
                                     cache_salt=request.cache_salt, compute_prompt=prefill is None,
                                     priority=request.priority, output_token_ids=request.output_token_ids,
                                     lora_name=request.lora_name),
            timeout=timeout,
        )  # fmt: skip
        failed, doing = decode, "reserving KV blocks"
        try:
            reply = await in_span("reserve", decode_call.read(), decode_instance_id=decode.instance_id)
            if reply is grpc.aio.EOF or not reply.reserved:
                raise UpstreamError("INTERNAL", f"decode {decode.instance_id} did not reserve the request")
            if prefill is None:
                doing = "computing the prompt"
                try:
                    return Placement(decode_call, await self.read_decode(decode_call, decode), route, None)
                except DecodeLostError as e:  # (before the first token: place it again; cancelled below)
                    raise AttemptFailed(e, decode, retryable=True, counts=True, mark_down=False,
                                        reason=f"decode {decode.instance_id} failed computing the prompt") from None
            failed, doing = prefill, "prefilling"
            prefill_stub = prefill_pb2_grpc.PrefillStub(self.channels.get(prefill.address, prefill.instance_id))
            prefill_call = prefill_stub.Prefill(
                prefill_pb2.PrefillRequest(request_id=placement_id, prompt_token_ids=prompt_ids, sampling_params=params,
                                           decode_address=decode.address, decode_instance_id=decode.instance_id,
                                           num_skip_blocks=reply.num_skip_blocks,
                                           cache_salt=request.cache_salt, priority=request.priority,
                                           output_token_ids=request.output_token_ids, lora_name=request.lora_name,
                                           decode_tensor_parallel_size=decode.tensor_parallel_size,
                                           decode_kv_endpoints=decode.kv_endpoints
                                           if decode.tensor_parallel_size > 1 else ()),
                timeout=timeout,
            )  # fmt: skip
            prefill_reply, decode_call = await prefill_watching_decode(prefill_call, decode_call, prefill)
            first = decode_pb2.DecodeResponse(token_ids=[prefill_reply.first_token_id])
            if prefill_reply.HasField("first_token_logprobs"):
                first.logprobs.append(prefill_reply.first_token_logprobs)
            return Placement(decode_call, first, route, prefill_reply)
        except PrefillLostError as e:  # (the decode freed the reservation: the prefill died or stalls)
            decode_call.cancel()
            raise AttemptFailed(UpstreamError("UNAVAILABLE", str(e)), prefill, retryable=True, counts=True,
                                mark_down=True, reason=str(e)) from None  # fmt: skip
        except grpc.aio.AioRpcError as e:
            decode_call.cancel()
            error = upstream_error(e, failed.tier, failed.instance_id, doing)
            full = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # (a decode's pool: not a failure)
            if failed is prefill and not peer_is_down(e):
                failed = decode  # (the prefill answered: its transfer to the decode failed; try another decode)
            reason = f"{failed.tier} {failed.instance_id} {'is full' if full else 'failed'}"
            raise AttemptFailed(error, failed, retryable=e.code() in RETRY_CODES, counts=not full,
                                mark_down=peer_is_down(e), reason=reason) from None
        except BaseException:  # (an UpstreamError from read_decode: the decode failed the prompt; AttemptFailed)
            decode_call.cancel()
            raise

    async def end_of(self, decode_call, timeout_s: float = 1.0) -> None:
        """Wait (at most timeout_s) for a finished request's decode call to end, so that its status is the decode's
        OK rather than the CANCELLED of a cancel that races it; any error is ignored (the request is done)."""
        try:
            await asyncio.wait_for(decode_call.read(), timeout_s)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass

    async def read_decode(self, decode_call, decode: InstanceInfo,
                          prefill: InstanceInfo | None = None) -> decode_pb2.DecodeResponse:
        """The decode's next message; UpstreamError if the call failed, ended early or the decode failed it: a
        decode found dead is routed around from then on (Router.mark_down). DecodeLostError (UNAVAILABLE) when
        another decode may cure it: the call broke, or the prompt's KV never came whole (its prefill, named, died
        after sending the first token)."""
        try:
            reply = await decode_call.read()
        except grpc.aio.AioRpcError as e:
            if peer_is_down(e):
                self.router.mark_down(decode)
            error = upstream_error(e, "decode", decode.instance_id, "decoding")
            if error.status == "UNAVAILABLE":
                raise DecodeLostError(str(error), "decode_failed") from None
            raise error from None
        if reply is grpc.aio.EOF:
            raise UpstreamError("INTERNAL", f"decode {decode.instance_id} ended the stream without a finish reason")
        if reply.error:
            status = ("INVALID_ARGUMENT" if reply.error_is_invalid_request else
                      "UNAVAILABLE" if reply.error_is_unavailable else "INTERNAL")  # fmt: skip
            source = f" (the prompt's KV came from prefill {prefill.instance_id})" if (
                reply.error_is_unavailable and prefill is not None) else ""  # fmt: skip
            message = f"decode {decode.instance_id}: {reply.error}{source}"
            if status == "UNAVAILABLE":
                raise DecodeLostError(message, "kv_transfer_failed")
            raise UpstreamError(status, message)
        return reply
