"""Size limits on a request's fields (README "Limits"), enforced by GatewayServicer.tokenize and check_params
(services/gateway/server.py) for both public APIs. A prompt's own limits follow from the model's context: at most
max_model_len - 1 tokens, and at most MAX_CHARS_PER_TOKEN * max_model_len characters before it is tokenized."""
from __future__ import annotations

from shared.errors import InvalidRequestError
from tandem.v1 import common_pb2

MAX_N = 16  # most completions of one prompt per request
MAX_CHARS_PER_TOKEN = 64
MAX_STOP = 32  # stop strings per request (OpenAI allows 4; vLLM sets no limit)
MAX_STOP_CHARS = 256  # characters per stop string (the text stream holds back this much at most)
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_STRUCTURED_OUTPUT_CHARS = 256 * 1024  # a json_schema, regex or grammar's text; choice: all choices together
MAX_CHOICES = 1024  # structured_output choice entries
MAX_ID_CHARS = 256  # request_id and cache_salt


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
