"""What the attention kernels and their references agree on beyond softmax(q k^T * scale) v: which keys a query
sees (causal, optionally within a sliding window) and the soft-capping of scores. Torch only, so the CPU paths of
shared/attention.py use them without importing triton."""
from __future__ import annotations

import torch


def causal_mask(q_pos: torch.Tensor, num_keys: int, window: int | None = None) -> torch.Tensor:
    """[len(q_pos), num_keys] bool: key k is visible from the query at position p when k <= p and, with a sliding
    window, p - k < window (HF masking_utils' sliding_window_overlay: the last `window` positions, p's own
    included). q_pos: int64 positions, on the device the mask is wanted on."""
    keys = torch.arange(num_keys, device=q_pos.device)[None, :]
    visible = keys <= q_pos[:, None]
    return visible if window is None else visible & (keys > q_pos[:, None] - window)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap) (Gemma 2's attention-logit and final-logit soft-capping, Gemma Team 2024),
    or scores when softcap is None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap
