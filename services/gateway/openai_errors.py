"""Errors of the OpenAI-compatible HTTP API: a project error (services/grpc_errors.py's status) as OpenAI's error
body with its HTTP status (the one table, HTTP_STATUS), the field it names in the HTTP API's spelling, and the
count of failed requests (tandem:request_errors_total) by gRPC status name."""
from __future__ import annotations

import logging

import grpc

from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.openai_protocol import APIError, http_param, param_named
from tandem.services.grpc_errors import status_for
from tandem.shared.errors import TandemError

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
GRPC_CODE_NAME = {status: code.name for code, status in HTTP_STATUS.items()} | {499: "CANCELLED"}


def api_error(error: Exception, instance_id: str) -> APIError:
    """A project error (or any other exception: a bug, logged) as an APIError with its HTTP status; a 400 names
    the field its message names (after a "decode ID: " prefix of an error from a tier)."""
    if isinstance(error, APIError):
        return error
    code, message = status_for(error, "gateway", instance_id)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, TandemError):
        log.error("unhandled error", exc_info=error)
    status = HTTP_STATUS.get(code, 500)
    param = param_named(message.split(": ", 1)[-1]) if status == 400 else None
    retry_after_s = getattr(error, "retry_after_s", None)  # (an OverloadedError)
    headers = {"Retry-After": str(int(retry_after_s))} if retry_after_s is not None else None
    return APIError(status, message, http_param(param, None, False), code=code.name.lower(), headers=headers)


def counted(metrics: GatewayMetrics, e: APIError) -> APIError:
    """e, counted in tandem:request_errors_total (by its gRPC status name)."""
    metrics.observe_error(GRPC_CODE_NAME.get(e.status, "INTERNAL"))
    return e
