"""The OpenAI API's request bodies (pydantic) and their translation to the gRPC API's messages: SamplingParams
from a body (with the completions API's legacy echo and best_of) and the completions API's prompt forms. Field
names and shapes follow OpenAI's API reference plus vLLM's extensions (services/gateway/openai_serving.py serves
them; services/gateway/openai_responses.py assembles the answers)."""
from __future__ import annotations

import json
import math
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.services.gateway.openai_errors import APIError, http_param
from tandem.services.gateway.session_affinity import SESSION_HEADER, check_session_id
from tandem.services.gateway.validation import MAX_ID_CHARS, MAX_N
from tandem.shared.errors import InvalidRequestError
from tandem.v1 import common_pb2, gateway_pb2

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: SamplingParams' float fields
MAX_PROMPTS = 64  # prompts in one completions request (a list of strings or of token id lists); README "Limits"


def session_id(headers) -> str | None:
    """The request's session affinity key: its X-Session-Id header (headers: Starlette's), or None without one.
    APIError 400 naming the header when it is repeated or not 1-256 printable ASCII characters without spaces."""
    values = headers.getlist(SESSION_HEADER)
    if len(values) > 1:
        raise APIError(400, f"{SESSION_HEADER} is given {len(values)} times; send it once", SESSION_HEADER)
    try:
        for value in values:
            check_session_id(value, SESSION_HEADER)
    except InvalidRequestError as e:
        raise APIError(400, str(e), SESSION_HEADER) from None
    return values[0] if values else None


# -- request bodies ------------------------------------------------------------------------------------------
class Body(BaseModel):
    """The request bodies' base: strict types, so a boolean is JSON's true or false and a number a JSON number
    (pydantic's lax mode read "yes" and 1 as true, "0.5" and true as numbers); an integer field refuses 1.5 and
    1.0, a float field takes 1. A refusal is a 400 naming the field (openai_api.py)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class JSONSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's response_format: text, json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's structured_outputs extension: exactly one of these (common.proto StructuredOutput)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(Body):
    """The fields both endpoints share (OpenAI's, then vLLM's extensions). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False  # vLLM's: beam search with n beams, the n best returned
    priority: int = 0  # vLLM's: scheduling priority, lower first (GenerateRequest.priority)
    length_penalty: float | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text (OpenAI's)


class ToolCallItem(Body):
    """An assistant turn's tool call in the history (OpenAI's message.tool_calls[i])."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None  # a "tool" turn: the call it answers


class FunctionDefinition(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (calls are checked against the schema only under a required or named choice)


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: only enable_thinking is taken


class CompletionRequest(SamplingFields):
    """OpenAI's legacy completions body (API reference, "Completions"), with the fields vLLM's server reads."""

    prompt: Any  # a string, a list of strings, token ids, or a list of token id lists (prompts())
    # the sampled token's logprob and this many top alternatives per token, in OpenAI's {tokens, token_logprobs,
    # top_logprobs, text_offset} object; None: no logprobs
    logprobs: int | None = None
    # OpenAI: "echo back the prompt in addition to the completion": each choice's text is the prompt's text (token
    # id prompts decoded) followed by the completion; with logprobs, the logprobs object covers the prompt's
    # tokens first (the first one with null token_logprob and top_logprobs: nothing precedes it), as vLLM's
    echo: bool = False
    # OpenAI: text after the insertion point (fill-in-the-middle); refused, as vLLM does: this server only continues
    suffix: str | None = None
    # OpenAI: "generates best_of completions server-side and returns the best (the one with the highest log
    # probability per token)"; as vLLM V0, the best by cumulative logprob of the sampled tokens, n of them (n <=
    # best_of), best first; usage counts all best_of. Not with stream (OpenAI's rule) nor use_beam_search
    best_of: int | None = None


def check_int32(name: str, value: int) -> int:
    """value, for an int32 field of the gRPC API; APIError 400 naming the body's field when it is outside."""
    if not -(2**31) <= value < 2**31:
        raise APIError(400, f"{name} is out of range: {value}", name)
    return value


def set_fields(params: common_pb2.SamplingParams, values: dict[str, tuple[str, float | int | None]]) -> None:
    """Set params' fields from a body's values ({field: (the body's name, value)}, None: unset); APIError 400
    naming the body's field for an integer outside int32 or a finite float beyond float32 (what the gRPC fields
    hold: such a float would become inf there, and the refusal would quote inf, not the value sent)."""
    for field, (name, value) in values.items():
        if value is None:
            continue
        if isinstance(value, int):
            check_int32(name, value)
        if isinstance(value, float) and math.isfinite(value):
            try:
                struct.pack("<f", value)  # (OverflowError where float32 rounds it to inf; FLOAT32_MAX rounds down)
            except OverflowError:
                raise APIError(400, f"{name} is out of range: {value} (float32: at most {FLOAT32_MAX:.8g} in "
                                    "magnitude)", name) from None  # fmt: skip
        setattr(params, field, value)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
    """The request's fields as the gRPC API's SamplingParams (validated by the pipeline, which raises
    InvalidRequestError naming the field; the size limits too: validation.check_sampling_params)."""
    if body.cache_salt is not None and len(body.cache_salt) > MAX_ID_CHARS:
        raise APIError(400, f"cache_salt has {len(body.cache_salt)} characters; at most {MAX_ID_CHARS}", "cache_salt")
    if body.stream_options is not None and not body.stream:  # (OpenAI's rule: its options are the stream's)
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    p = common_pb2.SamplingParams(ignore_eos=body.ignore_eos,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
    for token, bias in (body.logit_bias or {}).items():
        if not (token.isascii() and token.isdigit()) or int(token) >= 2**32:
            raise APIError(400, f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
        p.logit_bias[int(token)] = bias
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    p.stop.extend(stop)
    for t in body.stop_token_ids or ():
        if not 0 <= t < 2**32:
            raise APIError(400, f"stop_token_ids must be token ids (>= 0), got {t}", "stop_token_ids")
        p.stop_token_ids.append(t)
    fields = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "min_p": body.min_p, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
              "min_tokens": body.min_tokens, "logprobs": logprobs, "prompt_logprobs": body.prompt_logprobs}  # fmt: skip
    chat = isinstance(body, ChatCompletionRequest)
    set_fields(p, {name: (http_param(name, body, chat), value) for name, value in fields.items()})
    if body.seed is not None:
        p.seed = body.seed % 2**64  # (any integer: OpenAI's seed is signed)
    if not 1 <= body.n <= MAX_N:  # (validation.py checks it again, for the gRPC API too)
        raise APIError(400, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    check_int32("priority", body.priority)
    p.n = body.n
    if body.use_beam_search:  # (one beam is greedy search, as HF's num_beams=1)
        if body.n > 1:
            p.beam_width = min(body.n, 2**31)
        elif body.temperature not in (None, 0):
            raise APIError(400, "beam search is deterministic: temperature must be 0 (or unset)", "temperature")
        else:
            p.temperature = 0.0
    if body.length_penalty is not None:
        if not body.use_beam_search:
            raise APIError(400, "length_penalty needs use_beam_search", "length_penalty")
        set_fields(p, {"length_penalty": ("length_penalty", body.length_penalty)})
    constraint = structured_output(body)
    if constraint is not None:
        p.structured_output.CopyFrom(constraint)
    return p


def completion_sampling_params(body: CompletionRequest) -> common_pb2.SamplingParams:
    """sampling_params for the completions API with its legacy fields: best_of > 1 generates best_of
    completions per prompt (SamplingParams.n), with their sampled tokens' logprobs to rank them (logprobs 0 when
    the client asked for none; services/gateway/openai_responses.py drops them then); echo with logprobs asks
    for the prompt's logprobs as well (prompt_logprobs: the larger of logprobs and the client's own). APIError
    400 naming suffix, best_of or max_tokens where they cannot be served."""
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported: this server continues a prompt and cannot insert text "
                            "before a suffix (fill-in-the-middle)", "suffix")  # fmt: skip
    best_of = body.best_of
    if best_of is not None:
        if not body.n <= best_of <= MAX_N:
            raise APIError(400, f"best_of must be in [n = {body.n}, {MAX_N}], got {best_of}", "best_of")
        if best_of > 1 and body.stream:
            raise APIError(400, "best_of > 1 cannot be streamed (the best are known only at the end)", "best_of")
        if best_of > 1 and body.use_beam_search:
            raise APIError(400, "best_of does not combine with use_beam_search (n sets the beams)", "best_of")
    if body.echo and body.max_tokens == 0:
        raise APIError(400, "max_tokens must be positive, got 0: echo with max_tokens 0 (scoring the prompt alone) is "
                            "not supported; ask for max_tokens 1 with echo and logprobs", "max_tokens")  # fmt: skip
    ranked = best_of is not None and best_of > 1
    p = sampling_params(body, body.max_tokens, 0 if ranked and body.logprobs is None else body.logprobs)
    if ranked:
        p.n = best_of
    if body.echo and body.logprobs is not None:  # (values range-checked by sampling_params)
        p.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
    return p


def structured_output(body: SamplingFields) -> common_pb2.StructuredOutput | None:
    """response_format (json_object, json_schema) or vLLM's structured_outputs as the gRPC API's constraint;
    None for text. APIError 400 naming the field when a schema is missing or both fields constrain."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError(400, "set response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        return common_pb2.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_))
    if so is None:
        return None
    kinds = {name: value for name, value in so.model_dump().items() if value not in (None, False)}
    if len(kinds) != 1:
        raise APIError(400, "structured_outputs must set exactly one of json, json_object, regex, choice, grammar",
                       "structured_outputs")  # fmt: skip
    kind, value = kinds.popitem()
    if kind == "json_":
        return common_pb2.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.StructuredOutput.Choices(choices=value))
    return common_pb2.StructuredOutput(**{kind: value})


def prompts(prompt) -> list[str | list[int]]:
    """The completions API's prompt field as a list of prompts: a string, a list of strings, a list of token
    ids (one prompt) or a list of token id lists (at most MAX_PROMPTS). APIError 400 for anything else or an
    empty prompt (token ids are range-checked by request.check_token_ids)."""
    def is_ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or (is_ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not (all(isinstance(p, str) for p in prompt)
                                                          or all(is_ids(p) for p in prompt)):  # fmt: skip
        raise APIError(400, "prompt must be a non-empty string, list of strings, list of token ids, or list of token "
                            "id lists", "prompt")  # fmt: skip
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    for p in prompt:
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
    return prompt


TOOL_CHOICES = {"auto": gateway_pb2.TOOL_CHOICE_AUTO, "none": gateway_pb2.TOOL_CHOICE_NONE,
                "required": gateway_pb2.TOOL_CHOICE_REQUIRED}


def chat_messages(body: ChatCompletionRequest, role_aliases: dict[str, str]) -> gateway_pb2.ChatMessages:
    """The body's turns, tools, tool_choice, parallel_tool_calls and chat_template_kwargs as the gRPC API's
    ChatMessages. APIError 400 naming the field for a tool_choice without tools or a template argument other
    than enable_thinking."""
    chat = gateway_pb2.ChatMessages()
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content or ())
        message = chat.messages.add(role=role_aliases.get(m.role, m.role), content=content,
                                    tool_call_id=m.tool_call_id or "")  # fmt: skip
        for call in m.tool_calls or ():
            message.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
    for tool in body.tools or ():
        f = tool.function
        chat.tools.add(name=f.name, description=f.description or "",
                       parameters_json=json.dumps(f.parameters) if f.parameters is not None else "")  # fmt: skip
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        chat.tool_choice, chat.tool_choice_function = gateway_pb2.TOOL_CHOICE_FUNCTION, choice.function.name
    elif choice is not None:
        chat.tool_choice = TOOL_CHOICES[choice]
    if choice is not None and choice != "none" and not body.tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if body.parallel_tool_calls is not None:
        chat.parallel_tool_calls = body.parallel_tool_calls
    for key, value in (body.chat_template_kwargs or {}).items():
        if key != "enable_thinking" or not isinstance(value, bool):
            raise APIError(400, f"chat_template_kwargs.{key}: only enable_thinking (true or false) is supported",
                           "chat_template_kwargs")  # fmt: skip
        chat.enable_thinking = value
    return chat
