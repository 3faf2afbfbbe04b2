"""ChannelPool: one gRPC channel per peer address, opened on first use, with the raised message limits and, when
tracing is on, the interceptors that carry the trace context to the peer (services/grpc_tracing.py).

A channel to an address where another instance now serves (a restart on the same port) is replaced: the old
one may still be backing off from reconnect failures to the dead process, and would refuse calls for seconds.
Reconnect backoff is capped at RECONNECT_BACKOFF_MAX_MS for the same reason.

With a TLSConfig every channel is TLS, presenting this process's certificate (mutual TLS: services/security.py).
"""
from __future__ import annotations

import asyncio

import grpc

from tandem.services.grpc_tracing import client_interceptors
from tandem.services.security import TLSConfig, open_channel
from tandem.services.server import GRPC_OPTIONS


RECONNECT_BACKOFF_MAX_MS = 1000
# A peer that stops answering HTTP/2 pings (a frozen process: the kernel still holds its connections open) fails
# the calls to it, UNAVAILABLE, KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS after it froze (only while calls are open).
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000
# (a local subchannel pool: with gRPC's global one, a new channel would share the old one's connection state)
CHANNEL_OPTIONS = GRPC_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 100),
                                  ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
                                  ("grpc.use_local_subchannel_pool", 1),
                                  ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                                  ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                                  # (gRPC's own ping timeout is what ends the call: 60 s unless set)
                                  ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                                  # (else 2 pings, then none while the caller sends no data: a long stream's)
                                  ("grpc.http2.max_pings_without_data", 0)]


class ChannelPool:
    def __init__(self, tls: TLSConfig | None = None):
        self.tls = tls  # None: plaintext
        self._channels: dict[str, tuple[str | None, grpc.aio.Channel]] = {}  # address -> (instance id, channel)

    def get(self, address: str, instance_id: str | None = None) -> grpc.aio.Channel:
        """The channel to address; instance_id: who serves there now (None: whoever), a new one gets a new
        channel."""
        known = self._channels.get(address)
        if known is None or (instance_id is not None and known[0] not in (None, instance_id)):
            if known is not None:
                asyncio.ensure_future(known[1].close(grace=None))  # (its calls have failed already)
            channel = open_channel(address, self.tls, CHANNEL_OPTIONS, client_interceptors())
            self._channels[address] = (instance_id, channel)
        elif known[0] is None and instance_id is not None:
            self._channels[address] = (instance_id, known[1])
        return self._channels[address][1]
