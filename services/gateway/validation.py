"""A request's validation for both public APIs (docs/api.md "Limits"): the prompt (tokenize_request) and the
sampling parameters (check_sampling_params, which resolves max_tokens) and the token ids a client sends
(shared/request.py check_token_ids, the same check the engines run), each refusal an InvalidRequestError
naming the field. A prompt's own limits follow from the model's context: at most max_model_len - 1 tokens, and at most
MAX_CHARS_PER_TOKEN * max_model_len characters before it is tokenized."""
from __future__ import annotations

from tandem.services.convert import sampling_params_from_proto
from tandem.services.gateway.beam_search import check_beam_params
from tandem.services.gateway.session_affinity import check_session_id
from tandem.services.gateway.tool_calls import check_tools, render_messages
from tandem.shared.config import ModelConfig
from tandem.shared.errors import InvalidRequestError
from tandem.shared.request import check_token_ids
from tandem.shared.structured_output import check_grammar
from tandem.v1 import common_pb2, gateway_pb2

MAX_N = 16  # most completions of one prompt per request
MAX_CHARS_PER_TOKEN = 64
MAX_STOP = 32  # stop strings per request (OpenAI allows 4; vLLM sets no limit)
MAX_STOP_CHARS = 256  # characters per stop string (the text stream holds back this much at most)
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024  # a json_schema, regex or grammar's text; choice: all choices together
MAX_CHOICES = 1024  # structured_output choice entries
MAX_ID_CHARS = 256  # request_id and cache_salt
ROLES = ("system", "user", "assistant", "tool")


def check_counts(p: common_pb2.SamplingParams) -> None:
    """InvalidRequestError naming the field when a repeated field of p is over its limit (MAX_STOP stop strings
    of at most MAX_STOP_CHARS characters, MAX_STOP_TOKEN_IDS stop_token_ids, MAX_LOGIT_BIAS logit_bias entries)."""
    if len(p.stop) > MAX_STOP:
        raise InvalidRequestError(f"stop has {len(p.stop)} strings; at most {MAX_STOP}")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        longest = max(len(s) for s in p.stop)
        raise InvalidRequestError(f"stop strings must have at most {MAX_STOP_CHARS} characters, got {longest}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids has {len(p.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias has {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")


def check_structured_output_size(so: common_pb2.StructuredOutput) -> None:
    """InvalidRequestError naming structured_output when its text (a json_schema, regex or grammar; choice: all
    choices together) has more than MAX_STRUCTURED_OUTPUT_CHARS characters or choice more than MAX_CHOICES
    entries: checked before the grammar is compiled."""
    kind = so.WhichOneof("kind")
    if kind == "choice":
        if len(so.choice.choices) > MAX_CHOICES:
            raise InvalidRequestError(f"structured_output.choice has {len(so.choice.choices)} entries; at most "
                                      f"{MAX_CHOICES}")  # fmt: skip
        size = sum(len(c) for c in so.choice.choices)
    else:
        size = len(getattr(so, kind)) if kind in ("json_schema", "regex", "grammar") else 0
    if size > MAX_STRUCTURED_OUTPUT_CHARS:
        raise InvalidRequestError(f"structured_output has {size} characters; at most {MAX_STRUCTURED_OUTPUT_CHARS}")


def check_roles(chat: gateway_pb2.ChatMessages) -> None:
    """InvalidRequestError naming a chat turn's role that is not one of ROLES."""
    for m in chat.messages:
        if m.role not in ROLES:
            raise InvalidRequestError(f"unknown chat role {m.role!r}; expected one of {ROLES}")


def tokenize_request(tokenizer, request: gateway_pb2.GenerateRequest, max_model_len: int) -> list[int]:
    """Prompt text or chat turns -> token ids. InvalidRequestError on empty or oversized input or an unknown
    role. Chat turns give exactly apply_chat_template(..., add_generation_prompt=True, tokenize=True)'s ids
    (the template writes any special tokens itself; nothing is added), with the chat's tools and tool calls
    (tool_calls.render_messages) and its enable_thinking."""
    for name in ("request_id", "cache_salt"):
        if len(getattr(request, name)) > MAX_ID_CHARS:
            raise InvalidRequestError(f"{name} has {len(getattr(request, name))} characters; at most {MAX_ID_CHARS}")
    if request.HasField("session_id"):
        check_session_id(request.session_id)
    kind = request.WhichOneof("input")
    if kind == "chat":
        chat = request.chat
        if not chat.messages or all(not m.content and not m.tool_calls for m in chat.messages):
            raise InvalidRequestError("prompt is empty: chat has no message with content")
        check_roles(chat)
        _check_chars(sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in chat.messages),
                     max_model_len)  # fmt: skip
        messages, extra = render_messages(chat, check_tools(chat), tokenizer)
        if chat.HasField("enable_thinking"):
            extra["enable_thinking"] = chat.enable_thinking
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **extra))
    if kind != "prompt" or not request.prompt:
        raise InvalidRequestError("prompt is empty")
    _check_chars(len(request.prompt), max_model_len)
    return tokenizer(request.prompt, add_special_tokens=False).input_ids


def _merged(p: common_pb2.SamplingParams, values: dict) -> common_pb2.SamplingParams:
    """A copy of p with values set (fields p leaves unset)."""
    merged = common_pb2.SamplingParams()
    merged.CopyFrom(p)
    for name, value in values.items():
        setattr(merged, name, value)
    return merged


def _check_chars(num_chars: int, max_model_len: int) -> None:
    # Cheap bound before tokenizing: no real prompt needs more than 64 characters per token of context.
    limit = MAX_CHARS_PER_TOKEN * max_model_len
    if num_chars > limit:
        raise InvalidRequestError(f"prompt has {num_chars} characters; at most {limit} fit the model's context")


def check_sampling_params(p: common_pb2.SamplingParams, num_prompt_tokens: int, model_config: ModelConfig,
                          default_max_tokens: int) -> common_pb2.SamplingParams:
    """Validate a request's prompt length and sampling parameters; return the parameters the tiers get: the
    checkpoint's generation_config.json sampling defaults (model_config.generation_defaults) in the fields the
    request left unset (not for beam search, which is greedy), and max_tokens resolved: defaulted to
    default_max_tokens and clamped to the context left after the prompt (the one place the gateway decides it;
    min_tokens is checked against the max_tokens asked for). Runs once per request (GatewayPipeline.validate).
    InvalidRequestError naming the field on bad input."""
    if p.beam_width > 1:
        check_beam_params(p)
    else:
        if not 1 <= (n := p.n if p.HasField("n") else 1) <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {n}")
        unset = {name: value for name, value in model_config.generation_defaults if not p.HasField(name)}
        if unset:
            p = _merged(p, unset)
    max_len = model_config.max_model_len
    if num_prompt_tokens >= max_len:
        raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens; the model's context is {max_len} tokens")
    check_counts(p)
    max_tokens = p.max_tokens if p.HasField("max_tokens") else default_max_tokens
    params = sampling_params_from_proto(p, max_tokens=max_tokens)  # (ranges: SamplingParams' own checks)
    if params.min_tokens > params.max_tokens:
        raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
    check_token_ids("stop_token_ids", params.stop_token_ids, model_config.vocab_size)
    check_token_ids("logit_bias token ids", (t for t, _ in params.logit_bias), model_config.vocab_size)
    if any(not s for s in p.stop):
        raise InvalidRequestError("stop strings must be non-empty")
    if params.structured_output is not None:
        check_structured_output_size(p.structured_output)
        check_grammar(params.structured_output)
    proto_params = common_pb2.SamplingParams()
    proto_params.CopyFrom(p)
    proto_params.max_tokens = min(max_tokens, max_len - num_prompt_tokens)
    return proto_params
