"""Tracing (services/tracing.py, services/grpc_tracing.py) on a real in-process gRPC server with a stand-in
Decode servicer: with nothing configured nothing is recorded or propagated, yet each call's request id is the
log context; configured (in a subprocess, since a process sets its tracer provider once), the server spans
continue the caller's W3C trace context and failed calls carry status ERROR and their gRPC code."""
import asyncio
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
from opentelemetry import trace

from tandem.services import tracing
from tandem.services.channels import ChannelPool
from tandem.services.grpc_tracing import client_interceptors
from tandem.services.logs import request_id_var
from tandem.services.server import Server
from tandem.shared.errors import InvalidRequestError
from tandem.v1 import decode_pb2, decode_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Records what each handler sees: the request id of its log context, its current span, its metadata."""

    def __init__(self):
        self.seen = []

    def _see(self, context) -> None:
        span = trace.get_current_span()
        self.seen.append({"request_id": request_id_var.get(), "recording": span.is_recording(),
                          "trace_id": span.get_span_context().trace_id,
                          "metadata": dict(context.invocation_metadata() or ())})  # fmt: skip

    async def Generate(self, request, context):
        if request.request_id == "bad":
            raise InvalidRequestError("bad request")
        self._see(context)
        yield decode_pb2.DecodeResponse(reserved=True)

    async def TransferKV(self, request_iterator, context):
        num = 0
        async for msg in request_iterator:
            num += msg.num_blocks
        tracing.annotate(blocks_received=num)
        self._see(context)
        return decode_pb2.TransferKVResponse(num_blocks_received=num)


async def serve_and_call(metadata=()) -> FakeDecode:
    servicer = FakeDecode()
    server = Server("decode", "decode-test", "127.0.0.1", 0)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server.grpc)
    await server.start()
    try:
        stub = decode_pb2_grpc.DecodeStub(ChannelPool().get(f"127.0.0.1:{server.port}"))
        async for _ in stub.Generate(decode_pb2.DecodeRequest(request_id="req-g"), metadata=metadata):
            pass

        async def messages():
            for i in range(2):
                yield decode_pb2.KVBlocksMessage(request_id="req-t", num_blocks=1, data=b"x" * 100)

        await stub.TransferKV(messages(), metadata=metadata)
    finally:
        await server.grpc.stop(None)
    return servicer


def test_with_nothing_configured_nothing_is_recorded_or_propagated():
    assert tracing.setup_tracing("decode", "decode-test", None) is False
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) and not tracing.enabled()
    assert client_interceptors() == []
    assert tracing.start_span("kv_transfer") is trace.INVALID_SPAN

    @tracing.traced("place")
    async def place():
        return trace.get_current_span().is_recording()

    async def tokens():
        yield 1

    assert asyncio.run(place()) is False
    gen = tracing.traced_stream("generate")(tokens)()
    assert inspect.isasyncgen(gen) and gen.ag_code is tokens.__code__  # (the function's own generator, unwrapped)
    # Even a caller's traceparent starts nothing: no span, yet each call has its request id as log context.
    seen = asyncio.run(serve_and_call(metadata=(("traceparent", TRACEPARENT),)))
    assert [s["request_id"] for s in seen.seen] == ["req-g", "req-t"]
    assert not any(s["recording"] or s["trace_id"] for s in seen.seen)


CONFIGURED = textwrap.dedent("""
    import asyncio, json
    import grpc
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from tandem.services import tracing
    from tandem.services.channels import ChannelPool
    from tests.unit.test_tracing import serve_and_call
    from tandem.v1 import decode_pb2, decode_pb2_grpc

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    async def main():
        with tracing.use_span(caller := tracing.start_span("caller")):
            seen = await serve_and_call()
        caller.end()
        from tandem.services.server import Server
        from tests.unit.test_tracing import FakeDecode
        server = Server("decode", "decode-test", "127.0.0.1", 0)
        decode_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(), server.grpc)
        await server.start()
        try:
            stub = decode_pb2_grpc.DecodeStub(ChannelPool().get(f"127.0.0.1:{server.port}"))
            async for _ in stub.Generate(decode_pb2.DecodeRequest(request_id="bad")):
                pass
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        await server.grpc.stop(None)
        return seen

    seen = asyncio.run(main())
    spans = [{"name": s.name, "trace_id": s.context.trace_id, "span_id": s.context.span_id,
              "parent": s.parent.span_id if s.parent else None, "kind": s.kind.name,
              "status": s.status.status_code.name, "attributes": dict(s.attributes)}
             for s in exporter.get_finished_spans()]
    print(json.dumps({"spans": spans, "seen": [s["recording"] for s in seen.seen]}))
""")


def test_configured_server_spans_continue_the_callers_trace_and_carry_the_grpc_code():
    # (PYTHONPATH: the script imports this module, tests.unit.test_tracing; the tests run in safe-path mode)
    result = subprocess.run([sys.executable, "-c", CONFIGURED], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    spans = {s["name"] if s["attributes"].get("tandem.request_id") != "bad" else "bad": s for s in out["spans"]}
    caller, generate = spans["caller"], spans["tandem.v1.Decode/Generate"]
    transfer = spans["tandem.v1.Decode/TransferKV"]
    assert out["seen"] == [True, True]  # (the handlers ran inside their server spans)
    for span, request_id in ((generate, "req-g"), (transfer, "req-t")):
        assert span["kind"] == "SERVER" and span["trace_id"] == caller["trace_id"]
        assert span["parent"] == caller["span_id"] and span["status"] == "UNSET"
        assert span["attributes"]["rpc.system"] == "grpc" and span["attributes"]["rpc.grpc.status_code"] == 0
        assert span["attributes"]["rpc.service"] == "tandem.v1.Decode"
        assert span["attributes"]["tandem.request_id"] == request_id
    assert transfer["attributes"]["tandem.blocks_received"] == 2
    assert transfer["attributes"]["tandem.messages_received"] == 2
    assert transfer["attributes"]["tandem.bytes_received"] > 200  # (two messages of 100 data bytes and metadata)
    bad = spans["bad"]
    assert bad["parent"] is None and bad["status"] == "ERROR"
    assert bad["attributes"]["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
