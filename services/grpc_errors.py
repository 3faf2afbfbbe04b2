"""The one table from the project's error types (shared/errors.py) to gRPC status codes, and the server
interceptor that applies it to every service.

Anything not in the table is a bug: the client gets INTERNAL with a generic message naming the tier and the
instance id (where to look), and the traceback goes to this process's log. A gRPC error from a peer that was not
turned into an UpstreamError is such a bug too: its details may carry internal addresses.
"""
from __future__ import annotations

import asyncio
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from tandem.shared.errors import (DeadlineError, InvalidRequestError, NoCapacityError, NoInstanceError,
                                  RequestFailedError, TandemError, UnknownLoRAError, UnknownRequestError, UpstreamError)

log = logging.getLogger(__name__)

STATUS_CODES: dict[type[TandemError], grpc.StatusCode] = {  # (the first type an error is an instance of)
    UnknownLoRAError: grpc.StatusCode.NOT_FOUND,  # (an InvalidRequestError: before it)
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownRequestError: grpc.StatusCode.NOT_FOUND,
    NoCapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NoInstanceError: grpc.StatusCode.UNAVAILABLE,
    DeadlineError: grpc.StatusCode.DEADLINE_EXCEEDED,
    RequestFailedError: grpc.StatusCode.INTERNAL,
    # UpstreamError: the code the peer answered with (its .status)
}
# Codes whose details a peer's own interceptor wrote (public by construction); UNAVAILABLE can come from the
# transport, whose details name addresses. Any other code (UNIMPLEMENTED, UNKNOWN, CANCELLED: not a peer of
# ours answering, or the call broke) is passed on as UNAVAILABLE.
_PEER_DETAILS_ARE_PUBLIC = {*STATUS_CODES.values(), grpc.StatusCode.INTERNAL} - {grpc.StatusCode.UNAVAILABLE}
_PEER_CODES = _PEER_DETAILS_ARE_PUBLIC | {grpc.StatusCode.UNAVAILABLE}


def status_for(error: Exception, tier: str, instance_id: str) -> tuple[grpc.StatusCode, str]:
    """The status code and public message for an exception raised while serving a call."""
    if isinstance(error, UpstreamError):
        return grpc.StatusCode[error.status], str(error)
    for error_type, code in STATUS_CODES.items():
        if isinstance(error, error_type):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error in {tier} {instance_id}; its log has the details"


def error_code(error: BaseException) -> grpc.StatusCode:
    """The code a call ends with when error escapes it: a peer's own code, CANCELLED, or status_for's."""
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    return status_for(error, "", "")[0] if isinstance(error, Exception) else grpc.StatusCode.UNKNOWN


# Trailing metadata of the errors our interceptors write: the peer answered (alive), or refused while draining
ANSWERED_BY_KEY, DRAINING_KEY = "tandem-answered-by", "tandem-draining"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # a refusal's retry hint, milliseconds (gRFC A6's server pushback)


def peer_is_down(error: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call means its callee is gone or going: UNAVAILABLE from the transport (no interceptor
    of ours answered: unreachable, killed) or a drain's refusal; not an error the callee passed on from a
    peer of its own (a prefill whose decode failed is itself alive)."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    keys = {key for key, _ in error.trailing_metadata() or ()}
    return DRAINING_KEY in keys or ANSWERED_BY_KEY not in keys


def upstream_error(error: grpc.aio.AioRpcError, tier: str, instance_id: str, doing: str) -> UpstreamError:
    """A failed call to a peer as an UpstreamError with the peer's code, naming it by tier and instance id.
    The peer's details are passed on only where its own interceptor wrote them; the rest go to the log."""
    code = error.code()
    log.warning("%s %s failed while %s: %s %s", tier, instance_id, doing, code.name, error.details())
    if code in _PEER_DETAILS_ARE_PUBLIC:
        return UpstreamError(code.name, f"{tier} {instance_id}: {error.details()}")
    status = code.name if code in _PEER_CODES else "UNAVAILABLE"
    return UpstreamError(status, f"{tier} {instance_id} failed while {doing} ({code.name})")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Applies status_for to every handler of a server: unary and streaming responses alike."""

    def __init__(self, tier: str, instance_id: str):
        self.tier = tier
        self.instance_id = instance_id

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return handler and rewrap_handler(handler, self._wrap_unary, self._wrap_stream, self._wrap_client_stream,
                                          tolerant(handler.request_deserializer))  # fmt: skip

    async def _abort(self, context, error: Exception):
        code, message = status_for(error, self.tier, self.instance_id)
        if code == grpc.StatusCode.INTERNAL and not isinstance(error, UpstreamError):
            log.error("unhandled error", exc_info=error)
        metadata = [(ANSWERED_BY_KEY, self.instance_id)]
        if (retry_after_s := getattr(error, "retry_after_s", None)) is not None:  # (an OverloadedError)
            metadata.append((RETRY_PUSHBACK_KEY, str(int(retry_after_s * 1000))))
        await context.abort(code, message, trailing_metadata=tuple(metadata))

    def _wrap_unary(self, fn):
        async def wrapper(request, context):
            try:
                if isinstance(request, UndecodableRequest):
                    raise InvalidRequestError(request.reason)
                return await fn(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await self._abort(context, e)

        return wrapper

    def _wrap_stream(self, fn):
        if not inspect.isasyncgenfunction(fn):  # a handler that writes with context.write (grpc.health's Watch)
            return self._wrap_unary(fn)

        async def wrapper(request, context):
            try:
                if isinstance(request, UndecodableRequest):
                    raise InvalidRequestError(request.reason)
                async for item in fn(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await self._abort(context, e)

        return wrapper


    def _wrap_client_stream(self, fn):
        wrapped = self._wrap_unary(fn)

        async def decoded(requests):
            async for msg in requests:
                if isinstance(msg, UndecodableRequest):
                    raise InvalidRequestError(msg.reason)  # (inside the handler: it cleans up as for any error)
                yield msg

        async def wrapper(requests, context):
            return await wrapped(decoded(requests), context)

        return wrapper


class UndecodableRequest:
    """What a request message whose bytes do not parse becomes (a string field that is not UTF-8, a truncated
    field; grpcio would answer UNKNOWN naming a Python exception): ErrorInterceptor refuses it with
    INVALID_ARGUMENT before the handler sees it. Outer interceptors may read request_id (empty)."""

    request_id = ""

    def __init__(self, reason: str):
        self.reason = reason

    def ByteSize(self) -> int:
        return 0


def tolerant(deserializer):
    """deserializer, returning an UndecodableRequest instead of raising on bytes that do not parse."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return UndecodableRequest(f"the request could not be parsed: {e}")

    return deserialize


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap_unary, wrap_stream,
                   wrap_client_stream=None, request_deserializer=None) -> grpc.RpcMethodHandler:
    """handler with its behaviour wrapped: wrap_unary(fn) for unary-unary, wrap_stream(fn) for unary-stream,
    wrap_client_stream(fn) (default wrap_unary) for stream-unary; a bidirectional handler is returned as it is.
    request_deserializer replaces the handler's (default: kept). What every server interceptor here does with
    grpc.aio's handler API."""
    serializers = request_deserializer or handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), *serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), *serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler((wrap_client_stream or wrap_unary)(handler.stream_unary),
                                                    *serializers)
    return handler
