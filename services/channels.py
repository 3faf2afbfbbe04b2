"""ChannelPool: one gRPC channel per peer address, opened on first use, with the raised message limits and, when
tracing is on, the interceptors that carry the trace context to the peer (services/grpc_tracing.py)."""
from __future__ import annotations

import grpc

from services.grpc_tracing import client_interceptors
from services.server import GRPC_OPTIONS


class ChannelPool:
    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS,
                                                                interceptors=client_interceptors())
        return self._channels[address]
