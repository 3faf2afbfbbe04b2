"""Embeddings on the cluster: prefill-only work. The router picks a prefill for the inputs (Router.route_prefill:
the least tokens to compute there, cache-aware) and no decode; the prefill computes each input as a pooling
request (Prefill.Embed) and answers with one embedding per input. A prefill that is unreachable, draining or
full is routed around and the call is made again on another, up to placement.MAX_ATTEMPTS failures, as
placements are (services/gateway/placement.py)."""
from __future__ import annotations

import logging

import grpc

from tandem.services.channels import ChannelPool
from tandem.services.gateway.placement import MAX_ATTEMPTS, RETRY_CODES
from tandem.services.gateway.router import Router
from tandem.services.grpc_errors import peer_is_down, upstream_error
from tandem.shared.errors import NoInstanceError, UpstreamError
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class Embedder:
    """Runs embedding requests on the prefill tier through the gateway's router and channels."""

    def __init__(self, router: Router, channels: ChannelPool):
        self.router, self.channels = router, channels

    async def embed(self, request_id: str, inputs: list[list[int]], priority: int = 0,
                    timeout: float | None = None) -> prefill_pb2.EmbedResponse:
        """One embedding per input (token ids, each within the model's context), in order, all from one prefill
        routed by the first input. Raises UpstreamError when prefills fail for good (an INVALID_ARGUMENT one at
        once), NoInstanceError when none is registered."""
        skipped: set[str] = set()
        last_error: UpstreamError | None = None
        message = prefill_pb2.EmbedRequest(inputs=[prefill_pb2.EmbedInput(token_ids=ids) for ids in inputs],
                                           priority=priority)  # fmt: skip
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                prefill = await self.router.route_prefill(inputs[0], skipped)
            except NoInstanceError:
                if last_error is None:
                    raise
                raise last_error from None  # (every prefill left was tried)
            # (each attempt its own id on the engines, as placements: a failed one's aborts touch nothing of the next)
            message.request_id = request_id if attempt == 1 else f"{request_id}.{attempt}"
            stub = prefill_pb2_grpc.PrefillStub(self.channels.get(prefill.address, prefill.instance_id))
            try:
                return await stub.Embed(message, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                last_error = upstream_error(e, "prefill", prefill.instance_id, "embedding")
                if e.code() not in RETRY_CODES:
                    raise last_error from None
                log.warning("embedding %s: prefill %s failed (%s); trying another", request_id, prefill.instance_id,
                            e.code().name)  # fmt: skip
                skipped.add(prefill.instance_id)
                if peer_is_down(e):
                    self.router.mark_down(prefill)
        raise last_error
