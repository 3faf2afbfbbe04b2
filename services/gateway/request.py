"""The gateway's request record: every per-request value one request carries through the pipeline
(services/gateway/pipeline.py), whichever public API it came from. The gRPC servicer (server.py) and the HTTP API
(openai_serving.py) build one from their messages; fan-out (n completions, beam search's steps) derives one per
completion or step with replace()."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Callable

from tandem.services.gateway.router import SharedPrompt
from tandem.v1 import common_pb2


def no_deadline() -> float | None:
    """The deadline clock of a request without a deadline: no seconds are counted."""
    return None


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """One request, or one completion or beam-search step of it, as the gateway serves it (vLLM's
    EngineCoreRequest, plus the gateway's own deadline and placement hints)."""

    request_id: str  # the completion's id: the request's own, then request_id-1, -2, ... (n > 1)
    prompt_token_ids: list[int]  # after templating and tokenization
    # Once validated (GatewayPipeline.validate): the parameters the tiers get, max_tokens resolved (defaulted and
    # clamped to the context). Never mutated: fan-out copies it.
    sampling_params: common_pb2.SamplingParams
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    priority: int = 0  # the engines' scheduling priority, lower first
    session_id: str | None = None  # session affinity's routing key (router.py); None: the cost model places it
    lora_name: str | None = None  # the LoRA adapter it runs with (GenerateRequest.lora_name); None: the base model
    time_remaining: Callable[[], float | None] = no_deadline  # -> seconds before the client's deadline, or None
    arrival_time: float | None = None  # perf_counter seconds TTFT and E2E count from; None: when it is placed
    # Placement hint: the completions (or beam-search steps) that follow one placed prompt share it; index 0
    # places the prompt, index > 0 waits for it and goes to the decode holding it (router.SharedPrompt).
    shared_prompt: SharedPrompt | None = None
    index: int = 0  # completion index among the n of one prompt (the stream's GenerateResponse.index)
    record_metrics: bool = True  # count it in the gateway's request metrics (beam search counts beams, not steps)
    # A migrated request (its decode failed mid-stream): the tokens generated so far, which the engines take as
    # output after the prompt (DecodeRequest.output_token_ids)
    output_token_ids: tuple[int, ...] = ()
    # How its answer is read (tool_parsers.py, reasoning.py; None: as text): the last message carries the calls
    # and the reasoning found in the whole text
    tool_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the engines compute before its next token: the prompt and, migrated, the output so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output so far (what routing looks up in the prefix index)."""
        return self.prompt_token_ids + list(self.output_token_ids) if self.output_token_ids else self.prompt_token_ids

    @property
    def n(self) -> int:
        """Completions asked for (SamplingParams.n, default 1)."""
        return self.sampling_params.n if self.sampling_params.HasField("n") else 1

    @property
    def follows_shared_prompt(self) -> bool:
        """Whether it waits for another request to place its prompt (and then goes to that one's decode)."""
        return self.shared_prompt is not None and self.index > 0

    def replace(self, **changes) -> GatewayRequest:
        """A copy with changes (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)
