"""openai and vllm: an OpenAI-compatible server over POST /v1/completions: a running one (`--openai-url`: vLLM,
SGLang, TGI, our gateway's HTTP API) or vLLM's CPU build started here (vllm.py).

Each request sends the workload's token ids as the prompt (a list of ints, so every server sees the same
tokens), greedy (temperature 0), ignore_eos, max_tokens, streamed with stream_options.include_usage and vLLM's
return_token_ids (other servers ignore it), read with http.client in a worker thread (sse.py). A token is timed
when its event is read: an event whose choice carries text or token ids, or an unfinished one with neither (a
token whose text is an incomplete UTF-8 character, held back); the finish event of a server that sends it apart
carries none. The output length is the usage block's completion_tokens, the prompt length its prompt_tokens,
cached tokens its prompt_tokens_details.cached_tokens where the server reports them.
NOTE: output_token_ids are the streamed token_ids (vLLM's return_token_ids); a server that streams only text
(our gateway, most others) leaves them empty, and output_text holds the text.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

from tandem.benchmarks.bench.backends.base import RequestResult
from tandem.benchmarks.bench.backends.sse import get, post_events
from tandem.benchmarks.bench.workloads import BenchRequest


def api_base(url: str) -> str:
    """'http://host:8000' or 'http://host:8000/v1/' -> 'http://host:8000/v1'."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class OpenAIBackend:
    static_batching = False

    def __init__(self, name: str, url: str | None, max_in_flight: int, request_timeout_s: float = 600,
                 model: str | None = None, server=None):
        """url: the server's address ('http://host:port', /v1 optional); model: the request's model (None: the
        first of GET /v1/models); server: one to start first and stop last (vllm.VLLMServer: start() returns
        its URL), or None for a running one."""
        self.name, self.url, self.model, self.server = name, url and api_base(url), model, server
        self.request_timeout_s = request_timeout_s
        self.executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix=f"{name}-client")

    async def start(self) -> None:
        if self.server is not None:
            self.url = api_base(await self.server.start())
            self.model = self.model or self.server.served_model_name
        if self.model is None:
            self.model = await asyncio.get_running_loop().run_in_executor(self.executor, self._first_model)

    def _first_model(self) -> str:
        body = get(f"{self.url}/models", timeout_s=10)
        models = json.loads(body).get("data") if body else None
        if not models:
            raise RuntimeError(f"{self.url}/models lists no model (is the server up?): pass --openai-model NAME")
        return models[0]["id"]

    async def generate(self, request: BenchRequest) -> RequestResult:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._generate, request)

    def _generate(self, request: BenchRequest) -> RequestResult:
        body = {"model": self.model, "prompt": list(request.prompt_token_ids), "max_tokens": request.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}  # fmt: skip
        result = RequestResult(request.index, request.prompt_len, start_s=time.perf_counter())
        text = []
        for event in post_events(f"{self.url}/completions", body, self.request_timeout_s):
            if "error" in event:  # an error chunk: a failure after the stream began
                raise RuntimeError(f"error event: {json.dumps(event['error'])[:300]}")
            for choice in event.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids or choice.get("text") or choice.get("finish_reason") is None:
                    result.token_times_s.append(time.perf_counter())
                result.output_token_ids.extend(ids)
                text.append(choice.get("text") or "")
            if usage := event.get("usage"):
                result.prompt_len = usage["prompt_tokens"]
                result.reported_output_tokens = usage["completion_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.end_s = time.perf_counter()
        result.output_text = "".join(text)
        if result.reported_output_tokens is None and not result.output_token_ids:
            raise RuntimeError("the stream had no usage block nor token ids: its output tokens cannot be counted")
        return result

    async def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        info = {"url": self.url, "model": self.model,
                "output_token_ids": "the streamed token_ids (vLLM's return_token_ids); none from a server that "
                                    "streams only text"}  # fmt: skip
        if self.server is not None:
            return info | self.server.describe()
        return info | {"weights": f"of the running server ({self.model})"}
