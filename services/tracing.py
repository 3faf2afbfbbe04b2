"""OpenTelemetry traces of one request across the tiers, exported over OTLP/gRPC only when configured.

Specs: W3C Trace Context (traceparent / tracestate, carried in gRPC metadata: services/grpc_tracing.py); span
attributes after the OpenTelemetry semantic conventions for RPC (rpc.system, rpc.service, rpc.method,
rpc.grpc.status_code) and for GenAI (gen_ai.request.max_tokens, gen_ai.usage.input_tokens / output_tokens,
gen_ai.response.finish_reasons); the project's own attributes are tandem.<name>.

What one request's trace holds (the SERVER spans are the gRPC calls, one per call: grpc_tracing.py):
  gateway  tandem.v1.Gateway/Generate (SERVER; absent for the HTTP API, where generate is the root)
             generate       one completion: request id, prompt tokens, max_tokens, then finish reason, completion
                            and cached tokens, TTFT (tandem.ttft_ms, and the event first_token)
               place        routing and placement, retries included
                 route      the router's choice: decode and prefill instance ids, the rule, cached tokens
                 reserve    waiting for the decode to reserve the prompt's KV blocks
               decoding     relaying the decode's tokens after the first one
  prefill  tandem.v1.Prefill/Prefill (SERVER, child of place)
             prefill        computing the prompt: prompt and cached tokens
               kv_transfer  streaming its KV to the decode: blocks and bytes (ends when the decode has it all)
  decode   tandem.v1.Decode/Generate (SERVER, child of place): the reservation and the decoding
           tandem.v1.Decode/TransferKV (SERVER, child of kv_transfer): blocks, messages and bytes received
A span that fails gets status ERROR and rpc.grpc.status_code, the code its error maps to (services/grpc_errors.py);
a cancelled one only the code (CANCELLED, 1): the gateway cancels each decode stream once it has the last token.

Off unless an endpoint is given (--otlp-traces-endpoint, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT): then the SDK is never imported, the global tracer provider stays OpenTelemetry's
no-op proxy, every helper here returns at once (decorated functions run unwrapped), and channels get no client
interceptor. The SDK reads its own OTEL_* variables (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...).
"""
from __future__ import annotations

import asyncio
import functools
from contextlib import contextmanager

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from tandem.services.client import finish_name
from tandem.services.grpc_errors import error_code
from tandem.services.logs import set_request_id

# keyword -> semantic-convention attribute; any other keyword becomes tandem.<keyword>
SEMCONV = {"prompt_tokens": "gen_ai.usage.input_tokens", "completion_tokens": "gen_ai.usage.output_tokens",
           "max_tokens": "gen_ai.request.max_tokens", "finish_reasons": "gen_ai.response.finish_reasons"}
TRACER = trace.get_tracer("tandem")  # (a proxy until setup_tracing installs a provider)


def setup_tracing(tier: str, instance_id: str, endpoint: str | None) -> bool:
    """With an OTLP endpoint ("http://host:4317"): install the SDK's tracer provider for this process, its
    spans batched to that endpoint over gRPC, its resource naming the service (tandem-<tier>, unless
    OTEL_SERVICE_NAME says otherwise) and instance. Without one, nothing. Returns whether tracing is on."""
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.instance.id": instance_id, "tandem.tier": tier})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": f"tandem-{tier}"}))
    provider = TracerProvider(resource=resource)  # (flushed at exit: shutdown_on_exit)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return True


def enabled() -> bool:
    """Whether this process records spans (setup_tracing installed a provider)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def attributes(**values) -> dict:
    """Keyword values as span attributes (SEMCONV names, else tandem.<name>); None values are left out."""
    return {SEMCONV.get(k, f"tandem.{k}"): v for k, v in values.items() if v is not None}


def start_span(name: str, **values) -> Span:
    """A span, child of the current one, that the caller ends (span.end()); the no-op span when tracing is off."""
    return TRACER.start_span(name, attributes=attributes(**values)) if enabled() else INVALID_SPAN


@contextmanager
def use_span(span: Span):
    """Make span current inside the block without ending it (calls started there carry it)."""
    if not span.is_recording():
        yield span
        return
    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        yield span


def annotate(span: Span | None = None, /, **values) -> None:
    """Set attributes on span (default: the current one); nothing when tracing is off."""
    span = span or trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes(**values))


def bind_request(request_id: str, **values) -> None:
    """The current context serves request_id: its log lines carry it, and the current span gets it with values."""
    set_request_id(request_id)
    annotate(request_id=request_id, **values)


def set_code(span: Span, code: grpc.StatusCode, description: str = "") -> None:
    """rpc.grpc.status_code on span, and status ERROR for any code but OK and CANCELLED."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {description}" if description else code.name))


def record_error(span: Span, error: BaseException) -> None:
    if span.is_recording():
        set_code(span, error_code(error), str(error))
        if isinstance(error, Exception):
            span.record_exception(error)


def end_when_done(span: Span, future: asyncio.Future) -> None:
    """End span when future does, with its error (cancelled or failed) if any."""
    def done(f: asyncio.Future) -> None:
        if (error := asyncio.CancelledError() if f.cancelled() else f.exception()) is not None:
            record_error(span, error)
        span.end()

    if span.is_recording():
        future.add_done_callback(done)


@contextmanager
def _current_span(name: str, **values):
    """A span of its own around the block, current there; an error escaping the block is recorded on it."""
    with TRACER.start_as_current_span(name, attributes=attributes(**values), record_exception=False,
                                      set_status_on_exception=False) as span:  # fmt: skip
        try:
            yield span
        except BaseException as e:
            record_error(span, e)
            raise


def traced(name: str, result_attributes=None):
    """Decorator: each call of an async function runs in a span; result_attributes(result) -> keywords of
    attributes(), set when it returns."""
    def decorate(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            if not enabled():
                return await fn(*args, **kwargs)
            with _current_span(name) as span:
                result = await fn(*args, **kwargs)
                if result_attributes is not None:
                    span.set_attributes(attributes(**result_attributes(result)))
                return result

        return wrapper

    return decorate


async def in_span(name: str, awaitable, **values):
    """await awaitable inside a span of its own."""
    if not enabled():
        return await awaitable
    with _current_span(name, **values):
        return await awaitable


def traced_stream(name: str, observe=None):
    """Decorator: each iteration of an async generator function runs in a span, ended with the iteration;
    observe(span, index, item) sees each item. Tracing off: the function's own generator, unwrapped."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return _traced_iteration(name, observe, fn(*args, **kwargs)) if enabled() else fn(*args, **kwargs)

        return wrapper

    return decorate


async def _traced_iteration(name: str, observe, agen):
    span, index = TRACER.start_span(name), 0
    try:
        async for item in iterate_in(trace.set_span_in_context(span), agen):
            if observe is not None:
                observe(span, index, item)
            index += 1
            yield item
    except BaseException as e:
        record_error(span, e)
        raise
    finally:
        span.end()


async def iterate_in(context, agen):
    """Iterate agen with context current while each step of it runs, never across a yield (whoever consumes
    this may resume or close it from another task); agen is closed with this."""
    try:
        while True:
            token = otel_context.attach(context)
            try:
                item = await agen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield item
    finally:
        token = otel_context.attach(context)
        try:
            await agen.aclose()
        finally:
            otel_context.detach(token)


def observe_generate(span: Span, index: int, msg) -> None:
    """For the gateway's generate span: the first message is the first token; the last one's finish reason,
    usage and timings become attributes."""
    if index == 0:
        span.add_event("first_token")
    if msg.HasField("finish_reason"):
        span.set_attributes(attributes(finish_reasons=[finish_name(msg.finish_reason)], completion_tokens=msg.usage.completion_tokens,
                                       cached_tokens=msg.usage.cached_tokens, ttft_ms=msg.timings.ttft_ms,
                                       e2e_ms=msg.timings.e2e_ms))  # fmt: skip
