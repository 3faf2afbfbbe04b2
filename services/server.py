"""The gRPC server every service runs: the request-context interceptor (request id for logs, trace spans:
services/grpc_tracing.py), the drain interceptor and the error interceptor, raised message limits, the standard
health service, and the drain on SIGTERM/SIGINT.

Drain (what Kubernetes' pod termination and a rolling restart expect): health reports NOT_SERVING at once, new
calls of the admission methods (those that start a request here) are refused with UNAVAILABLE, which the gateway
answers by placing the request elsewhere; on_drain runs (an engine leaves the registry, so the gateway stops
routing to it); calls in flight (and whatever busy() reports, e.g. KV still streaming out) get up to
drain_timeout_s to finish; then the server stops, cancelling what is left. A process still alive EXIT_GRACE_S
after that (its drain or its exit stuck: a bug) writes every thread's stack and every asyncio task's awaits to
its log and exits 1, so a stop is bounded and says where it hung."""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.services.flags import DEFAULT_DRAIN_TIMEOUT_S
from tandem.services.grpc_errors import DRAINING_KEY, ErrorInterceptor, rewrap_handler
from tandem.services.grpc_tracing import TRACED_PREFIX, RequestContextInterceptor
from tandem.services.security import TLSConfig
from tandem.shared import envs

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # (servers: accept the keepalive pings of our channels, services/channels.py, as often as they come)
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
]
# The gateway's public port receives at most this much per message: any request within the field limits (README
# "Limits": 64 characters per token of context, 256 Ki characters of structured_output) fits with room to spare
PUBLIC_MAX_RECEIVE_BYTES = 8 * 1024 * 1024
STOP_GRACE_S = 2.0
EXIT_GRACE_S = 10.0  # how long past its drain timeout and stop grace a stopping process may take to exit


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every thread's Python stack to stderr (the service's log) and the process goes on: how to
    see where a process that does not answer, or does not finish its drain, is stuck (LocalCluster.terminate
    sends it before it gives up on a child)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_on_signal_while_starting() -> None:
    """Until Server.start takes over, SIGTERM/SIGINT end the process at once (exit 0): a service still
    loading its model has nothing to drain, and as a container's PID 1 it would otherwise ignore SIGTERM.
    Started by a launcher that could not give it a parent-death signal (TANDEM_LAUNCHER_PID: services/launcher.py),
    the process also ends (SIGKILL) once that launcher is gone, for its whole life."""
    def leave(signum, frame):
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave)
    if envs.TANDEM_LAUNCHER_PID is not None:
        threading.Thread(target=exit_with_parent, args=(envs.TANDEM_LAUNCHER_PID,), name="launcher-watchdog",
                         daemon=True).start()  # fmt: skip


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """SIGKILL this process once its parent is no longer parent_pid (it died: this process was reparented)."""
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    log.error("launcher %d is gone: exiting", parent_pid)
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_stuck(after_s: float, loop: asyncio.AbstractEventLoop) -> None:
    """The drain's backstop (module docstring): every thread's stack and every task of loop (where each coroutine
    waits: a thread's stack shows only the idle loop) to the log, then exit 1 at once."""
    log.error("still running %.0f s after the drain began: exiting 1; every thread's stack and every asyncio task "
              "follow", after_s)  # fmt: skip
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(all_threads=True)
    try:  # (read from this thread while the loop's may change the set; all_tasks retries that itself)
        tasks = asyncio.all_tasks(loop)
    except RuntimeError:
        tasks = set()
    for task in tasks:
        print(f"{task!r}, awaiting (outermost first):\n{_awaiting(task.get_coro())}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def _awaiting(coro) -> str:
    """Where a task's coroutine waits: each frame of its chain of awaits, outermost first (Task.print_stack shows
    only the outermost; a compiled coroutine, as gRPC's, has no frames)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return "\n".join(lines) or "  (no Python frames)"


def new_instance_id(tier: str) -> str:
    """A fresh id for a process of a tier ("decode-1a2b3c4d"): what logs, the registry and errors call it."""
    return f"{tier}-{uuid.uuid4().hex[:8]}"


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Counts the project's calls in flight (tandem.v1.*) and, once draining, refuses new calls whose method
    starts with one of admission_prefixes ("/tandem.v1.Decode/Generate") with UNAVAILABLE."""

    def __init__(self, tier: str, instance_id: str, admission_prefixes: tuple[str, ...]):
        self.tier, self.instance_id, self.admission_prefixes = tier, instance_id, admission_prefixes
        self.draining = False
        self.in_flight = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(TRACED_PREFIX):
            return handler
        refuse = self.draining and method.startswith(self.admission_prefixes)
        return rewrap_handler(handler, lambda fn: self._wrap_unary(fn, refuse),
                              lambda fn: self._wrap_stream(fn, refuse))

    async def _refuse(self, context) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.tier} {self.instance_id} is draining (shutting "
                            "down): it takes no new requests", trailing_metadata=((DRAINING_KEY, "1"),))  # fmt: skip

    def _wrap_unary(self, fn, refuse: bool):
        async def wrapper(request, context):
            if refuse:
                await self._refuse(context)
            self.in_flight += 1
            try:
                return await fn(request, context)
            finally:
                self.in_flight -= 1

        return wrapper

    def _wrap_stream(self, fn, refuse: bool):
        async def wrapper(request, context):
            if refuse:
                await self._refuse(context)
            self.in_flight += 1
            responses = fn(request, context)
            try:
                async for item in responses:
                    yield item
            finally:
                try:
                    await responses.aclose()  # (the handler's own cleanup runs now, before the count drops)
                finally:
                    self.in_flight -= 1

        return wrapper


class Server:
    """An asyncio gRPC server bound to host:port (0 picks a free port: see .port). admission_prefixes: the
    methods a drain refuses (see the module docstring). tls: serve TLS (mutual TLS when it requires client
    certificates; services/security.py), plaintext when None. auth: an interceptor that refuses unauthenticated
    calls (the gateway's API keys), before they count as in flight.

    OSError if the address cannot be bound; ValueError naming the setting of a TLS file that cannot be read.
    """

    def __init__(self, tier: str, instance_id: str, host: str, port: int,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, admission_prefixes: tuple[str, ...] = (),
                 tls: TLSConfig | None = None, auth: grpc.aio.ServerInterceptor | None = None):
        self.tier, self.instance_id, self.drain_timeout_s = tier, instance_id, drain_timeout_s
        self.drain = DrainInterceptor(tier, instance_id, admission_prefixes)
        interceptors = [RequestContextInterceptor(), *([auth] if auth else []), self.drain,
                        ErrorInterceptor(tier, instance_id)]  # outermost first
        options = [(key, PUBLIC_MAX_RECEIVE_BYTES if tier == "gateway" and key == "grpc.max_receive_message_length"
                    else value) for key, value in GRPC_OPTIONS]  # fmt: skip
        self.grpc = grpc.aio.server(interceptors=interceptors, options=options)
        address = f"{host}:{port}"
        self.port = self.grpc.add_secure_port(address, tls.server_credentials()) if tls else \
            self.grpc.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self._stop = asyncio.Event()  # (set by SIGTERM/SIGINT once start() took them over)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)

    async def start(self) -> None:
        """Take over SIGTERM/SIGINT (from here on they start the drain of serve_until_signal: the process may
        register itself anywhere after this, and a signal must not end it before it leaves), accept calls and
        report SERVING."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.grpc.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def serve_until_signal(self, on_drain: Callable[[], Awaitable[None]] | None = None,
                                 busy: Callable[[], bool] = lambda: False) -> None:
        """Serve until SIGTERM or SIGINT (since start()), then drain (module docstring): NOT_SERVING, refuse new
        requests, await on_drain(), wait until no call is in flight and not busy() (at most drain_timeout_s),
        stop."""
        loop = asyncio.get_running_loop()
        await self._stop.wait()
        log.info("draining: %d calls in flight, up to %.0f s to finish", self.drain.in_flight, self.drain_timeout_s)
        exit_by_s = self.drain_timeout_s + STOP_GRACE_S + EXIT_GRACE_S
        backstop = threading.Timer(exit_by_s, _exit_stuck, args=(exit_by_s, loop))
        backstop.daemon = True
        backstop.start()
        await self.health.enter_graceful_shutdown()
        self.drain.draining = True
        if on_drain is not None:
            await on_drain()
        deadline = loop.time() + self.drain_timeout_s
        while (self.drain.in_flight or busy()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.drain.in_flight or busy():
            log.warning("drain timeout (%.0f s): cancelling %d calls still in flight", self.drain_timeout_s,
                        self.drain.in_flight)  # fmt: skip
        else:
            log.info("drained: no call in flight")
        await self.grpc.stop(grace=STOP_GRACE_S)
