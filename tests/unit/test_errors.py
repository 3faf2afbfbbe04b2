"""The error table (services/grpc_errors.py): each project error type to its status code, anything else to a
generic INTERNAL, peers' transport details kept out of public messages; and the interceptor applying it on a
real gRPC server."""
import asyncio

import grpc
import pytest

from tandem.services.grpc_errors import status_for, upstream_error
from tandem.services.server import Server
from tandem.shared.errors import (DeadlineError, InvalidRequestError, NoCapacityError, NoInstanceError, RequestFailedError,
                           UnknownRequestError, UpstreamError)
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

CASES = [
    (InvalidRequestError("prompt is empty"), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (UnknownRequestError("unknown request 'x'"), grpc.StatusCode.NOT_FOUND, "unknown request 'x'"),
    (NoCapacityError("no room for 40 prompt tokens of KV"), grpc.StatusCode.RESOURCE_EXHAUSTED, "no room for 40"),
    (NoInstanceError("no live decode instance"), grpc.StatusCode.UNAVAILABLE, "no live decode instance"),
    (DeadlineError("deadline passed"), grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed"),
    (RequestFailedError("non-finite logits"), grpc.StatusCode.INTERNAL, "non-finite logits"),
    (UpstreamError("RESOURCE_EXHAUSTED", "decode decode-1: full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "1: full"),
]
# Built-ins a bug raises: never blamed on the client, never shown.
BUGS = [ValueError("bad value at 10.0.0.7:5000"), KeyError("slot"), MemoryError(), RuntimeError("boom"),
        ZeroDivisionError("division by zero")]


@pytest.mark.parametrize("error, code, text", CASES, ids=lambda c: type(c).__name__ if isinstance(c, Exception) else "")
def test_each_project_error_has_its_status(error, code, text):
    got_code, message = status_for(error, "decode", "decode-1")
    assert got_code == code and text in message


@pytest.mark.parametrize("error", BUGS, ids=lambda e: type(e).__name__)
def test_anything_else_is_internal_with_a_generic_message(error):
    code, message = status_for(error, "decode", "decode-1a2b")
    assert code == grpc.StatusCode.INTERNAL
    assert message == "internal error in decode decode-1a2b; its log has the details"


def rpc_error(code, details):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_upstream_transport_details_never_reach_the_client():
    details = "failed to connect to all addresses; last error: ipv4:127.0.0.1:41557: Connection refused"
    error = upstream_error(rpc_error(grpc.StatusCode.UNAVAILABLE, details), "decode", "decode-9", "decoding")
    assert error.status == "UNAVAILABLE" and "127.0.0.1" not in str(error) and "decode-9" in str(error)
    passed_on = upstream_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids must be in [0, 5)"),
                               "prefill", "prefill-3", "prefilling")  # fmt: skip
    assert passed_on.status == "INVALID_ARGUMENT"
    assert str(passed_on) == "prefill prefill-3: prompt token ids must be in [0, 5)"
    not_ours = upstream_error(rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"), "decode", "d-1", "x")
    assert not_ours.status == "UNAVAILABLE"  # only the table's codes pass through


class Raising(gateway_pb2_grpc.GatewayServicer):
    """Generate raises the exception named by the request's prompt, after streaming one message."""

    async def Generate(self, request, context):
        yield gateway_pb2.GenerateResponse(text="first")
        raise {type(e).__name__: e for e, _, _ in CASES + [(b, None, None) for b in BUGS]}[request.prompt]


async def _call_each(names):
    server = Server("gateway", "gateway-test", "127.0.0.1", 0)
    gateway_pb2_grpc.add_GatewayServicer_to_server(Raising(), server.grpc)
    await server.grpc.start()
    results = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for name in names:
                call = stub.Generate(gateway_pb2.GenerateRequest(prompt=name), timeout=10)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    results[name] = (e.code(), e.details())
    finally:
        await server.grpc.stop(None)
    return results


def test_the_interceptor_applies_the_table_to_a_streaming_call():
    results = asyncio.run(_call_each([type(e).__name__ for e, _, _ in CASES] + [type(b).__name__ for b in BUGS]))
    for error, code, text in CASES:
        assert results[type(error).__name__][0] == code and text in results[type(error).__name__][1]
    for bug in BUGS:
        code, details = results[type(bug).__name__]
        assert code == grpc.StatusCode.INTERNAL and "gateway-test" in details
        assert type(bug).__name__ not in details and "10.0.0.7" not in details
