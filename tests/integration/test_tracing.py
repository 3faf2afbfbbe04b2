"""Traces and JSON logs of a real cluster: every process exports its spans over OTLP/gRPC to a small collector
this test runs (opentelemetry-proto's TraceService), and logs JSON lines into its log file.

One request's trace must hold the gateway's, the prefill's and the decode's spans, linked parent to child through
the W3C trace context each call carries; a failing call marks its spans ERROR with the gRPC code."""
import json
import os
import re
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tandem.services.launcher import LocalCluster, free_port
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.prompts import LONG_TEXT

TEXT_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \w+ (INFO|WARNING|ERROR|CRITICAL) ")


def value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it: {name, trace_id, span_id, parent, kind, status, attributes, events,
    service} (ids in hex)."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = {a.key: value(a.value) for a in resource_spans.resource.attributes}["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        self.spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                           "parent": s.parent_span_id.hex(), "kind": s.kind, "status": s.status.code,
                                           "attributes": {a.key: value(a.value) for a in s.attributes},
                                           "events": [e.name for e in s.events], "service": service})  # fmt: skip
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 60) -> dict[str, dict]:
        """{span name: span} of the trace once it holds every name (one span each)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            by_name = {s["name"]: s for s in spans}
            if names <= by_name.keys():
                assert len(by_name) == len(spans), f"a span name repeats: {sorted(s['name'] for s in spans)}"
                return by_name
            assert time.monotonic() < deadline, f"missing spans {names - by_name.keys()}; got {sorted(by_name)}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def traced_cluster(model_dir):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    flags = ["--otlp-traces-endpoint", f"http://127.0.0.1:{port}", "--log-format", "json"]
    engine = ["--block-size", "16", "--num-blocks", "128", "--threads", "1"] + flags
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # (ms; the SDK's default batches for 5 s)
        cluster = LocalCluster(str(model_dir), prefill_args=engine, decode_args=engine, gateway_args=flags).start()
    yield cluster, collector
    cluster.stop()
    server.stop(0)


def traceparent() -> tuple[str, str, tuple]:
    """A caller's trace: (trace id, span id, the metadata carrying them)."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, span_id, (("traceparent", f"00-{trace_id}-{span_id}-01"),)


GATEWAY = {"tandem.v1.Gateway/Generate", "generate", "place", "route", "reserve", "decoding"}
PREFILL = {"tandem.v1.Prefill/Prefill", "prefill", "kv_transfer"}
DECODE = {"tandem.v1.Decode/Generate", "tandem.v1.Decode/TransferKV"}
SERVER, ERROR = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Status.STATUS_CODE_ERROR


def test_one_request_is_one_trace_across_the_three_tiers(traced_cluster):
    cluster, collector = traced_cluster
    trace_id, caller, metadata = traceparent()
    request = gateway_pb2.GenerateRequest(request_id="traced-1", prompt="Summarize: " + LONG_TEXT,
                                          sampling_params=common_pb2.SamplingParams(max_tokens=4, temperature=0))
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=metadata, timeout=300))
    assert replies[-1].usage.completion_tokens == 4
    spans = collector.wait_for(trace_id, GATEWAY | PREFILL | DECODE)
    for names, tier in ((GATEWAY, "gateway"), (PREFILL, "prefill"), (DECODE, "decode")):
        assert {spans[n]["service"] for n in names} == {f"tandem-{tier}"}
    parent = {name: spans[name]["parent"] for name in spans}
    span_id = {name: spans[name]["span_id"] for name in spans}
    assert parent["tandem.v1.Gateway/Generate"] == caller  # (the client's own trace context)
    assert parent["generate"] == span_id["tandem.v1.Gateway/Generate"]
    assert parent["place"] == parent["decoding"] == span_id["generate"]
    assert parent["route"] == parent["reserve"] == span_id["place"]
    assert parent["tandem.v1.Prefill/Prefill"] == parent["tandem.v1.Decode/Generate"] == span_id["place"]
    assert parent["prefill"] == span_id["tandem.v1.Prefill/Prefill"]
    assert parent["kv_transfer"] == span_id["prefill"]
    assert parent["tandem.v1.Decode/TransferKV"] == span_id["kv_transfer"]
    for name in spans:
        assert spans[name]["status"] != ERROR, name
        if name.startswith("tandem.v1."):
            assert spans[name]["kind"] == SERVER and spans[name]["attributes"]["rpc.grpc.status_code"] == 0
            assert spans[name]["attributes"]["tandem.request_id"] == "traced-1"
    generate = spans["generate"]["attributes"]
    assert generate["tandem.request_id"] == "traced-1" and generate["gen_ai.request.max_tokens"] == 4
    assert generate["gen_ai.usage.output_tokens"] == 4 and generate["gen_ai.response.finish_reasons"] == ["length"]
    assert generate["gen_ai.usage.input_tokens"] == replies[-1].usage.prompt_tokens > 64  # (so it took a prefill)
    assert generate["tandem.ttft_ms"] > 0 and spans["generate"]["events"] == ["first_token"]
    blocks = spans["kv_transfer"]["attributes"]["tandem.blocks_sent"]
    assert blocks >= replies[-1].usage.prompt_tokens // 16  # (its full blocks at least: nothing was cached)
    assert spans["kv_transfer"]["attributes"]["tandem.bytes_sent"] > 0
    assert spans["tandem.v1.Decode/TransferKV"]["attributes"]["tandem.blocks_received"] == blocks
    assert spans["route"]["attributes"]["tandem.prefill_instance_id"].startswith("prefill-")


def test_failed_calls_mark_their_spans_error_with_the_grpc_code(traced_cluster):
    cluster, collector = traced_cluster
    trace_id, _, metadata = traceparent()
    with grpc.insecure_channel(cluster.gateway_address) as channel, pytest.raises(grpc.RpcError) as error:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(prompt=""),
                                                            metadata=metadata, timeout=60))  # fmt: skip
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server = collector.wait_for(trace_id, {"tandem.v1.Gateway/Generate"})["tandem.v1.Gateway/Generate"]
    assert server["status"] == ERROR and server["attributes"]["rpc.grpc.status_code"] == 3

    trace_id, _, metadata = traceparent()  # an error inside a servicer's own span: the prefill's
    bad = prefill_pb2.PrefillRequest(request_id="traced-bad", prompt_token_ids=[1, 2, 3], num_skip_blocks=5,
                                     decode_address="127.0.0.1:1")  # fmt: skip
    with grpc.insecure_channel(cluster.addresses["prefill0"]) as channel, pytest.raises(grpc.RpcError):
        prefill_pb2_grpc.PrefillStub(channel).Prefill(bad, metadata=metadata, timeout=60)
    spans = collector.wait_for(trace_id, {"tandem.v1.Prefill/Prefill", "prefill"})
    for span in spans.values():
        assert span["status"] == ERROR and span["attributes"]["rpc.grpc.status_code"] == 3
    assert spans["tandem.v1.Prefill/Prefill"]["attributes"]["tandem.request_id"] == "traced-bad"


def json_lines(cluster, name: str) -> list[dict]:
    """The log records of one process: every one a JSON object (a line of the text format fails the test;
    the startup banners, printed, are not log records)."""
    records = []
    for line in (cluster.log_dir / f"{name}.log").read_text().splitlines():
        assert not TEXT_LOG_LINE.match(line) and not line.startswith("Traceback"), line
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


def test_json_logs_carry_the_request_id_and_trace_id(traced_cluster):
    cluster, _ = traced_cluster
    trace_id, _, metadata = traceparent()
    request = gateway_pb2.GenerateRequest(request_id="logged-1", prompt="Summarize: " + LONG_TEXT,
                                          sampling_params=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True))
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=metadata, timeout=300)
        next(call)
        call.cancel()  # (the decode then logs the abort, in the request's context)
    deadline = time.monotonic() + 30
    while not any(r.get("request_id") == "logged-1" for r in json_lines(cluster, "decode0")):
        assert time.monotonic() < deadline, "the decode logged no line for the request"
        time.sleep(0.2)
    for name, tier in (("gateway", "gateway"), ("prefill0", "prefill"), ("decode0", "decode")):
        for record in json_lines(cluster, name):
            assert record["tier"] == tier and record["instance_id"].startswith(f"{tier}-")
            assert {"timestamp", "level", "logger", "message"} <= record.keys()
    gateway = [r for r in json_lines(cluster, "gateway") if r.get("request_id") == "logged-1"]
    assert any("routed" in r["message"] for r in gateway)
    assert all(r["trace_id"] == trace_id for r in gateway)
    decode = [r for r in json_lines(cluster, "decode0") if r.get("request_id") == "logged-1"]
    assert any("aborted" in r["message"] for r in decode) and all(r["trace_id"] == trace_id for r in decode)
