"""The acceptance rule for point-mass drafts (n-gram proposals), lossless for greedy and sampled requests.

The target's token at each verified position is drawn exactly as without speculation (argmax, or the seeded
draw of shared/sampler.py at that position); drafts are accepted while they equal it, and the first target token
that differs (or the one after the last draft, the bonus) ends the run. For a draft that puts all its mass on one
token d this is the rejection rule of Leviathan et al. 2023 (Algorithm 1): d is accepted with probability
min(1, p(d) / 1) = p(d), and on rejection the token comes from norm(max(p - q, 0)), which is p without d. So the
output has exactly the target's distribution, and a seeded request gives the same tokens as without
speculation, whatever its batch.
"""
from __future__ import annotations


def accept_draft_tokens(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The tokens a verified step emits: the drafts that equal the target's tokens, then the target's token at
    the first mismatch or after the last draft. target_token_ids: len(draft_token_ids) + 1 tokens, the target's
    choice at each verified position; a shorter list (a sampler that stopped at the first mismatch) is fine as
    long as it reaches that mismatch."""
    for i, draft in enumerate(draft_token_ids):
        if target_token_ids[i] != draft:
            return target_token_ids[: i + 1]
    return target_token_ids[: len(draft_token_ids) + 1]
