"""Request context over gRPC: the server interceptor every service runs, and the client interceptors of the
channels to peers (services/channels.py).

Server side (RequestContextInterceptor), for the project's own RPCs (tandem.v1.*; health and reflection are
left alone): sets the request id of the call's message (request_id; for a client-streaming call, of its
messages) as the log context (services/logs.py), and when tracing is on, extracts the caller's W3C Trace
Context (traceparent / tracestate) from the invocation metadata and runs the call in a SERVER span named
"<package>.<Service>/<Method>" with the OpenTelemetry RPC semantic conventions' attributes: rpc.system "grpc",
rpc.service, rpc.method, rpc.grpc.status_code (the code the call ended with; any but OK and CANCELLED sets
status ERROR), plus tandem.request_id, and for a client-streaming call tandem.messages_received and
tandem.bytes_received. Response-streaming handlers run with the span current only while each of their steps
runs (tracing.iterate_in), never across a yield.

Client side (client_interceptors, only when tracing is on): inject the current context into each call's
metadata, so the callee's spans join the caller's trace. No client span: the callers' own spans (place,
kv_transfer: services/tracing.py) are the parents.

Why these and not opentelemetry-instrumentation-grpc: the server side must read our request id from the
messages (for logs and spans) anyway, which that package cannot; it would add opentelemetry-instrumentation,
wrapt and beta-pinned semantic-conventions packages; and by default it traces every call, health checks too.
Our interceptors are two small pieces over grpc.aio's own interceptor API, run only where a call is ours.
"""
from __future__ import annotations

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from tandem.services import tracing
from tandem.services.grpc_errors import error_code, rewrap_handler
from tandem.services.logs import request_id_var, set_request_id

TRACED_PREFIX = "/tandem."


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Outermost interceptor of every server (before ErrorInterceptor, so a span sees the mapped code)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(TRACED_PREFIX):
            return handler
        call = _Call(method, handler_call_details.invocation_metadata)
        return rewrap_handler(handler, call.wrap_unary, call.wrap_stream,
                              lambda fn: call.wrap_unary(fn, streaming=True))


class _Call:
    """One server call: its method and metadata, and the span it runs in (when tracing is on)."""

    def __init__(self, method: str, metadata):
        self.method, self.metadata = method, metadata
        self.span = trace.INVALID_SPAN
        self.num_messages = self.num_bytes = 0

    def _start(self, request, streaming: bool) -> None:
        if not streaming:
            set_request_id(getattr(request, "request_id", None))
        if not tracing.enabled():
            return
        service, _, name = self.method[1:].partition("/")
        parent = propagate.extract({key: value for key, value in self.metadata or ()})
        self.span = tracing.TRACER.start_span(
            f"{service}/{name}", context=parent, kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})  # fmt: skip
        if request_id_var.get():
            self.span.set_attribute("tandem.request_id", request_id_var.get())

    def _finish(self, context, error: BaseException | None) -> None:
        if not self.span.is_recording():
            return
        if self.num_messages:
            self.span.set_attributes({"tandem.messages_received": self.num_messages,
                                      "tandem.bytes_received": self.num_bytes})  # fmt: skip
        code = context.code() or grpc.StatusCode.OK  # (context.abort set it: ErrorInterceptor's mapping)
        if error is not None and code == grpc.StatusCode.OK:
            code = error_code(error)
        tracing.set_code(self.span, code, context.details() or "")
        self.span.end()

    async def _messages(self, requests):
        """A client stream's messages, each one's request id made the log context (and the span's)."""
        async for msg in requests:
            if msg.request_id and msg.request_id != request_id_var.get():
                set_request_id(msg.request_id)
                if self.span.is_recording():
                    self.span.set_attribute("tandem.request_id", msg.request_id)
            if self.span.is_recording():
                self.num_messages += 1
                self.num_bytes += msg.ByteSize()
            yield msg

    def wrap_unary(self, fn, streaming: bool = False):
        async def wrapper(request, context):
            self._start(request, streaming)
            error = None
            request = self._messages(request) if streaming else request
            try:
                if not self.span.is_recording():
                    return await fn(request, context)
                with tracing.use_span(self.span):
                    return await fn(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self._finish(context, error)

        return wrapper

    def wrap_stream(self, fn):
        async def wrapper(request, context):
            self._start(request, streaming=False)
            error = None
            responses = fn(request, context)
            if self.span.is_recording():
                responses = tracing.iterate_in(trace.set_span_in_context(self.span), responses)
            try:
                async for item in responses:
                    yield item
            except BaseException as e:
                error = e
                raise
            finally:
                try:
                    await responses.aclose()  # (closed with this: the handler's own cleanup runs now, here)
                finally:
                    self._finish(context, error)

        return wrapper


class _Inject:
    @staticmethod
    def details(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        if not carrier:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in carrier.items():
            metadata.add(key, value)
        return details._replace(metadata=metadata)


class _UnaryUnary(_Inject, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self.details(details), request)


class _UnaryStream(_Inject, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self.details(details), request)


class _StreamUnary(_Inject, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self.details(details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What a channel to a peer needs: context injection when tracing is on, nothing otherwise."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary()] if tracing.enabled() else []
