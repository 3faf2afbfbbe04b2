"""Request state shared by both tiers (vLLM v1 vocabulary)."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.shared.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20  # most top logprobs a request may ask for per token (vLLM's default max_logprobs, OpenAI's cap)


def check_token_ids(name: str, token_ids, vocab_size: int) -> None:
    """InvalidRequestError "<name> must be in [0, vocab_size)" unless every token id is in the model's vocabulary.
    The one range check of token ids from outside (a token-id prompt, stop_token_ids, logit_bias): the gateway runs
    it on the public APIs' requests, the engine on what its own RPCs receive."""
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError(f"{name} must be in [0, {vocab_size})")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability under the model's raw distribution (log_softmax of its logits before
    penalties, temperature or filters: vLLM's default logprobs mode), its rank there (1 = the most likely), and
    the top most likely tokens as (token id, logprob), most likely first (as many as the request asked for)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class Grammar(Protocol):
    """A constrained request's grammar state (structured_output.GrammarMatcher is the implementation)."""

    def accept(self, token_id: int) -> bool: ...

    def num_valid(self, token_ids: list[int]) -> int: ...

    def fill_bitmask(self, bitmask: torch.Tensor, draft_token_ids: list[int]) -> None: ...


class RequestStatus(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"  # decode tier: blocks reserved, prompt KV still arriving from prefill
    LOADING_KV = "loading_kv"  # waiting: its cached prefix is being loaded from a tier below the pool
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a structured output that is complete
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client cancel, error or shutdown


@dataclass(frozen=True)
class StructuredOutputParams:
    """A constraint on the generated text, enforced token by token (shared/structured_output.py): exactly one of
    json (a JSON schema, as JSON text), json_object (any JSON object), regex, choice (one of these strings) or
    grammar (a Lark grammar in llguidance's dialect). The names are vLLM's StructuredOutputsParams'.
    Raises InvalidRequestError unless exactly one is set, json is a JSON object and choices are non-empty."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(f"structured_output must set exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {kinds or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise InvalidRequestError(f"structured_output.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("structured_output.json must be a JSON schema object")
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequestError("structured_output.choice must be a non-empty list of non-empty strings")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 disable those filters.

    Penalties (shared/sampler.py apply_penalties): presence_penalty and frequency_penalty in [-2, 2] are
    OpenAI's (subtracted from the logit of every token already generated: once, and once per occurrence);
    repetition_penalty > 0 is CTRL's (Keskar et al. 2019; HF's RepetitionPenaltyLogitsProcessor) over prompt and
    output, 1 disables it. min_tokens: EOS and stop_token_ids cannot be sampled before that many tokens.
    logit_bias: OpenAI's, added to the raw logits before anything else.

    These defaults are the server's (the public proto documents them; a test checks that it agrees).
    Raises InvalidRequestError (INVALID_ARGUMENT) on out-of-range values.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the k most likely (0..MAX_LOGPROBS)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (computed on the prefill)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the raw logits
    speculative: bool = True  # False: never speculate for this request, whatever the engine's setting
    structured_output: StructuredOutputParams | None = None  # a constraint on the text (None: unconstrained)

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be positive, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise InvalidRequestError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):  # (also rejects NaN)
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # as vLLM: below this, sampling is argmax in all but name

    @property
    def has_penalties(self) -> bool:
        """True when a token's logits depend on the tokens generated before it (such a request never
        speculates: its drafts would need a penalty state per verified position)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request (an embedding; vLLM's PoolingParams): its prompt is computed like a prefill, no token is
    sampled and no KV leaves the engine; its output is the final hidden state (after the model's final norm) at the
    prompt's last token (last-token pooling, as decoder embedding models such as e5-mistral and Qwen3-Embedding),
    L2-normalized when normalize is set."""

    normalize: bool = True


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. Tokens = prompt + output; num_computed_tokens of them have KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    max_model_len: int | None = None
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    priority: int = 0  # lower is scheduled first (vLLM's priority policy); equal priorities: first come first
    arrival_seq: int = 0  # the scheduler's admission counter: the tie-break among equal priorities
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first admitted
    # of those, tokens whose KV was loaded into the pool from a tier below it, by tier ("host", "disk")
    num_tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    # leading blocks whose KV does not travel: the receiving decode holds them, or (every layer sliding) they lie
    # wholly before its first query's window. Decode tier: set by its reserve; prefill tier: from the request.
    kv_skip_blocks: int = 0
    # prefill tier at tensor parallelism: where its KV goes (shared/parallel/messages.py KVDestination), for the
    # other ranks, which ship their own heads (None: a single-rank prefill, or no transfer)
    kv_destination: object | None = None
    # with sampling_params.prompt_logprobs: prompt tokens 1, 2, ... as computed so far (TokenLogprobs)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    grammar: Grammar | None = None  # with structured_output: the grammar's state after the output so far
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens proposed for the next step
    num_draft_tokens: int = 0  # drafts verified so far, and of those accepted (speculative decoding)
    num_accepted_tokens: int = 0
    spec_window: int | None = None  # its draft length now, with adaptive speculation (None: not started)
    num_draft_computed_tokens: int = 0  # tokens with KV in a draft model's own pool (a prefix of the sequence)
    # longrope models only (None otherwise): whether its KV takes the long factors, decided when its computation
    # starts (its tokens outnumber the original context); a False request that grows past it is recomputed
    rope_long: bool | None = None
    arrival_time: float = 0.0  # time.monotonic() when the engine admitted it (decode: when its KV was complete)
    queue_time_s: float | None = None  # seconds from admission to its first step (None: not scheduled yet)
    pooling_params: PoolingParams | None = None  # a pooling request (an embedding): pooled, never sampled
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model; docs/lora.md)
    # set by the engine at admission: that adapter's identity, name:digest of its files (LoRAAdapter.key), which
    # its first block hashes (requests of different adapters never share a block)
    lora_key: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole sequence (hot path)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> FinishReason | None:
        """Append a sampled token and return why the request stops now, or None to continue. With a grammar, the
        grammar consumes it, and a grammar that is complete stops the request (an EOS is not needed)."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        if self.grammar is not None and self.grammar.accept(token_id):
            return FinishReason.STOP
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return FinishReason.STOP
        if len(self.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
