"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2019), per-request seed."""
from __future__ import annotations

import torch
import xxhash

from shared.request import Request


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


def sample(logits: torch.Tensor, requests: list[Request], positions: list[int] | None = None) -> list[int]:
    """logits [num_rows, vocab] fp32 -> one token id per row; row i belongs to requests[i] and samples the token
    at positions[i] of its sequence (default: request.num_tokens, the next one; a verified speculative step has
    several rows per request, at consecutive positions).

    A request with a seed draws from a generator seeded by (seed, position of the token), so the same seed
    gives the same text whatever the batch and whether or not it speculates, and the prefill and decode tiers
    agree.
    """
    token_ids = logits.argmax(-1).tolist()
    for i, request in enumerate(requests):
        params = request.sampling_params
        if params.greedy:
            continue
        row = apply_top_k_top_p(logits[i] / params.temperature, params.top_k, params.top_p)
        probs = row.softmax(-1)
        generator = None
        if params.seed is not None:
            # NOTE: the CPU generator keeps 32 bits of its seed, so all 64 of (seed, position) are hashed into them.
            position = request.num_tokens if positions is None else positions[i]
            seed = xxhash.xxh32_intdigest(f"{params.seed}:{position}".encode())
            generator = torch.Generator(device=logits.device).manual_seed(seed)
        token_ids[i] = int(torch.multinomial(probs, 1, generator=generator))
    return token_ids
