"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2019), per-request seed."""
from __future__ import annotations

import torch
import xxhash

from shared.request import Request, SamplingParams


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
    """logits [vocab] fp32 -> the distribution a sampled (not greedy) request draws from: [vocab] fp32, after
    temperature, top-k and top-p."""
    return apply_top_k_top_p(logits / params.temperature, params.top_k, params.top_p).softmax(-1)


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


def sample(logits: torch.Tensor, requests: list[Request], positions: list[int] | None = None,
           skip=()) -> list[int]:
    """logits [num_rows, vocab] fp32 -> one token id per row; row i belongs to requests[i] and samples the token
    at positions[i] of its sequence (default: request.num_tokens, the next one; a verified speculative step has
    several rows per request, at consecutive positions).

    A seeded request's draw depends only on (seed, position of the token) (draw), so the same seed gives the
    same text whatever the batch and whether or not it speculates, and the prefill and decode tiers agree.
    Rows of requests whose id is in skip get the argmax only (a caller that samples them itself).
    """
    token_ids = logits.argmax(-1).tolist()
    for i, request in enumerate(requests):
        params = request.sampling_params
        if params.greedy or request.request_id in skip:
            continue
        position = request.num_tokens if positions is None else positions[i]
        token_ids[i] = draw(sampling_probs(logits[i], params), params, position)
    return token_ids
