"""JSON logs (services/logs.py): one object per line with tier, instance id, the request id of the context a
line is logged in, and the trace context when a span is current; the text format stays as it was."""
import argparse
import asyncio
import io
import json
import logging
from datetime import datetime

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from tandem.services.flags import add_engine_service_args, add_gateway_args, apply_env
from tandem.services.logs import request_id_var, set_request_id, setup_logging

log = logging.getLogger("tandem.test")


@pytest.fixture
def log_stream():
    """setup_logging's target; the root logger's handlers are put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_json_line_carries_tier_instance_and_the_request_id_of_its_context(log_stream):
    setup_logging("decode", "decode-1a2b3c4d", "json", stream=log_stream)

    async def serve(request_id: str) -> None:  # (each gRPC call runs in its own task, as here)
        set_request_id(request_id)
        await asyncio.sleep(0)
        log.info("request %s aborted: the gateway closed the stream", request_id)

    async def main() -> None:
        await asyncio.gather(serve("req-1"), serve("req-2"))
        log.warning("no request here")

    asyncio.run(main())
    first, second, outside = lines(log_stream)
    assert first["request_id"] == "req-1" and second["request_id"] == "req-2"
    assert first["message"] == "request req-1 aborted: the gateway closed the stream"
    assert {k: first[k] for k in ("level", "logger", "tier", "instance_id")} == {
        "level": "INFO", "logger": "tandem.test", "tier": "decode", "instance_id": "decode-1a2b3c4d"}
    assert datetime.fromisoformat(first["timestamp"]).utcoffset().total_seconds() == 0
    assert outside["level"] == "WARNING" and "request_id" not in outside and "trace_id" not in outside
    assert request_id_var.get() is None  # (the tasks' contexts were their own)


def test_a_json_line_carries_the_current_span_and_the_traceback(log_stream):
    setup_logging("prefill", "prefill-00000001", "json", stream=log_stream)
    span = NonRecordingSpan(SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))  # fmt: skip
    with trace.use_span(span):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("unhandled error")
    (line,) = lines(log_stream)
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and line["span_id"] == "00f067aa0ba902b7"
    assert line["level"] == "ERROR" and "RuntimeError: boom" in line["exception"]


def test_the_text_format_is_unchanged_and_an_unknown_format_is_refused(log_stream):
    setup_logging("gateway", "gateway-1", "text", stream=log_stream)
    log.info("hello %s", "world")
    assert log_stream.getvalue().rstrip().endswith(" gateway INFO hello world")
    with pytest.raises(ValueError, match="log format"):
        setup_logging("gateway", "gateway-1", "xml")


@pytest.mark.parametrize("add_args", [lambda p: add_engine_service_args(p, "decode"), add_gateway_args])
def test_every_service_takes_the_log_format_flag_and_its_variable(add_args, monkeypatch):
    monkeypatch.delenv("TANDEM_LOG_FORMAT", raising=False)
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert parser.parse_args([]).log_format == "text"
    assert parser.parse_args(["--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("TANDEM_LOG_FORMAT", "json")
    parser = argparse.ArgumentParser()
    add_args(parser)
    apply_env(parser, [])
    assert parser.parse_args([]).log_format == "json"
