"""Draft-model proposals (Leviathan et al. 2023; Chen et al. 2023): a smaller model with the target's
tokenizer runs k times per step over its own paged KV and proposes k tokens; a sampled request's drafts are
drawn from the draft's distribution q (after the request's temperature / top-k / top-p), which the rejection
rule then needs (rejection_sampler.rejection_sample); a seeded one's with the noise of the target's own draw at
that position (sampler.draw), so that they verify as point masses (rejection_sampler).

The draft's KV pool has the target's block ids: it is paged by the target's block tables, so the blocks the
scheduler allocates for a request (its drafts' slots included) hold its draft KV too, and they return to the
pool with the target's. request.num_draft_computed_tokens counts the tokens whose draft KV is valid: the first
speculative step of a request computes its prompt's draft KV here, on the decode tier (nothing extra crosses
the KV transfer); after a step, only the accepted tokens' draft KV stays valid.

Early exit (LayerSkip, Elhoushi et al. 2024; "self-speculative decoding", Zhang et al. 2024): the draft is the
target's own first num_layers layers with its final norm and LM head. Those layers' KV is the target's, for
every computed token, so the draft needs no pool and no catch-up; it writes its drafts' KV for those layers
into the target's slots, which the verifying forward then overwrites with the same values. With LoRA, the early
exit's layers run with each request's adapter (its slot, as the target's forward); a separate draft model runs
without adapters (its drafts are verified by the target with the adapter, so they stay lossless).
"""
from __future__ import annotations

import torch

from tandem.shared.model_runner import run_model
from tandem.shared.request import Request
from tandem.shared.sampler import argmax, draw, sampling_probs


class DraftModelProposer:
    """model: a LlamaForCausalLM; kv_caches: its pool [num_layers, 2, num_blocks, block_size, num_kv_heads,
    row] with the target's num_blocks, block_size and KV dtype (for early exit, the target's own pool); kv_quant:
    that pool's quantized format (CacheConfig.kv_quant; None: float KV); num_layers: run only the first num_layers
    layers (early exit), sharing the target's KV."""

    def __init__(self, model, kv_caches: torch.Tensor, block_size: int, num_layers: int | None = None,
                 kv_quant: str | None = None):
        self.model, self.kv_caches, self.block_size, self.num_layers = model, kv_caches, block_size, num_layers
        self.kv_quant = kv_quant
        self.device = kv_caches.device

    def propose(self, requests: list[Request], num_drafts: list[int], block_tables: dict[str, list[int]],
                lora_slots: dict[str, int] | None = None) -> list[tuple[list[int], torch.Tensor | None]]:
        """Draft num_drafts[i] tokens for each request (decoding: num_computed_tokens == num_tokens - 1, and its
        block table covers num_tokens + num_drafts[i] - 1 slots). Runs max(num_drafts) forwards of the draft over
        the batch. Returns per request the draft token ids and, for an unseeded sampled request, the
        probabilities they were drawn from [num_drafts[i], vocab] fp32 (None for a greedy one, whose drafts are
        the draft's argmax, and for a seeded one). lora_slots: adapter key -> slot (SchedulerOutput.lora_slots),
        for a draft that runs the target's adapters (early exit); None: none."""
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for j in range(max(num_drafts)):
            rows = [i for i, k in enumerate(num_drafts) if k > j]
            seqs = []
            for i in rows:
                r = requests[i]
                last = r.num_tokens - 1  # the last token: the target has no KV for it yet
                if j == 0:  # the tokens the draft has no KV for yet, up to the last one
                    start = last if self.num_layers is not None else min(r.num_draft_computed_tokens, last)
                    seqs.append((r.token_ids(start, last + 1), start, block_tables[r.request_id], 1))
                else:
                    seqs.append(([drafts[i][-1]], last + j, block_tables[r.request_id], 1))
            slots = [lora_slots.get(requests[i].lora_key) for i in rows] if lora_slots else None
            logits = run_model(self.model, self.kv_caches, seqs, self.block_size, self.device, self.num_layers,
                               [bool(requests[i].rope_long) for i in rows], kv_quant=self.kv_quant, lora_slots=slots)
            greedy = argmax(logits)
            for row, i in enumerate(rows):
                r = requests[i]
                params = r.sampling_params
                if params.greedy:
                    drafts[i].append(greedy[row])
                    continue
                q = sampling_probs(logits[row], params)
                drafts[i].append(draw(q, params, r.num_tokens + j))
                if params.seed is None:  # (a seeded draft is a point mass, coupled to the target's draw)
                    probs[i].append(q)
        for r, k in zip(requests, num_drafts):
            r.num_draft_computed_tokens = r.num_tokens + k - 1  # the last draft's KV is never written
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]
