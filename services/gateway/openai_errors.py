"""Errors of the OpenAI-compatible HTTP API: APIError (an HTTP error answer in OpenAI's error body), the field a
refusal names in the HTTP API's spelling (param_named, http_param), a project error (services/grpc_errors.py's
status) as an APIError with its HTTP status (the one table, HTTP_STATUS), and the count of failed requests
(tandem:request_errors_total) by gRPC status name."""
from __future__ import annotations

import logging

import grpc

from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.grpc_errors import status_for
from tandem.shared.errors import TandemError

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
GRPC_CODE_NAME = {status: code.name for code, status in HTTP_STATUS.items()} | {499: "CANCELLED"}


class APIError(Exception):
    """An HTTP error answer: status, OpenAI's error body, and headers (a 429's Retry-After, in seconds)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def param_named(message: str) -> str | None:
    """The field an InvalidRequestError's message starts with or names ("min_p must be ...",
    "structured_output.json is not ...")."""
    word = message.split(" ", 1)[0].strip("(),:").split(".")[0].split("[")[0]
    return word if word.replace("_", "").isalpha() and word.islower() else None


def http_param(param: str | None, body, chat: bool) -> str | None:
    """The HTTP API's name of a gRPC field an error names (body: the request's SamplingFields or None; it says which
    spelling the request used)."""
    if param == "structured_output":
        if getattr(body, "tool_choice", None) not in (None, "auto", "none"):  # (the constraint is the tools')
            return "tools"
        return "structured_outputs" if body is not None and body.structured_outputs else "response_format"
    if param == "beam_width":  # (use_beam_search's beams are n)
        return "n"
    if param == "prompt" and chat:
        return "messages"
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if param == "logprobs" and chat and getattr(body, "top_logprobs", None) is not None:
        return "top_logprobs"
    return param


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
