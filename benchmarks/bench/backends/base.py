"""What every backend gives the runner: one RequestResult per request, timed at the client.

Two kinds of backend: a streaming one (cluster, colocated, llama-server, vllm, openai) serves requests one by one
as they arrive, `async generate(request)`, and any number may be in flight; a static-batching one (hf-static)
takes a whole batch at once, `async generate_batch(requests, start_times_s)`, and returns when all of it is done.
Both have `async start()` (launch processes, load weights) and `async stop()`, and `describe()` for the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.benchmarks.bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are time.perf_counter() seconds.

    start_s: when it was sent (for a static batch: when it arrived, or when its batch started in a closed loop);
    token_times_s: when each message carrying output tokens arrived (a message may carry several tokens);
    end_s: when the response was complete; prompt_len: prompt tokens (the server's own count where it reports
    one); output_token_ids: the tokens generated, as streamed; reported_output_tokens: the server's count of
    them, where its stream leaves some ids out (None: every one is in output_token_ids); cached_tokens: prompt
    tokens the server served from a prefix cache, where it reports them; output_text: the text generated, from a
    backend whose stream may carry only text (openai). error: the first line of what went wrong; a failed
    request counts in `failed` and in no other metric.
    """

    index: int
    prompt_len: int
    start_s: float
    token_times_s: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None
    reported_output_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None  # of cached_tokens, those from each KV tier (cluster only)
    output_text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and bool(self.token_times_s)

    @property
    def num_output_tokens(self) -> int:
        if self.reported_output_tokens is not None:
            return self.reported_output_tokens
        return len(self.output_token_ids)

    @property
    def ttft_s(self) -> float:
        """Time to first token: from sending to the first message with a token."""
        return self.token_times_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency: from sending to the complete response."""
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1); None with one token."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive token messages."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]


class StreamingBackend(Protocol):
    name: str
    static_batching: bool  # False

    async def start(self) -> None: ...

    async def generate(self, request: BenchRequest) -> RequestResult:
        """Send one request now and time its tokens. Raises on failure (the runner records the error)."""
        ...

    async def stop(self) -> None: ...

    def describe(self) -> dict: ...


class StaticBatchBackend(Protocol):
    name: str
    static_batching: bool  # True

    async def start(self) -> None: ...

    async def generate_batch(self, requests: list[BenchRequest], start_times_s: list[float]) -> list[RequestResult]:
        """Run the requests as one batch now; each result's times count from its start_times_s entry."""
        ...

    async def stop(self) -> None: ...

    def describe(self) -> dict: ...


Backend = StreamingBackend | StaticBatchBackend


def first_line(error: BaseException) -> str:
    """'TypeName: first line of the message', for the report."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def weights_description(model_config) -> str:
    """What an engine of ours runs, for the report's weights line: 'gguf-q4_1 (float32 activations)'."""
    return f"{model_config.weight_format} ({model_config.dtype} activations)"
