"""`tandem bench`'s openai and vllm backends without vLLM: the request and its streamed events read from a fake
OpenAI-compatible server (a vLLM-like stream with token ids, a text-only one like our gateway's, an error chunk),
vLLM's argv and environment, the flags' errors, and the started server's process group (a stand-in server);
llama-server's stream, read by the same SSE helper, from the fake server too."""
import argparse
import asyncio
import json
import os
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tandem.benchmarks.bench.backends.llama_server import LlamaServerBackend
from tandem.benchmarks.bench.backends.openai_compat import OpenAIBackend, api_base
from tandem.benchmarks.bench.backends.server_process import ServerProcess
from tandem.benchmarks.bench.backends.vllm import VLLMServer, find_vllm_python
from tandem.benchmarks.bench.cli import add_bench_args, check_args
from tandem.benchmarks.bench.workloads import BenchRequest

REQUEST = BenchRequest(index=3, prompt="ignored", prompt_token_ids=(11, 12, 13, 14, 15), output_len=4)
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}
# vLLM with return_token_ids: a chunk per token, an empty text while a character is incomplete, the finish on
# the last token, then the usage chunk
VLLM_STREAM = [
    {"choices": [{"index": 0, "text": "Hi", "token_ids": [7], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "", "token_ids": [8], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": " é", "token_ids": [9], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "!", "token_ids": [10], "finish_reason": "length"}]},
    {"choices": [], "usage": USAGE},
]
# text only, the finish in a chunk of its own, no cached-token details (our gateway's shape)
TEXT_STREAM = [
    {"choices": [{"index": 0, "text": "Hi", "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "text": "", "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "text": " é", "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "text": "!", "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "prompt_tokens_details": None}},
]


class FakeServer:
    """An OpenAI-compatible server on a free loopback port: GET /v1/models lists "fake"; POST /v1/completions
    records the body and streams `events` as server-sent events, then [DONE]."""

    def __init__(self, events: list[dict]):
        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._answer(200, json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode())

            def do_POST(self):
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self._answer(200, payload.encode(), "text/event-stream")

            def _answer(self, status, payload, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def run_one(events, model=None):
    """(the RequestResult of REQUEST against a FakeServer streaming events, the body the server got)."""
    server = FakeServer(events)
    backend = OpenAIBackend("openai", server.url, max_in_flight=1, request_timeout_s=10, model=model)

    async def session():
        await backend.start()
        try:
            return await backend.generate(REQUEST)
        finally:
            await backend.stop()

    try:
        return asyncio.run(session()), server.bodies[0]
    finally:
        server.close()


def test_a_request_is_greedy_ignore_eos_token_ids_streamed_with_usage():
    result, body = run_one(VLLM_STREAM)
    assert body == {"model": "fake", "prompt": [11, 12, 13, 14, 15], "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}  # fmt: skip
    assert result.ok and result.index == 3
    assert result.output_token_ids == [7, 8, 9, 10] and result.output_text == "Hi é!"
    assert len(result.token_times_s) == 4  # one per token event, the empty-text one included
    assert result.start_s < result.token_times_s[0] <= result.token_times_s[-1] <= result.end_s
    assert (result.prompt_len, result.num_output_tokens, result.cached_tokens) == (5, 4, 2)


def test_a_text_only_stream_counts_tokens_from_usage_and_times_no_bare_finish_event():
    result, body = run_one(TEXT_STREAM, model="chosen")
    assert body["model"] == "chosen"
    assert result.output_token_ids == [] and result.output_text == "Hi é!"
    assert len(result.token_times_s) == 4  # not the finish chunk
    assert (result.num_output_tokens, result.cached_tokens) == (4, None)


def test_an_error_chunk_or_a_stream_without_counts_fails_the_request():
    with pytest.raises(RuntimeError, match="error event: .*boom"):
        run_one([VLLM_STREAM[0], {"error": {"message": "boom", "type": "server_error"}}])
    with pytest.raises(RuntimeError, match="no usage block nor token ids"):
        run_one([TEXT_STREAM[0]])


def test_llama_server_events_are_read_until_stop():
    server = FakeServer([{"content": "Hi", "tokens": [7], "stop": False},
                         {"content": "", "tokens": [], "stop": False},  # (an id left out: incomplete UTF-8)
                         {"content": " é", "tokens": [9], "stop": False},
                         {"content": "", "tokens": [], "stop": True, "tokens_predicted": 3, "tokens_evaluated": 5},
                         {"content": "never read", "tokens": [99], "stop": False}])  # fmt: skip
    backend = LlamaServerBackend("llama-server", "model.gguf", threads=1, slots=1, ctx_per_slot=64, max_in_flight=1)
    backend.port = server.httpd.server_address[1]
    try:
        result = backend._generate(REQUEST)
    finally:
        server.close()
        backend.executor.shutdown()
    assert server.bodies[0]["prompt"] == [11, 12, 13, 14, 15] and server.bodies[0]["n_predict"] == 4
    assert result.output_token_ids == [7, 9] and len(result.token_times_s) == 2
    assert (result.prompt_len, result.num_output_tokens) == (5, 3)


def test_api_base():
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"


def fake_venv(tmp_path: Path, iomp: bool = True) -> str:
    """A venv-shaped folder: bin/python (an executable) and, with iomp, lib/libiomp5.so."""
    (tmp_path / "bin").mkdir(parents=True)
    (tmp_path / "lib").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    if iomp:
        (tmp_path / "lib" / "libiomp5.so").write_text("")
    return str(python)


def model_dir_with(tmp_path: Path, architectures) -> str:
    path = tmp_path / "model"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": architectures}))
    return str(path)


def test_vllm_argv_overrides_architectures_only_where_config_names_none(tmp_path):
    python = fake_venv(tmp_path / "venv")
    server = VLLMServer(python, model_dir_with(tmp_path, None), "bfloat16", threads=2, max_request_len=5000)
    argv = server.argv(8123)
    assert argv[:3] == [python, "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert value("--model") == str(tmp_path / "model") and value("--served-model-name") == "model"
    assert (value("--host"), value("--port"), value("--dtype")) == ("127.0.0.1", "8123", "bfloat16")
    assert value("--max-model-len") == "5000"  # the longest request, past the default 4096
    assert "--enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert json.loads(value("--hf-overrides")) == {"architectures": ["LlamaForCausalLM"]}
    named = VLLMServer(python, model_dir_with(tmp_path / "x", ["LlamaForCausalLM"]), "float32", threads=1)
    assert "--hf-overrides" not in named.argv(1) and named.max_model_len == 4096


def test_vllm_env_binds_threads_and_preloads_the_venvs_iomp(tmp_path):
    python = fake_venv(tmp_path / "venv")
    model = model_dir_with(tmp_path, None)
    env = VLLMServer(python, model, "bfloat16", threads=2).env({"LD_PRELOAD": "/mine.so", "VLLM_PYTHON": python,
                                                               "PATH": "/bin"})  # fmt: skip
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    preload = env["LD_PRELOAD"].split(":")
    assert preload[-2:] == [str(tmp_path / "venv" / "lib" / "libiomp5.so"), "/mine.so"]  # (tcmalloc first, if any)
    assert "VLLM_PYTHON" not in env and env["PATH"] == "/bin"
    one = VLLMServer(fake_venv(tmp_path / "bare", iomp=False), model, "bfloat16", threads=1).env({})
    assert one["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "libiomp5.so" not in one.get("LD_PRELOAD", "")


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(argv)


def test_a_missing_vllm_python_or_openai_url_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match=r"backend vllm: no vLLM python found; pass --vllm-python PATH or set "
                                         r"\$VLLM_PYTHON"):  # fmt: skip
        check_args(parse("--backend", "vllm,cluster"))
    monkeypatch.setenv("VLLM_PYTHON", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="is not an executable file"):
        find_vllm_python()
    python = fake_venv(tmp_path / "venv")
    args = parse("--backend", "vllm,cluster", "--vllm-python", python, "--baseline", "vllm")
    check_args(args)
    assert args.backend == ["vllm", "cluster"] and args.vllm_dtype == "bfloat16"
    with pytest.raises(ValueError, match="backend openai: pass --openai-url URL"):
        check_args(parse("--backend", "openai"))
    with pytest.raises(ValueError, match="--openai-url is where the openai backend sends"):
        check_args(parse("--backend", "cluster", "--openai-url", "http://127.0.0.1:1"))


def test_a_started_server_is_healthy_then_stopped_with_its_group(tmp_path):
    from tandem.services.launcher import free_port

    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    server = ServerProcess("stand-in", argv, f"http://127.0.0.1:{port}/", tmp_path / "logs" / "stand-in.log")
    asyncio.run(server.start(timeout_s=30))
    assert server.process.poll() is None and server.startup_s > 0
    assert os.getpgid(server.process.pid) == server.process.pid  # a group of its own
    server.stop()
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # nothing of the group is left


def test_a_server_that_exits_at_start_reports_its_last_log_line(tmp_path):
    server = ServerProcess("broken", [sys.executable, "-c", "raise SystemExit('no model here')"],
                           "http://127.0.0.1:1/health", tmp_path / "broken.log")  # fmt: skip
    with pytest.raises(RuntimeError, match="broken exited with code 1: no model here"):
        asyncio.run(server.start(timeout_s=30))
