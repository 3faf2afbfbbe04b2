"""Locust load test of a tandem gateway: GrpcUser streams Gateway.Generate (tandem.services.client.Client), OpenAIUser
streams POST /v1/completions (OpenAI's API, server-sent events). Against `make serve`:

    .venv/bin/locust -f benchmarks/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000 \\
        --grpc-target 127.0.0.1:50051 --max-tokens 64 --csv locust      # [GrpcUser | OpenAIUser]: one class only

Raw prompts are short (20-60 tokens) or, for --long-share (0.2) of them, --long-prompt-tokens (1000) long, cut as
`tandem bench` cuts its prompts (benchmarks/bench/workloads.py) in one seeded sequence; requests are greedy with
ignore_eos, so each generates --max-tokens tokens. Reported: "grpc Generate" and "POST /v1/completions" (response
time: E2E latency in ms; size: tokens generated) and a "ttft" entry of each (time to first token in ms); a gRPC
status, HTTP error or SSE error chunk is a failure with its message. Options are also read from LOCUST_<NAME>.
"""
from __future__ import annotations

import functools
import json
import logging
import random
import sys
import time
from pathlib import Path

# locust puts its working directory first on sys.path: run from the checkout as above, the checkout's folders
# (kernels/, tools/, ...) would shadow installed packages of those names (Hugging Face's `kernels`, which
# transformers imports). Take the checkout root off before anything imports them.
_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT]

import gevent  # noqa: E402
import grpc  # noqa: E402
import grpc.experimental.gevent  # noqa: E402
import requests  # noqa: E402
from locust import HttpUser, User, events, task  # noqa: E402
from locust.exception import CatchResponseError  # noqa: E402

from tandem.benchmarks.bench.workloads import corpus_token_ids, cut_prompt  # noqa: E402
from tandem.services.client import Client  # noqa: E402

# Locust runs users as greenlets on gevent's monkey-patched loop. Without this (grpcio 1.85), the first blocking
# read of a stream holds the loop for good: no request completes, and neither --run-time nor SIGTERM stops locust.
# It must run before any channel exists.
grpc.experimental.gevent.init_gevent()

SHORT_PROMPT_TOKENS = (20, 60)  # decode-heavy's prompts (benchmarks/bench/workloads.py)
log = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    group = parser.add_argument_group("tandem")
    group.add_argument("--grpc-target", default="127.0.0.1:50051", env_var="LOCUST_GRPC_TARGET",
                       help="the gateway's gRPC address (GrpcUser); OpenAIUser uses --host")
    group.add_argument("--max-tokens", type=int, default=64, env_var="LOCUST_MAX_TOKENS",
                       help="tokens generated per request (greedy, ignore_eos)")
    group.add_argument("--long-prompt-tokens", type=int, default=1000, env_var="LOCUST_LONG_PROMPT_TOKENS",
                       help="length of a long prompt in tokens")
    group.add_argument("--long-share", type=float, default=0.2, env_var="LOCUST_LONG_SHARE",
                       help="share of requests with a long prompt")
    group.add_argument("--prompt-seed", type=int, default=0, env_var="LOCUST_PROMPT_SEED",
                       help="seed of the prompt sequence")
    group.add_argument("--model-dir", default=None, env_var="LOCUST_MODEL_DIR",
                       help="model directory whose tokenizer cuts the prompts (default: the converted SmolLM2)")
    group.add_argument("--request-timeout", type=float, default=300, env_var="LOCUST_REQUEST_TIMEOUT",
                       help="seconds a request may take")


class PromptMix:
    """Raw-text prompts of one seeded sequence: long (long_prompt_tokens) with probability long_share, else
    short (SHORT_PROMPT_TOKENS, uniform); each a fresh window of the corpus, so prefix-cache hits stay rare."""

    def __init__(self, model_dir: str | None, seed: int, long_share: float, long_prompt_tokens: int):
        from transformers import AutoTokenizer

        from tandem.tools.prepare_model import float_model_dir

        if not 0 <= long_share <= 1 or long_prompt_tokens <= 0:
            raise ValueError(f"need 0 <= --long-share <= 1 and --long-prompt-tokens > 0, got {long_share}, "
                             f"{long_prompt_tokens}")  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(float_model_dir(model_dir))
        self.corpus = corpus_token_ids(self.tokenizer)
        self.rng = random.Random(seed)
        self.long_share, self.long_prompt_tokens = long_share, long_prompt_tokens

    def next_prompt(self) -> str:
        is_long = self.rng.random() < self.long_share
        length = self.long_prompt_tokens if is_long else self.rng.randint(*SHORT_PROMPT_TOKENS)
        return cut_prompt(self.tokenizer, self.corpus, length, self.rng)[0]


@functools.cache
def prompt_mix(model_dir: str | None, seed: int, long_share: float, long_prompt_tokens: int) -> PromptMix:
    """The process's one PromptMix for these options (users share its sequence)."""
    return PromptMix(model_dir, seed, long_share, long_prompt_tokens)


def next_prompt(options) -> str:
    return prompt_mix(options.model_dir, options.prompt_seed, options.long_share,
                      options.long_prompt_tokens).next_prompt()  # fmt: skip


@events.init.add_listener
def load_prompts(environment, **kwargs) -> None:
    """Load the tokenizer and tokenize the corpus (seconds) before the test starts."""
    if environment.parsed_options is not None:
        next_prompt(environment.parsed_options)
        # NOTE: gevent's loop caches the time; left stale by those seconds, --run-time would end early by as much
        gevent.get_hub().loop.update_now()


def report_ttft(environment, request_name: str, ttft_ms: float | None) -> None:
    if ttft_ms is not None:
        environment.events.request.fire(request_type="ttft", name=request_name, response_time=ttft_ms,
                                        response_length=0, exception=None, context={})  # fmt: skip


class GrpcUser(User):
    """Streams Gateway.Generate on one channel per user."""

    def on_start(self) -> None:
        self.client = Client(self.environment.parsed_options.grpc_target)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        options = self.environment.parsed_options
        prompt = next_prompt(options)
        start = time.perf_counter()
        ttft_ms, tokens, error = None, 0, None
        try:
            for msg in self.client.stream(prompt, max_tokens=options.max_tokens, temperature=0, ignore_eos=True,
                                          timeout=options.request_timeout):  # fmt: skip
                if msg.token_ids and ttft_ms is None:
                    ttft_ms = (time.perf_counter() - start) * 1000
                tokens += len(msg.token_ids)
        except grpc.RpcError as e:
            error = CatchResponseError(f"{e.code().name}: {e.details()}")
        if error is None and tokens == 0:
            error = CatchResponseError("the stream ended without a token")
        self.environment.events.request.fire(request_type="grpc", name="Generate", response_length=tokens,
                                             response_time=(time.perf_counter() - start) * 1000,
                                             exception=error, context={})  # fmt: skip
        report_ttft(self.environment, "grpc Generate", ttft_ms if error is None else None)


class OpenAIUser(HttpUser):
    """Streams POST /v1/completions (OpenAI's API) on --host, with include_usage for the token count."""

    @task
    def completions(self) -> None:
        options = self.environment.parsed_options
        body = {"prompt": next_prompt(options), "max_tokens": options.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              timeout=options.request_timeout) as response:  # fmt: skip
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {http_error_message(response)}")
                return
            try:
                ttft_ms, tokens, error = read_completion_stream(response, start)
            except (requests.RequestException, ValueError) as e:  # a broken connection, a chunk that is not JSON
                ttft_ms, tokens, error = None, 0, f"reading the stream: {e!r}"
            # E2E latency and tokens in place of locust's time to headers and content-length
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            response.request_meta["response_length"] = tokens
            if error:
                response.failure(error)
            else:
                response.success()
        report_ttft(self.environment, "POST /v1/completions", ttft_ms if error is None else None)


def read_completion_stream(response, start: float) -> tuple[float | None, int, str | None]:
    """(TTFT in ms since `start`, completion tokens from the usage chunk, error or None) of an SSE stream."""
    ttft_ms, tokens = None, 0
    for line in response.iter_lines():
        if not line.startswith(b"data: "):
            continue  # the blank line between events
        data = line.removeprefix(b"data: ")
        if data == b"[DONE]":
            return ttft_ms, tokens, None if tokens else "no usage chunk with tokens before [DONE]"
        chunk = json.loads(data)
        if "error" in chunk:
            return ttft_ms, tokens, f"stream error: {chunk['error'].get('message')}"
        if chunk["choices"] and ttft_ms is None:
            ttft_ms = (time.perf_counter() - start) * 1000
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return ttft_ms, tokens, "the stream ended without [DONE]"


def http_error_message(response) -> str:
    """The message of an OpenAI-shaped error body, else the body or the connection error."""
    if response.status_code == 0:
        return str(response.error)
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


@events.quitting.add_listener
def log_tokens(environment, **kwargs) -> None:
    """Each request entry's output tokens (the sum of its sizes), and per second of the run."""
    total = environment.stats.total
    seconds = max(total.last_request_timestamp - total.start_time, 1e-9) if total.last_request_timestamp else None
    for (name, request_type), entry in environment.stats.entries.items():
        if request_type != "ttft" and seconds:
            log.info("%s %s: %d output tokens, %.1f tokens/s", request_type, name, entry.total_content_length,
                     entry.total_content_length / seconds)  # fmt: skip
