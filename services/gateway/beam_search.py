"""Beam search (greedy, deterministic), scored exactly as HF transformers' GenerationMixin._beam_search with its
defaults (early_stopping=False, length_penalty as given), so a cluster returns the beams HF generate(num_beams=...)
returns on the same weights.

The gateway drives it one token at a time, as vLLM's beam search does over its engine: each step asks the decode
for every running beam's next-token logprobs (the top num_candidates of the raw log_softmax, one request per
beam: prompt + beam, max_tokens 1, in one batch), and BeamSearch.step picks the next beams. Beams share their
blocks copy-on-write through the decode's prefix cache (the PagedAttention paper's sharing): every full block is
computed once and referenced by each beam that extends it, and a beam's last, partial block is a copy of its
parent's (shared/kv_cache_manager.py, hits inside a block), so each beam computes one token per step. The cost
of this design is a gateway-decode round trip per beam and step (a gRPC call; not measured apart).

HF's rule, per step (batch of one prompt; B beams; K = max(2, 1 + number of EOS ids) * B candidates):
1. Every running beam's score plus each token's logprob, in fp32; the K best (beam, token) pairs overall.
2. A candidate "hits" when its token is an EOS or it reaches max_tokens. Hits among the first B candidates
   become finished hypotheses with score / generated_length ** length_penalty (unless the early-stop heuristic
   already holds); the B best finished are kept.
3. The B best candidates that do not hit are the next running beams.
4. The early-stop heuristic (early_stopping=False): once B hypotheses are finished and the best running score,
   normalized by the current length, is not above the worst finished one, no more hypotheses are taken and the
   search ends. It also ends when every candidate hits.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

import torch

from tandem.services.client import finish_name
from tandem.services.gateway.detokenizer import TextStream
from tandem.services.gateway.request import GatewayRequest
from tandem.services.gateway.router import SharedPrompt
from tandem.shared.errors import InvalidRequestError
from tandem.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from tandem.services.gateway.pipeline import GatewayPipeline

NEG = -1.0e9  # HF's stand-in for "impossible"
MAX_BEAM_WIDTH = 8  # 2 * width candidates per beam must fit MAX_LOGPROBS (shared/request.py)
MAX_LENGTH_PENALTY = 10.0  # (length ** penalty stays inside a float64 for any context length)


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]
    score: float  # fp32: the sum of logprobs over generated_length ** length_penalty
    finished_by_eos: bool


class BeamSearch:
    """The state of one prompt's beam search. eos_token_ids: the model's EOS ids; max_tokens: generated tokens
    at most (HF's max_new_tokens)."""

    def __init__(self, beam_width: int, eos_token_ids: tuple[int, ...], max_tokens: int, length_penalty: float = 1.0):
        self.beam_width, self.eos_token_ids = beam_width, set(eos_token_ids)
        self.max_tokens, self.length_penalty = max_tokens, length_penalty
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * beam_width
        self.running: list[list[int]] = [[]]  # HF's other initial beams score NEG: they are never chosen
        self.running_scores = torch.zeros(1)  # fp32
        self.finished: list[Hypothesis] = []  # best first, at most beam_width
        self.improvement_possible = True
        self.done = False

    def step(self, top_logprobs: list[list[tuple[int, float]]]) -> None:
        """Advance by one token. top_logprobs[b]: running beam b's num_candidates most likely next tokens as
        (token id, raw logprob), most likely first."""
        flat = [(b, token, logprob) for b, top in enumerate(top_logprobs) for token, logprob in top]
        scores = self.running_scores[torch.tensor([b for b, _, _ in flat])] + torch.tensor([lp for *_, lp in flat])
        order = sorted(range(len(flat)), key=lambda i: (-float(scores[i]), flat[i][0], flat[i][1]))
        top = order[: self.num_candidates]
        length = len(self.running[0]) + 1
        candidates = [(self.running[flat[i][0]] + [flat[i][1]], scores[i]) for i in top]
        hits = [tokens[-1] in self.eos_token_ids or length >= self.max_tokens for tokens, _ in candidates]
        if self.improvement_possible:
            normalized = [score / (length**self.length_penalty) for _, score in candidates[: self.beam_width]]
            new = [Hypothesis(tokens, float(s), tokens[-1] in self.eos_token_ids)
                   for (tokens, _), s, hit in zip(candidates, normalized, hits) if hit]  # fmt: skip
            # (a stable sort keeps earlier hypotheses first among equal scores, as HF's topk over [old, new])
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.beam_width]
        running = sorted(range(len(candidates)), key=lambda i: (hits[i], -float(candidates[i][1]), i))
        running = running[: self.beam_width]
        self.running = [candidates[i][0] for i in running]
        self.running_scores = torch.stack([candidates[i][1] + (NEG if hits[i] else 0.0) for i in running])
        if len(self.finished) == self.beam_width:
            best_possible = self.running_scores[0] / (length**self.length_penalty)
            self.improvement_possible &= bool(best_possible > torch.tensor(self.finished[-1].score))
        self.done = not self.improvement_possible or all(hits)

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (after done)."""
        return self.finished[:n]


# SamplingParams fields that mean something with beam search; any other set field is refused
BEAM_FIELDS = {"max_tokens", "beam_width", "length_penalty", "n", "temperature", "speculative"}


def check_beam_params(p: common_pb2.SamplingParams) -> None:
    """InvalidRequestError unless p is a valid beam search: beam_width in [2, MAX_BEAM_WIDTH], n <= beam_width,
    temperature 0 if set, and no sampling or stopping field beam search does not define (penalties, stop
    strings, logprobs, structured output, ...)."""
    if not 2 <= p.beam_width <= MAX_BEAM_WIDTH:
        raise InvalidRequestError(f"beam_width must be in [2, {MAX_BEAM_WIDTH}] for beam search (0 or 1: none), "
                                  f"got {p.beam_width}")  # fmt: skip
    if p.HasField("n") and not 1 <= p.n <= p.beam_width:
        raise InvalidRequestError(f"n must be in [1, beam_width = {p.beam_width}] with beam search, got {p.n}")
    if p.HasField("temperature") and p.temperature != 0:
        raise InvalidRequestError("temperature must be 0 (or unset) with beam search, which is deterministic")
    if p.HasField("length_penalty") and not -MAX_LENGTH_PENALTY <= p.length_penalty <= MAX_LENGTH_PENALTY:
        raise InvalidRequestError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")
    extra = sorted(f.name for f, _ in p.ListFields() if f.name not in BEAM_FIELDS)
    if extra:  # (the message starts with the field: the HTTP API's error names it as the param)
        raise InvalidRequestError(f"{', '.join(extra)}: not defined for beam search (beam_width > 1)")


async def run_beam_search(pipeline: GatewayPipeline,
                          request: GatewayRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Beam search for one validated request's prompt through the cluster (pipeline: the gateway's). Step 0 places
    the prompt (prefill -> decode); each later step sends every running beam to that decode (compute_prompt: its
    prefix cache holds the beams' common blocks), each beam one request of its own derived from request
    (GatewayRequest.replace). Yields, for each of the n best beams (index i, best first), one message with its
    text and tokens and one with finish_reason (STOP when it ended with EOS, else LENGTH), usage and timings.
    The parameters were checked by validation.check_sampling_params (which runs check_beam_params)."""
    t0 = time.perf_counter() if request.arrival_time is None else request.arrival_time
    p, prompt_ids = request.sampling_params, request.prompt_token_ids
    search = BeamSearch(p.beam_width, pipeline.model_config.eos_token_ids, p.max_tokens,
                        p.length_penalty if p.HasField("length_penalty") else 1.0)  # fmt: skip
    step_params = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                            logprobs=search.num_candidates)  # fmt: skip
    placed = SharedPrompt()  # (its decode, once step 0 placed the prompt)
    step = 0

    async def next_tokens(b: int, tokens: list[int]) -> list[tuple[int, float]]:
        top = None
        beam = request.replace(request_id=f"{request.request_id}-beam{step}-{b}", prompt_token_ids=prompt_ids + tokens,
                               sampling_params=step_params, arrival_time=None, shared_prompt=placed,
                               index=int(step > 0), record_metrics=False)  # fmt: skip
        async for msg in pipeline.relay(beam):
            top = msg.logprobs[0].top if msg.logprobs else top
        return [(t.token_id, t.logprob) for t in top]

    while not search.done:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(next_tokens(b, tokens)) for b, tokens in enumerate(search.running)]
        except BaseExceptionGroup as e:  # the first beam's error is the request's (a deadline, a failed decode)
            raise e.exceptions[0] from None
        search.step([task.result() for task in tasks])
        step += 1
    e2e_ms = (time.perf_counter() - t0) * 1000
    for i, hypothesis in enumerate(search.best(request.n)):
        text = TextStream(pipeline.tokenizer, (), False)
        delta = text.push(hypothesis.token_ids)
        yield gateway_pb2.GenerateResponse(request_id=request.request_id, index=i, text=delta + text.finish(),
                                           token_ids=hypothesis.token_ids)  # fmt: skip
        reason = common_pb2.FINISH_REASON_STOP if hypothesis.finished_by_eos else common_pb2.FINISH_REASON_LENGTH
        pipeline.metrics.observe_finished(finish_name(reason), len(prompt_ids), 0, len(hypothesis.token_ids),
                                          e2e_ms / 1000, e2e_ms / 1000)  # fmt: skip
        yield gateway_pb2.GenerateResponse(
            request_id=request.request_id, index=i, finish_reason=reason,
            usage=gateway_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(hypothesis.token_ids)),
            timings=gateway_pb2.Timings(ttft_ms=e2e_ms, e2e_ms=e2e_ms))  # fmt: skip
