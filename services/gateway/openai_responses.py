"""OpenAI answers from the gRPC API's GenerateResponse messages: each prompt's completions as the choices of one
JSON body or of a stream of server-sent events, with OpenAI's logprobs objects, vLLM's prompt_logprobs, usage
totals, and the completions API's legacy echo and best_of (OpenAI's API reference; vLLM's serving_completion
answers the same way). services/gateway/openai_serving.py runs the requests and serves these."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from tandem.services.client import finish_name
from tandem.services.gateway.reasoning import ReasoningStream, split_reasoning
from tandem.services.gateway.tool_parsers import ToolCall, ToolCallStream, parse
from tandem.v1 import gateway_pb2


@dataclass(frozen=True)
class ResponseShape:
    """What the client asked to see of each prompt's completions (the request may generate more: best_of, or
    logprobs and prompt logprobs used internally)."""

    chat: bool
    n: int  # choices per prompt: choice p * n + i is prompt p's i-th
    best_of: bool = False  # completions' best_of > 1: choices are the n generated of highest cumulative logprob
    logprobs: int | None = None  # top alternatives per token the client asked for; None: no logprobs object
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs the client asked for; None: no such field
    echo: list[str] | None = None  # completions' echo: each prompt's text, put before each of its completions
    prompts: list[list[int]] = field(default_factory=list)  # each prompt's token ids (echo's logprobs name them)
    tool_parser: str | None = None  # chat: answers are read for tool calls (tool_parsers.py)
    reasoning_parser: str | None = None  # chat: reasoning split into reasoning_content (reasoning.py)


def answer_parts(shape: ResponseShape, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """A whole chat answer per the request's parsers: (reasoning or None, content (None when there are calls and
    nothing else), tool calls). What each API's whole answer is built from."""
    reasoning = None
    if shape.reasoning_parser is not None:
        reasoning, text = split_reasoning(shape.reasoning_parser, text)
    content, calls = parse(shape.tool_parser, text) if shape.tool_parser is not None else (text, [])
    return reasoning, content, calls


def chat_message(shape: ResponseShape, text: str) -> dict:
    """A whole chat answer as OpenAI's message: content, and with the request's parsers tool_calls (content null
    when there is nothing else) and reasoning_content."""
    reasoning, content, calls = answer_parts(shape, text)
    message: dict = {"role": "assistant"}
    if shape.reasoning_parser is not None:
        message["reasoning_content"] = reasoning
    message["content"] = content
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]  # fmt: skip
    return message


class ChatDeltas:
    """One chat completion's text deltas as OpenAI's delta objects: reasoning_content, content and tool_calls
    deltas, per the request's parsers (reasoning.ReasoningStream, tool_parsers.ToolCallStream)."""

    def __init__(self, shape: ResponseShape):
        self.reasoning = ReasoningStream(shape.reasoning_parser) if shape.reasoning_parser else None
        self.tools = ToolCallStream(shape.tool_parser) if shape.tool_parser else None

    def feed(self, text: str, final: bool) -> dict:
        delta: dict = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.tools is None:
            delta["content"] = content
            return delta
        for part in self.tools.feed(content, final):
            if "content" in part:
                delta["content"] = delta.get("content", "") + part["content"]
            else:
                delta.setdefault("tool_calls", []).extend(part["tool_calls"])
        return delta

    def pieces(self, text: str, final: bool) -> list[tuple[str, str | dict]]:
        """feed() as its parts in order, for the APIs that stream them as separate blocks or items:
        ("reasoning", text), ("content", text), then ("tool_call", one tool_calls delta) for each."""
        delta = self.feed(text, final)
        out: list[tuple[str, str | dict]] = [("reasoning", delta["reasoning_content"])] if delta.get(
            "reasoning_content") else []  # fmt: skip
        out += [("content", delta["content"])] if delta.get("content") else []
        return out + [("tool_call", call) for call in delta.get("tool_calls", ())]


@dataclass(slots=True)
class Completion:
    """One completion, accumulated from its messages."""

    text: str = ""
    logprobs: list = field(default_factory=list)  # TokenLogprobs of each sampled token (when asked)
    finish_reason: str | None = None

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the sampled tokens' logprobs: best_of's ranking (vLLM's cumulative_logprob)."""
        return sum(lp.logprob for lp in self.logprobs)


class Totals:
    """OpenAI usage over a response's completions: each prompt counted once, every completion's tokens (all of
    best_of's, as OpenAI bills them)."""

    def __init__(self):
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, usage: gateway_pb2.Usage, count_prompt: bool) -> None:
        self.completion_tokens += usage.completion_tokens
        if count_prompt:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens

    def as_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}  # fmt: skip


# -- logprobs objects ----------------------------------------------------------------------------------------
def chat_logprobs(logprobs, tokenizer) -> dict:
    """TokenLogprobs protos -> OpenAI chat's {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(lp.token_id, lp.logprob)
                        | {"top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in logprobs]}


def completion_logprobs(logprobs, tokenizer, top: int, text_offset: int = 0,
                        first_prompt_token: int | None = None) -> dict:
    """TokenLogprobs protos -> the completions API's {tokens, token_logprobs, top_logprobs, text_offset}: each
    token's text, logprob, its `top` most likely alternatives {text: logprob}, and where its text starts (the
    sum of the token texts before it, from text_offset). first_prompt_token: echo's first prompt token, put
    first with null token_logprob and top_logprobs (no logprob: nothing precedes it; OpenAI's and vLLM's)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if first_prompt_token is not None:
        out["tokens"].append(text(first_prompt_token))
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
    for lp in logprobs:
        out["tokens"].append(text(lp.token_id))
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({text(t.token_id): t.logprob for t in lp.top[:top]})
    for token in out["tokens"]:
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def format_prompt_logprobs(prompt_logprobs, tokenizer, top: int) -> list:
    """GenerateResponse.prompt_logprobs -> vLLM's prompt_logprobs: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} holding the prompt token and its `top` most likely alternatives."""
    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}

    out: list = [None]
    for lp in prompt_logprobs:
        ranked = {str(t.token_id): entry(t.token_id, t.logprob, r) for r, t in enumerate(lp.top[:top], 1)}
        out.append({str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)} | {
            k: v for k, v in ranked.items() if k != str(lp.token_id)})
    return out


def _completion_choice(shape: ResponseShape, p: int, text: str, logprobs: list, prompt_logprobs: list,
                       echo: bool, text_offset: int, tokenizer, whole: bool) -> dict:
    """A completions choice's text and logprobs for prompt p; echo: put the prompt (and its logprobs) first;
    whole: a completion's whole text (a JSON body), which carries a logprobs object when asked even without
    tokens (a chunk without tokens carries null)."""
    if echo:
        text = shape.echo[p] + text
        logprobs = prompt_logprobs + logprobs
    lp = None
    if shape.logprobs is not None and (logprobs or echo or whole):
        lp = completion_logprobs(logprobs, tokenizer, shape.logprobs, text_offset,
                                 shape.prompts[p][0] if echo else None)  # fmt: skip
    return {"text": text, "logprobs": lp}


# -- one JSON body -------------------------------------------------------------------------------------------
async def collect(messages, shape: ResponseShape, tokenizer) -> tuple[list[dict], Totals]:
    """Read the prompts' merged streams (openai_serving.merge: (prompt p, the pipeline's message)) to the end and
    assemble the choices: prompt p's completions as choices p * n + i, or with best_of the n of highest
    cumulative logprob, best first (ties in generation order). Returns (choices, usage over every completion
    generated)."""
    generated: dict[int, dict[int, Completion]] = {}
    prompt_logprobs: dict[int, list] = {}  # (from completion 0 of each prompt; every choice of it shows them)
    usage = Totals()
    try:
        async for p, msg in messages:
            c = generated.setdefault(p, {}).setdefault(msg.index, Completion())
            c.text += msg.text
            c.logprobs.extend(msg.logprobs)
            if msg.prompt_logprobs:
                prompt_logprobs[p] = list(msg.prompt_logprobs)
            if msg.HasField("finish_reason"):
                c.finish_reason = finish_name(msg.finish_reason)
                usage.add(msg.usage, msg.index == 0)
    finally:
        await messages.aclose()  # (cancelled: each completion's calls are cancelled on both tiers)
    choices = []
    for p, completions in sorted(generated.items()):
        ranked = [completions[i] for i in sorted(completions)]
        if shape.best_of:
            ranked.sort(key=lambda c: -c.cumulative_logprob)
        for i, c in enumerate(ranked[: shape.n]):
            choice = {"index": p * shape.n + i}
            if shape.chat:
                logprobs = chat_logprobs(c.logprobs, tokenizer) if shape.logprobs is not None else None
                choice |= {"message": chat_message(shape, c.text), "logprobs": logprobs}
            else:
                choice |= _completion_choice(shape, p, c.text, c.logprobs, prompt_logprobs.get(p, []),
                                             shape.echo is not None, 0, tokenizer, whole=True)  # fmt: skip
            choice["finish_reason"] = c.finish_reason
            if shape.prompt_logprobs is not None:
                top = shape.prompt_logprobs
                choice["prompt_logprobs"] = (format_prompt_logprobs(prompt_logprobs[p], tokenizer, top)
                                             if p in prompt_logprobs else None)  # fmt: skip
            choices.append(choice)
    return choices, usage


# -- server-sent events --------------------------------------------------------------------------------------
async def sse(messages, first: list, base: dict, shape: ResponseShape, include_usage: bool, tokenizer, on_error):
    """Server-sent events: one chunk per message of each completion (chat's first chunk of a completion
    carries the assistant role; with echo, a completion's first chunk starts with the prompt, as vLLM's), its
    finish chunk, then with include_usage a last chunk with empty choices and the usage (every other chunk has
    "usage": null), then [DONE]. text_offset goes on from the text sent before. messages: the prompts' merged
    streams (openai_serving.merge: (prompt p, message)); first: the ones already read from it. An error mid-stream is
    sent as an error chunk, on_error(exception)'s body."""
    kind = "chat.completion.chunk" if shape.chat else "text_completion"
    usage = Totals()
    sent: dict[int, int] = {}  # choice index -> characters of text sent (its next text_offset)
    chats: dict[int, ChatDeltas] = {}  # choice index -> its delta maker (chat)
    prompt_logprobs: dict[int, list] = {}

    def chunk(choices: list, usage_json=None) -> str:
        body = base | {"object": kind, "choices": choices}
        if include_usage:
            body["usage"] = usage_json
        return f"data: {json.dumps(body)}\n\n"

    async def every_message():
        for item in first:
            yield item
        async for item in messages:
            yield item

    try:
        async for p, msg in every_message():
            index = p * shape.n + msg.index
            opening = index not in sent
            finish = finish_name(msg.finish_reason) if msg.HasField("finish_reason") else None
            if msg.prompt_logprobs:
                # NOTE: completion 0's first message, which the pipeline sends before any other completion's
                prompt_logprobs[p] = list(msg.prompt_logprobs)
            choice: dict = {"index": index}
            if shape.chat:
                delta = chats.setdefault(index, ChatDeltas(shape)).feed(msg.text, final=finish is not None)
                delta = ({"role": "assistant"} | delta) if opening else delta
                wanted = shape.logprobs is not None and msg.logprobs
                choice |= {"delta": delta, "logprobs": chat_logprobs(msg.logprobs, tokenizer) if wanted else None}
            else:
                echo = shape.echo is not None and opening
                choice |= _completion_choice(shape, p, msg.text, list(msg.logprobs), prompt_logprobs.get(p, []),
                                             echo, sent.get(index, 0), tokenizer, whole=False)  # fmt: skip
            choice["finish_reason"] = finish
            sent[index] = sent.get(index, 0) + len(choice.get("text", msg.text))
            if msg.prompt_logprobs and shape.prompt_logprobs is not None:
                choice["prompt_logprobs"] = format_prompt_logprobs(msg.prompt_logprobs, tokenizer,
                                                                   shape.prompt_logprobs)  # fmt: skip
            if finish is not None:
                usage.add(msg.usage, msg.index == 0)
            if msg.text or msg.token_ids or choice.get("text") or "prompt_logprobs" in choice or finish or (
                    shape.chat and len(choice["delta"]) > 1):
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage.as_json())
    except Exception as e:
        yield f"data: {json.dumps(on_error(e))}\n\n"
    finally:
        await messages.aclose()  # a client gone mid-stream: each completion's decode call is cancelled
    yield "data: [DONE]\n\n"
