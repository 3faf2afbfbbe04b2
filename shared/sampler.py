"""Token sampling: penalties and min_tokens (process_logits), greedy, temperature, min-p (Nguyen et al. 2024),
top-k, top-p (Holtzman et al. 2019), per-request seed; and the logprobs of sampled tokens.

The order is vLLM's: penalties and min_tokens on the raw logits, then temperature, min-p, top-k, top-p.
"""
from __future__ import annotations

import torch
import xxhash

from tandem.kernels import cpu_layer_ops
from tandem.shared.request import Request, SamplingParams, TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits [n, vocab] fp32 raw, token_ids the n tokens chosen at those rows -> their TokenLogprobs."""
    logprobs = logits[: len(token_ids)].log_softmax(-1)
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    top_values, top_ids = logprobs.topk(num_top, -1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprobs(t, lp, rank, tuple(zip(ids, values)))
            for t, lp, rank, ids, values in zip(token_ids, chosen.tolist(), ranks.tolist(), top_ids.tolist(),
                                                top_values.tolist())]  # fmt: skip


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[int], output_token_ids: list[int],
                    params: SamplingParams) -> None:
    """In place on logits [vocab] fp32: the repetition penalty over prompt and output tokens (CTRL, Keskar et al.
    2019, as HF's RepetitionPenaltyLogitsProcessor: a positive logit is divided by it, a negative one multiplied),
    then OpenAI's frequency and presence penalties over output tokens (logit -= frequency_penalty * count +
    presence_penalty * (count > 0))."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(prompt_token_ids + output_token_ids, device=logits.device).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_token_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_token_ids, device=logits.device), minlength=logits.numel())
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def process_logits(logits: torch.Tensor, requests: list[Request], positions: list[int]) -> torch.Tensor:
    """logits [num_rows, vocab] fp32 raw -> the logits the sampler draws from: row i (requests[i], sampling the
    token at positions[i]) gets its logit_bias, its penalties (apply_penalties, over the tokens before that
    position), and while
    fewer than min_tokens tokens precede it in the output, EOS (unless ignore_eos) and stop_token_ids are masked
    out. Returns logits itself when no row has any of these, else a processed copy."""
    out = logits
    for i, request in enumerate(requests):
        params = request.sampling_params
        num_output = positions[i] - request.num_prompt_tokens
        mask_stops = num_output < params.min_tokens
        if not (params.has_penalties or mask_stops or params.logit_bias):
            continue
        if out is logits:
            out = logits.clone()
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            out[i, list(ids)] += torch.tensor(biases, dtype=out.dtype, device=out.device)
        if params.has_penalties:
            apply_penalties(out[i], request.prompt_token_ids, request.output_token_ids[:num_output], params)
        if mask_stops:
            stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
            out[i, stops] = float("-inf")
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [vocab] outside the top_k largest and outside the smallest set whose mass reaches top_p."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] fp32 (after process_logits) -> the distribution a sampled (not greedy) request draws from:
    [vocab] fp32, after temperature, min-p (tokens less likely than min_p times the top token's probability are
    dropped), top-k and top-p."""
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return apply_top_k_top_p(logits, params.top_k, params.top_p).softmax(-1)


def draw(probs: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token from probs [vocab] fp32 for the token at position of a request's sequence. Seeded: the
    exponential race argmax(probs / E) (E ~ Exp(1) iid per token id: id i wins with probability probs[i], as in
    vLLM's sampler) with E drawn from a generator seeded by (seed, position) alone, so the draw depends on
    nothing else in the batch; and a draft distribution raced with the same E yields the same token wherever it
    agrees closely with probs (the coupling seeded speculative decoding relies on,
    spec_decode/rejection_sampler.py). Unseeded: torch.multinomial."""
    if params.seed is None:
        return int(torch.multinomial(probs, 1))
    # NOTE: the CPU generator keeps 32 bits of its seed, so all 64 of (seed, position) are hashed into them.
    key = xxhash.xxh32_intdigest(f"{params.seed}:{position}".encode())
    generator = torch.Generator(device=probs.device).manual_seed(key)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def argmax(logits: torch.Tensor) -> list[int]:
    """logits [num_rows, vocab] -> each row's argmax (the first of equal largest values): fp32 on the CPU, the C++
    kernel (kernels/cpu_layer_ops.argmax_rows: 0.07 ms against torch's 1.3 for 32 rows of a 49,152-token
    vocabulary); else torch.argmax."""
    if logits.dtype == torch.float32 and cpu_layer_ops.supports(logits):
        return cpu_layer_ops.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


def sample(logits: torch.Tensor, requests: list[Request], positions: list[int] | None = None,
           skip=()) -> list[int]:
    """logits [num_rows, vocab] fp32 -> one token id per row; row i belongs to requests[i] and samples the token
    at positions[i] of its sequence (default: request.num_tokens, the next one; a verified speculative step has
    several rows per request, at consecutive positions).

    A seeded request's draw depends only on (seed, position of the token) (draw), so the same seed gives the
    same text whatever the batch and whether or not it speculates, and the prefill and decode tiers agree.
    Rows of requests whose id is in skip get the argmax only (a caller that samples them itself).
    """
    token_ids = argmax(logits)
    for i, request in enumerate(requests):
        params = request.sampling_params
        if params.greedy or request.request_id in skip:
            continue
        position = request.num_tokens if positions is None else positions[i]
        token_ids[i] = draw(sampling_probs(logits[i], params), params, position)
    return token_ids
