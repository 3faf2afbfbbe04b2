"""Gateway: the public gRPC API, a thin translator: GenerateRequest -> the request record (GatewayRequest) -> the
gateway's pipeline (services/gateway/pipeline.py) -> the GenerateResponse stream. Errors become status codes in
the server's error interceptor (services/grpc_errors.py)."""
from __future__ import annotations

import time
import uuid

from tandem.services.gateway.lora_adapters import adapter_named
from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.request import GatewayRequest, no_deadline
from tandem.services.grpc_errors import error_code
from tandem.shared.errors import InvalidRequestError
from tandem.v1 import gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The Gateway service over a GatewayPipeline; model_name: the base model's served name (--served-model-name),
    which GenerateRequest.lora_name may give for the base model, as the HTTP API's `model` may."""

    def __init__(self, pipeline: GatewayPipeline, model_name: str):
        self.pipeline, self.model_name = pipeline, model_name

    async def Generate(self, request, context):
        """The public gRPC API; a request that fails is counted by status code (tandem:request_errors_total;
        the HTTP API counts its own)."""
        arrival_time = time.perf_counter()
        try:
            prompt_ids = await self.pipeline.tokenize(request)
            params, parsers = self.pipeline.answer_format(request)
            gateway_request = GatewayRequest(
                request_id=request.request_id or uuid.uuid4().hex,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
                priority=request.priority,
                session_id=request.session_id if request.HasField("session_id") else None,
                lora_name=adapter_named(request.lora_name if request.HasField("lora_name") else None,
                                        self.model_name),
                time_remaining=deadline_clock(context.time_remaining,
                                              request.deadline_ms if request.HasField("deadline_ms") else None),
                arrival_time=arrival_time,
                **parsers,
            )  # fmt: skip
            async for msg in self.pipeline.generate(gateway_request):
                yield msg
        except BaseException as e:
            self.pipeline.metrics.observe_error(error_code(e).name)
            raise


def deadline_clock(time_remaining=no_deadline, deadline_ms: int | None = None):
    """time_remaining() -> seconds left (or None) folded with a request's own deadline_ms from now: a function
    giving the earlier of the two. InvalidRequestError for a deadline_ms that is not positive."""
    if deadline_ms is None:
        return time_remaining
    if deadline_ms <= 0:
        raise InvalidRequestError(f"deadline_ms must be > 0, got {deadline_ms}")
    deadline = time.monotonic() + deadline_ms / 1000

    def remaining() -> float:
        left, call_left = deadline - time.monotonic(), time_remaining()
        return left if call_left is None else min(left, call_left)

    return remaining
