"""A small synchronous client for the gateway's Generate stream (used by the CLI, tests and benchmarks)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import grpc

from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def finish_name(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop" (the names vLLM and the OpenAI API use)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


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
) -> gateway_pb2.GenerateRequest:
    """Build a GenerateRequest: raw text, or a chat (history of (role, content) turns + this user prompt);
    cache_salt: requests with different salts never share prefix-cache blocks."""
    params = common_pb2.SamplingParams(stop=stop or [], ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):  # fmt: skip
        if value is not None:
            setattr(params, name, value)
    if raw:
        return gateway_pb2.GenerateRequest(prompt=prompt, sampling_params=params, cache_salt=cache_salt)
    turns = [gateway_pb2.ChatMessage(role=r, content=c) for r, c in (history or [])]
    turns.append(gateway_pb2.ChatMessage(role="user", content=prompt))
    return gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=turns), sampling_params=params,
                                       cache_salt=cache_salt)


def stream(address: str, request: gateway_pb2.GenerateRequest, timeout: float | None = None) -> Iterator[gateway_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        yield from gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout)


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and of those accepted
    num_accepted_tokens: int = 0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)  # client-side gaps between token messages

    def as_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_tokens": self.cached_tokens, "num_draft_tokens": self.num_draft_tokens,
                      "num_accepted_tokens": self.num_accepted_tokens},
            "timings": {"ttft_ms": round(self.ttft_ms, 2), "e2e_ms": round(self.e2e_ms, 2)},
        }


def generate(address: str, request: gateway_pb2.GenerateRequest, on_text=None, timeout: float | None = None) -> Completion:
    """Run one request to the end; on_text(delta) is called as text arrives. Raises grpc.RpcError on failure."""
    out = Completion()
    last = time.perf_counter()
    for msg in stream(address, request, timeout):
        now = time.perf_counter()
        if msg.token_ids:
            if out.token_ids:
                out.itl_ms.append((now - last) * 1000)
            last = now
        out.text += msg.text
        out.token_ids.extend(msg.token_ids)
        if msg.text and on_text:
            on_text(msg.text)
        if msg.HasField("finish_reason"):
            out.finish_reason = finish_name(msg.finish_reason)
            out.prompt_tokens, out.completion_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
            out.cached_tokens = msg.usage.cached_tokens
            out.num_draft_tokens, out.num_accepted_tokens = msg.usage.num_draft_tokens, msg.usage.num_accepted_tokens
            out.ttft_ms, out.e2e_ms = msg.timings.ttft_ms, msg.timings.e2e_ms
    return out
