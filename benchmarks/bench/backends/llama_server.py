"""llama-server: llama.cpp's HTTP server on the packaged Q4_1 GGUF, started here on a free loopback port.

    llama-server -m <GGUF> -t <threads> -np <slots> -c <slots * ctx_per_slot> --host 127.0.0.1 --port P

Each request is POST /completion with the workload's token ids as the prompt (so both servers see the same
tokens), greedy, ignore_eos, streamed as server-sent events ("data: {json}" lines) and read with http.client in
a worker thread (sse.py); a token is timed when its event is read. cache_prompt is off, so no request reuses
another's KV.
NOTE: a streamed event leaves out the ids of tokens whose text is an incomplete UTF-8 sequence (it sends them
with the token that completes the character, listing only that one), so the output length is the server's
tokens_predicted, and output_token_ids may miss some ids.
NOTE: its weights are the GGUF's Q4_1 ones, not fp32: compare it with `--engine-args "--quantization gguf"`.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.benchmarks.bench.backends.base import RequestResult
from tandem.benchmarks.bench.backends.server_process import ServerProcess
from tandem.benchmarks.bench.backends.sse import post_events
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
        self.server: ServerProcess | None = None
        self.port: int | None = None

    @property
    def argv(self) -> list[str]:
        return [self.binary, "-m", self.gguf, "-t", str(self.threads), "-np", str(self.slots),
                "-c", str(self.slots * self.ctx_per_slot), "--host", "127.0.0.1", "--port", str(self.port),
                "--no-webui"]  # fmt: skip

    async def start(self) -> None:
        from tandem.services.launcher import free_port

        self.port = free_port()
        self.server = ServerProcess("llama-server", self.argv, f"http://127.0.0.1:{self.port}/health",
                                    self.log_dir / "llama-server.log")  # fmt: skip
        await self.server.start(HEALTH_TIMEOUT_S)  # (GET /health answers 503 while the model loads)

    async def generate(self, request: BenchRequest) -> RequestResult:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._generate, request)

    def _generate(self, request: BenchRequest) -> RequestResult:
        body = {"prompt": list(request.prompt_token_ids), "n_predict": request.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "cache_prompt": False, "return_tokens": True}
        result = RequestResult(request.index, request.prompt_len, start_s=time.perf_counter())
        for event in post_events(f"http://127.0.0.1:{self.port}/completion", body, self.request_timeout_s):
            if event.get("tokens"):
                result.token_times_s.append(time.perf_counter())
                result.output_token_ids.extend(event["tokens"])
            result.reported_output_tokens = event.get("tokens_predicted", result.reported_output_tokens)
            if event.get("stop"):
                result.prompt_len = event.get("tokens_evaluated", result.prompt_len)
                break
        result.end_s = time.perf_counter()
        return result

    async def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        return {"argv": self.argv, "weights": "gguf-q4_1 (the packaged GGUF)", "log_dir": str(self.log_dir),
                "output_token_ids": "as streamed: ids of tokens ending in an incomplete UTF-8 character are missing"}
