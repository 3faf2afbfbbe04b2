"""The gRPC server every service runs: the request-context interceptor (request id for logs, trace spans:
services/grpc_tracing.py) and the error interceptor, raised message limits, the standard health service, and a
graceful stop on SIGTERM/SIGINT (health NOT_SERVING first, then in-flight calls get a grace)."""
from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.grpc_errors import ErrorInterceptor
from services.grpc_tracing import RequestContextInterceptor

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
STOP_GRACE_S = 2.0


def new_instance_id(tier: str) -> str:
    """A fresh id for a process of a tier ("decode-1a2b3c4d"): what logs, the registry and errors call it."""
    return f"{tier}-{uuid.uuid4().hex[:8]}"


class Server:
    """An asyncio gRPC server bound to host:port (0 picks a free port: see .port).

    OSError if the address cannot be bound.
    """

    def __init__(self, tier: str, instance_id: str, host: str, port: int):
        self.tier, self.instance_id = tier, instance_id
        interceptors = [RequestContextInterceptor(), ErrorInterceptor(tier, instance_id)]  # (outermost first)
        self.grpc = grpc.aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)

    async def start(self) -> None:
        """Accept calls and report SERVING."""
        await self.grpc.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def serve_until_signal(self, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM or SIGINT; then report NOT_SERVING, await on_stop() (e.g. leave the registry)
        and stop, giving in-flight calls STOP_GRACE_S seconds."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.health.enter_graceful_shutdown()
        if on_stop is not None:
            await on_stop()
        await self.grpc.stop(grace=STOP_GRACE_S)
