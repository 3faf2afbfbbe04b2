"""The acceptance rules of speculative decoding, lossless for greedy and sampled requests.

Point-mass drafts (n-gram proposals, and any draft of a greedy request), accept_draft_tokens: the target's
token at each verified position is drawn exactly as without speculation (argmax, or the seeded draw of
shared/sampler.py at that position); drafts are accepted while they equal it, and the first target token that
differs (or the one after the last draft, the bonus) ends the run. For a draft that puts all its mass on one
token d this is the rejection rule of Leviathan et al. 2023 (Algorithm 1): d is accepted with probability
min(1, p(d) / 1) = p(d), and on rejection the token comes from norm(max(p - q, 0)), which is p without d. So the
output has exactly the target's distribution, and a seeded request gives the same tokens as without
speculation, whatever its batch.

Drafts drawn from a draft model's distribution q:
- an unseeded request, rejection_sample: the same rule with q itself (Leviathan et al. 2023, Algorithm 1; Chen
  et al. 2023, Algorithm 2): the draft d at a position is accepted with probability min(1, p(d) / q(d)); on the
  first rejection the token is drawn from norm(max(p - q, 0)) and the run ends; after k accepted drafts the
  bonus token is drawn from p. Its output depends on where drafts were placed, and that depends on the batch
  (adaptive draft lengths, the token budget, preemption): fine without a seed.
- a seeded request: its drafts are drawn with the noise of the target's own seeded draw at each position
  (sampler.draw, an exponential race), which makes them point masses the first rule verifies. The output is
  then the target's seeded sample itself, token for token as without speculation, whatever the batch; a draft
  is accepted when the race picks the same token under q as under p (at least (1 - TV) / (1 + TV) of the time,
  TV the total variation distance of p and q; the optimal rule's min(p, q) mass is 1 - TV).
"""
from __future__ import annotations

import torch

from tandem.shared.request import Request
from tandem.shared.sampler import sampling_probs


def accept_draft_tokens(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The tokens a verified step emits: the drafts that equal the target's tokens, then the target's token at
    the first mismatch or after the last draft. target_token_ids: len(draft_token_ids) + 1 tokens, the target's
    choice at each verified position; a shorter list (a sampler that stopped at the first mismatch) is fine as
    long as it reaches that mismatch."""
    for i, draft in enumerate(draft_token_ids):
        if target_token_ids[i] != draft:
            return target_token_ids[: i + 1]
    return target_token_ids[: len(draft_token_ids) + 1]


def rejection_sample(request: Request, target_logits: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor) -> list[int]:
    """The tokens a verified step emits for an unseeded sampled request whose k drafts were drawn from
    draft_probs.

    target_logits [k + 1, vocab] fp32: the target's logits at the step's k + 1 verified positions;
    draft_probs [k, vocab] fp32: the distribution each draft was drawn from, after the request's temperature /
    top-k / top-p. Returns the accepted drafts and one more token (1 to k + 1)."""
    params = request.sampling_params
    for i, draft in enumerate(draft_token_ids):
        p, q = sampling_probs(target_logits[i], params), draft_probs[i]
        if float(torch.rand(())) * float(q[draft]) < float(p[draft]):  # u < p(d) / q(d); q(d) > 0: d came from q
            continue
        residual = (p - q).clamp_min(0)
        if float(residual.sum()) <= 0:  # (p <= q everywhere means p == q: no rejection happens in exact math)
            residual = p
        return draft_token_ids[:i] + [int(torch.multinomial(residual, 1))]
    bonus = sampling_probs(target_logits[len(draft_token_ids)], params)
    return draft_token_ids + [int(torch.multinomial(bonus, 1))]
