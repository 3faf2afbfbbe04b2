"""llama-server: llama.cpp's HTTP server on the packaged Q4_1 GGUF, started here on a free loopback port.

    llama-server -m <GGUF> -t <threads> -np <slots> -c <slots * ctx_per_slot> --host 127.0.0.1 --port P

Each request is POST /completion with the workload's token ids as the prompt (so both servers see the same
tokens), greedy, ignore_eos, streamed as server-sent events ("data: {json}" lines) and read with http.client in
a worker thread; a token is timed when its event is read. cache_prompt is off, so no request reuses another's KV.
NOTE: a streamed event leaves out the ids of tokens whose text is an incomplete UTF-8 sequence (it sends them
with the token that completes the character, listing only that one), so the output length is the server's
tokens_predicted, and output_token_ids may miss some ids.
NOTE: its weights are the GGUF's Q4_1 ones, not fp32: compare it with `--engine-args "--quantization gguf"`.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.benchmarks.bench.backends.base import RequestResult
from tandem.benchmarks.bench.workloads import BenchRequest

HEALTH_TIMEOUT_S = 180


def find_llama_server(path: str | None = None) -> str | None:
    """The llama-server binary: path if given, else $LLAMA_SERVER, else llama-server on PATH; None if none is
    found. FileNotFoundError when a given path is not an executable."""
    # NOTE: LLAMA_SERVER is read here, not in shared/envs.py (which lists the services' variables): only this
    # benchmark uses it.
    candidate = path or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if candidate and not os.access(candidate, os.X_OK):
        raise FileNotFoundError(f"llama-server binary {candidate!r} is not an executable file")
    return candidate


class LlamaServerBackend:
    name = "llama-server"
    static_batching = False

    def __init__(self, binary: str, gguf: str, threads: int, slots: int, ctx_per_slot: int, max_in_flight: int,
                 log_dir: str | None = None, request_timeout_s: float = 600):
        """slots: parallel sequences (-np); ctx_per_slot: context tokens of each; max_in_flight: worker threads."""
        self.binary, self.gguf = binary, gguf
        self.threads, self.slots, self.ctx_per_slot = threads, slots, ctx_per_slot
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tandem-bench-"))
        self.request_timeout_s = request_timeout_s
        self.executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix="llama-client")
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def argv(self) -> list[str]:
        return [self.binary, "-m", self.gguf, "-t", str(self.threads), "-np", str(self.slots),
                "-c", str(self.slots * self.ctx_per_slot), "--host", "127.0.0.1", "--port", str(self.port),
                "--no-webui"]  # fmt: skip

    async def start(self) -> None:
        from tandem.services.launcher import free_port

        self.port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / "llama-server.log"
        print(f"llama-server: starting {' '.join(self.argv)} (log: {log_path})", file=sys.stderr)
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.process.returncode} (log: {log_path})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {HEALTH_TIMEOUT_S}s (log: {log_path})")
            await asyncio.sleep(0.3)

    def _healthy(self) -> bool:
        """GET /health answers 200 (503 while the model loads)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    async def generate(self, request: BenchRequest) -> RequestResult:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._generate, request)

    def _generate(self, request: BenchRequest) -> RequestResult:
        body = json.dumps({"prompt": list(request.prompt_token_ids), "n_predict": request.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True, "cache_prompt": False,
                           "return_tokens": True})  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.request_timeout_s)
        result = RequestResult(request.index, request.prompt_len, start_s=time.perf_counter())
        try:
            connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read(500).decode(errors='replace')}")
            for line in response:  # http.client undoes the chunked transfer encoding
                if line.startswith(b"error: "):  # a failure after the stream began
                    raise RuntimeError(f"llama-server: {line[len(b'error: '):].decode(errors='replace').strip()}")
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                if event.get("tokens"):
                    result.token_times_s.append(time.perf_counter())
                    result.output_token_ids.extend(event["tokens"])
                result.reported_output_tokens = event.get("tokens_predicted", result.reported_output_tokens)
                if event.get("stop"):
                    result.prompt_len = event.get("tokens_evaluated", result.prompt_len)
                    break
        finally:
            connection.close()
        result.end_s = time.perf_counter()
        return result

    async def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        return {"argv": self.argv, "weights": "gguf-q4_1 (the packaged GGUF)", "log_dir": str(self.log_dir),
                "output_token_ids": "as streamed: ids of tokens ending in an incomplete UTF-8 character are missing"}
