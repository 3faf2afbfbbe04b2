"""Logging of every service process: one line per record, as text (the default) or as one JSON object per line
(`--log-format json`, or TANDEM_LOG_FORMAT=json), for log shippers.

A JSON line carries:
    timestamp    RFC 3339, UTC, milliseconds ("2026-01-31T12:00:00.123+00:00")
    level        INFO, WARNING, ...
    logger       the logger's name ("tandem.services.gateway.server")
    message      the formatted message
    tier         gateway, prefill or decode
    instance_id  this process's instance id ("decode-1a2b3c4d")
    request_id   when the line concerns a request: the request being served in this context (see below)
    trace_id, span_id   when tracing is on and a span is current: W3C Trace Context ids, in lowercase hex
    exception    the traceback, when the record has one

The request id lives in a ContextVar (request_id_var): each gRPC call runs in its own asyncio task, and the
server interceptor (services/grpc_tracing.py) sets it from the call's request message, so every line logged
while serving the call gets the field without each `log.info("request %s ...")` passing it. The gateway sets
it again where it assigns a request id itself (set_request_id). The engine thread runs outside any request
context: its lines have no request_id.
"""
from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import TextIO

LOG_FORMATS = ("text", "json")

# The request the current asyncio task (or thread) serves; None outside any request.
request_id_var: ContextVar[str | None] = ContextVar("tandem_request_id", default=None)


def set_request_id(request_id: str | None) -> None:
    """Mark the current context (the calling asyncio task, from here on) as serving request_id."""
    if request_id:
        request_id_var.set(request_id)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (the fields in this module's docstring)."""

    def __init__(self, tier: str, instance_id: str):
        from opentelemetry import trace  # (here: `tandem` CLI imports this module's LOG_FORMATS, and stays quick)

        super().__init__()
        self.tier, self.instance_id = tier, instance_id
        self._trace = trace

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "tier": self.tier,
            "instance_id": self.instance_id,
        }
        if (request_id := request_id_var.get()) is not None:
            line["request_id"] = request_id
        span_context = self._trace.get_current_span().get_span_context()
        if span_context.is_valid:
            line["trace_id"] = self._trace.format_trace_id(span_context.trace_id)
            line["span_id"] = self._trace.format_span_id(span_context.span_id)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup_logging(tier: str, instance_id: str, log_format: str = "text", stream: TextIO | None = None) -> None:
    """Send the root logger's INFO and above to stream (default stderr), replacing any handler it had, in
    log_format: "text" ("<time> <tier> <LEVEL> <message>", as before) or "json" (JsonFormatter). In JSON,
    Python warnings go through logging too, so every line the process logs is one object. ValueError for an
    unknown format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(tier, instance_id))
        logging.captureWarnings(True)
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {tier} %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
