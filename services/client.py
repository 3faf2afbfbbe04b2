"""Python clients for the gateway's Generate stream: Client (sync) and AsyncClient (grpc.aio), each holding one
channel, plus the per-call free functions make_request / stream / generate (used by the CLI, tests and
benchmarks). Requests are built in one place (build_request) and answers accumulated in one (Completion.add)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.security import TLSConfig, bearer_metadata, open_channel
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
# GenerateRequest's own optional fields
REQUEST_FIELDS = ("cache_salt", "deadline_ms", "priority", "session_id", "lora_name")
STRUCTURED_OUTPUT_KINDS = tuple(common_pb2.StructuredOutput.DESCRIPTOR.fields_by_name)


def finish_name(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop" (the names vLLM and the OpenAI API use)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def build_request(prompt: str | None = None, *, messages: list[dict] | None = None,
                  **fields: Any) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest from raw text `prompt` or chat `messages` ([{"role", "content"}], chat-templated by the
    gateway), the request's own fields cache_salt, deadline_ms, priority, session_id and lora_name (the LoRA
    adapter to generate with; None, "" or the base model's name: the base model) (gateway.proto), and
    SamplingParams fields by name (common.proto; None means the server's default). `stop` may be one string;
    `structured_output` is a dict with one key, e.g. {"regex": "[0-9]+"}, {"choice": ["yes", "no"]} or
    {"json_schema": schema} (schema as JSON text or a dict).

    TypeError: neither or both of prompt and messages, or an unknown parameter name (the message names it).
    ValueError / TypeError from protobuf for a value of the wrong type or out of the field's integer range.
    """
    if (prompt is None) == (messages is None):
        raise TypeError("pass exactly one of prompt (raw text) and messages (chat turns)")
    options = {name: value for name in REQUEST_FIELDS if (value := fields.pop(name, None)) is not None}
    sampling = fields
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown parameter(s) {', '.join(unknown)}; a request takes {', '.join(REQUEST_FIELDS)} "
                        f"and the SamplingParams fields {', '.join(sorted(SAMPLING_FIELDS))}")  # fmt: skip
    values = {name: value for name, value in sampling.items() if value is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if "structured_output" in values:
        values["structured_output"] = _structured_output(values["structured_output"])
    params = common_pb2.SamplingParams(**values)
    if prompt is not None:
        return gateway_pb2.GenerateRequest(prompt=prompt, sampling_params=params, **options)
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in messages])
    return gateway_pb2.GenerateRequest(chat=chat, sampling_params=params, **options)


def _structured_output(value: dict | common_pb2.StructuredOutput) -> common_pb2.StructuredOutput:
    if isinstance(value, common_pb2.StructuredOutput):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"structured_output must be a dict with one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
    ((kind, spec),) = value.items()
    if kind == "choice":
        spec = common_pb2.StructuredOutput.Choices(choices=list(spec))
    elif kind == "json_schema" and not isinstance(spec, str):
        spec = json.dumps(spec)
    return common_pb2.StructuredOutput(**{kind: spec})


def make_request(
    prompt: str,
    raw: bool = False,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    history: list[tuple[str, str]] | None = None,
    ignore_eos: bool = False,
    cache_salt: str | None = None,
    session_id: str | None = None,
    lora_name: str | None = None,
) -> gateway_pb2.GenerateRequest:
    """Build a GenerateRequest: raw text, or a chat (history of (role, content) turns + this user prompt);
    cache_salt: requests with different salts never share prefix-cache blocks; session_id: session affinity's
    routing key (requests of one session stay on one prefill/decode pair while their load is within a bound);
    lora_name: the LoRA adapter to generate with (docs/lora.md; None: the base model)."""
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    stop=stop, ignore_eos=ignore_eos)  # fmt: skip
    options = dict(cache_salt=cache_salt, session_id=session_id, lora_name=lora_name)
    if raw:
        return build_request(prompt, **options, **sampling)
    turns = [{"role": r, "content": c} for r, c in (history or [])] + [{"role": "user", "content": prompt}]
    return build_request(messages=turns, **options, **sampling)


def _check_single(request: gateway_pb2.GenerateRequest) -> None:
    if request.sampling_params.n > 1:
        raise ValueError(f"generate() returns one completion but n={request.sampling_params.n}: use stream(), "
                         "whose messages carry the completion's index")  # fmt: skip


@dataclass
class Completion:
    """One finished completion: its text and tokens, and the last message's finish reason, usage and timings."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"; None if the stream ended without one
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    cached_tokens_host: int = 0  # of those, loaded from an instance's host-memory / disk KV tier
    cached_tokens_disk: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and of those accepted
    num_accepted_tokens: int = 0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)  # client-side gaps between token messages
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked
    _last_token_at: float | None = field(default=None, init=False, repr=False, compare=False)

    def add(self, msg: gateway_pb2.GenerateResponse) -> None:
        """Append one GenerateResponse of the stream (call as each arrives: it times the gaps between tokens)."""
        if msg.token_ids:
            now = time.perf_counter()
            if self._last_token_at is not None:
                self.itl_ms.append((now - self._last_token_at) * 1000)
            self._last_token_at = now
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        if msg.HasField("finish_reason"):
            self.finish_reason = finish_name(msg.finish_reason)
            u = msg.usage
            self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens
            self.cached_tokens, self.cached_tokens_host, self.cached_tokens_disk = (
                u.cached_tokens, u.cached_tokens_host, u.cached_tokens_disk)  # fmt: skip
            self.num_draft_tokens, self.num_accepted_tokens = u.num_draft_tokens, u.num_accepted_tokens
            self.ttft_ms, self.e2e_ms = msg.timings.ttft_ms, msg.timings.e2e_ms

    def as_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_tokens": self.cached_tokens, "cached_tokens_host": self.cached_tokens_host,
                      "cached_tokens_disk": self.cached_tokens_disk, "num_draft_tokens": self.num_draft_tokens,
                      "num_accepted_tokens": self.num_accepted_tokens},
            "timings": {"ttft_ms": round(self.ttft_ms, 2), "e2e_ms": round(self.e2e_ms, 2)},
        }


def _collect(messages: Iterable[gateway_pb2.GenerateResponse], on_text=None) -> Completion:
    out = Completion()
    for msg in messages:
        out.add(msg)
        if msg.text and on_text:
            on_text(msg.text)
    return out


def _health_status(reply: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class Client:
    """A synchronous client of one gateway ("host:port"), holding one channel until close() or the end of a
    `with` block. Thread-safe: calls from several threads share the channel. tls: speak TLS (its ca_file, else
    the system's roots; its cert_file / key_file as client certificate); None: plaintext. api_key: sent as
    "authorization: Bearer <key>" with every call (the gateway's --api-key).

    Every RPC raises grpc.RpcError on failure; .code() is the server's status (INVALID_ARGUMENT for bad input,
    with .details() naming the field; DEADLINE_EXCEEDED past `timeout` seconds; UNAVAILABLE when unreachable or
    when TLS fails; UNAUTHENTICATED without a valid API key). ValueError naming the setting of a TLS file that
    cannot be read.
    """

    def __init__(self, address: str, *, tls: TLSConfig | None = None, api_key: str | None = None):
        self.address = address
        self._metadata = bearer_metadata(api_key)
        self._channel = open_channel(address, tls, aio=False)
        self._gateway = gateway_pb2_grpc.GatewayStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None, timeout: float | None = None,
               **fields: Any) -> Iterator[gateway_pb2.GenerateResponse]:
        """Yield the GenerateResponse messages (text deltas with their token_ids, and logprobs when asked; the
        last one has finish_reason, usage and timings; with n > 1 each completion's messages carry its index and
        it ends with its own finish message). Arguments as build_request's. Stopping the iteration early
        (break, or closing the generator) cancels the request, which frees its KV on both tiers."""
        yield from self.stream_request(build_request(prompt, messages=messages, **fields),
                                       timeout)  # fmt: skip

    def stream_request(self, request: gateway_pb2.GenerateRequest,
                       timeout: float | None = None) -> Iterator[gateway_pb2.GenerateResponse]:
        """stream() for a GenerateRequest built beforehand (build_request, make_request)."""
        call = self._gateway.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # no-op once the call has finished

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None, **fields: Any) -> Completion:
        """Run one request to the end and return its Completion (text, token_ids, finish_reason, the usage counts
        and timings of the last message, logprobs when asked). ValueError for n > 1 (use stream()); see
        build_request for the other arguments."""
        request = build_request(prompt, messages=messages, **fields)
        _check_single(request)
        return _collect(self.stream_request(request, timeout))

    def health(self, timeout: float | None = 10.0) -> str:
        """The gateway's grpc.health.v1 status name: "SERVING", or "NOT_SERVING" while it shuts down."""
        return _health_status(self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """An asyncio client of one gateway ("host:port"), holding one grpc.aio channel until close() or the end of an
    `async with` block; make it inside the event loop that uses it. Concurrent calls (asyncio.gather) share the
    channel. Methods and arguments as Client's.

    Every RPC raises grpc.aio.AioRpcError (a grpc.RpcError) on failure; .code() is the server's status.
    """

    def __init__(self, address: str, *, tls: TLSConfig | None = None, api_key: str | None = None):
        self.address = address
        self._metadata = bearer_metadata(api_key)
        self._channel = open_channel(address, tls)
        self._gateway = gateway_pb2_grpc.GatewayStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     timeout: float | None = None, **fields: Any) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Async-yield the GenerateResponse messages, as Client.stream. To cancel promptly when stopping early,
        iterate under contextlib.aclosing(...); otherwise the request is cancelled when the generator is
        finalized."""
        request = build_request(prompt, messages=messages, **fields)
        async for msg in self.stream_request(request, timeout):
            yield msg

    async def stream_request(self, request: gateway_pb2.GenerateRequest,
                             timeout: float | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """stream() for a GenerateRequest built beforehand (build_request, make_request)."""
        call = self._gateway.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()  # no-op once the call has finished

    async def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       timeout: float | None = None, **fields: Any) -> Completion:
        """As Client.generate: the request's Completion; ValueError for n > 1 (use stream())."""
        request = build_request(prompt, messages=messages, **fields)
        _check_single(request)
        out = Completion()
        async for msg in self.stream_request(request, timeout):
            out.add(msg)
        return out

    async def health(self, timeout: float | None = 10.0) -> str:
        """As Client.health: "SERVING" when the gateway serves."""
        return _health_status(await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def stream(address: str, request: gateway_pb2.GenerateRequest, timeout: float | None = None, *,
           tls: TLSConfig | None = None, api_key: str | None = None) -> Iterator[gateway_pb2.GenerateResponse]:
    """Client(address, tls=tls, api_key=api_key).stream_request(request) on a channel of its own, closed when the
    stream ends."""
    with Client(address, tls=tls, api_key=api_key) as client:
        yield from client.stream_request(request, timeout)


def generate(address: str, request: gateway_pb2.GenerateRequest, on_text=None, timeout: float | None = None, *,
             tls: TLSConfig | None = None, api_key: str | None = None) -> Completion:
    """Run one request to the end on a channel of its own (tls, api_key: as Client's); on_text(delta) is called
    as text arrives. Raises grpc.RpcError on failure. NOTE: with n > 1 the completions' messages are merged into
    one Completion (tests/integration/test_api_fuzz.py relies on that); Client.generate refuses n > 1 instead."""
    return _collect(stream(address, request, timeout, tls=tls, api_key=api_key), on_text)
