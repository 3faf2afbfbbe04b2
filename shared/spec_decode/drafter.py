"""Drafter: the engine's speculative-decoding bookkeeping. Before each step it gives every decoding request that
may speculate its draft tokens (spec_token_ids): the n-gram proposals, or for a draft model as many placeholder
ids, whose slots the scheduler then allocates and budgets like any others, and which draft() fills in once the
step is scheduled. After the step, record() counts the verified drafts. With SpeculativeConfig.adaptive each
request gets the drafts that pay (draft_length): its acceptance rate against what a draft token costs at this
batch size, as the engine's own step times show (StepCostModel)."""
from __future__ import annotations

import logging
import math
import time
from collections import deque

import numpy as np
import torch

from shared.config import ModelConfig, SpeculativeConfig
from shared.request import Request
from shared.scheduler import SchedulerOutput
from shared.spec_decode.draft_model import DraftModelProposer
from shared.spec_decode.ngram_proposer import NgramProposer

log = logging.getLogger(__name__)

SPEC_REST_STEPS = 8  # adaptive, while no draft pays: steps between single-draft tries, at least
MAX_REST_STEPS = 64
SPEC_DECAY = 0.8  # adaptive: weight of a request's earlier verified steps in its acceptance rate, per step
INSTANCE_DECAY = 0.99  # the same for the instance's rate, per verified request step
PRIOR_WEIGHT = 2.0  # verified steps' worth of the instance's rate in a request's
COST_WINDOW = 64  # steps the cost model fits
MIN_COST_STEPS = 8


PLACEHOLDER = -1  # a draft model's draft before draft() runs (never a valid token id: it would fail loudly)


class Drafter:
    """model_runner: the target's (its model and pool, for early exit; its device and pool size, for a draft
    model). ValueError when the draft model does not fit the target (another vocabulary, or an early exit at
    or past the target's depth)."""

    def __init__(self, config: SpeculativeConfig, model_runner):
        self.config = config
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # since start
        self.proposer = self.draft_model = None
        self.cost = StepCostModel()
        self.accepted_ema = self.rejected_ema = 0.0  # over every request's verified steps, decayed
        self.num_steps = 0  # steps proposed for
        target = model_runner.model_config
        block_size = model_runner.cache_config.block_size
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "early-exit":
            num_layers = config.draft_num_layers or max(1, target.num_hidden_layers // 4)
            if not 1 <= num_layers < target.num_hidden_layers:
                raise ValueError(f"--draft-num-layers must be in [1, {target.num_hidden_layers}) for this model, "
                                 f"got {num_layers}")
            self.draft_model = DraftModelProposer(model_runner.model, model_runner.kv_caches, block_size,
                                                  num_layers)
        else:  # "draft": a separate checkpoint with its own pool, paged by the target's block tables
            from shared.model import load_model

            draft = ModelConfig.from_dir(config.draft_model, dtype=target.dtype)
            if draft.vocab_size != target.vocab_size:
                raise ValueError(f"draft model {config.draft_model} has a vocabulary of {draft.vocab_size} tokens; "
                                 f"the target's has {target.vocab_size}: they must share the tokenizer")
            cache = model_runner.cache_config
            kv_caches = torch.zeros(draft.num_hidden_layers, 2, cache.num_blocks, block_size,
                                    draft.num_key_value_heads, draft.head_dim, dtype=cache.dtype,
                                    device=model_runner.device)  # fmt: skip
            log.info("draft model %s: %d layers, its KV pool %.2f GB", draft.model_id, draft.num_hidden_layers,
                     kv_caches.numel() * kv_caches.element_size() / 1e9)
            self.draft_model = DraftModelProposer(load_model(draft, model_runner.device), kv_caches, block_size)

    def propose_drafts(self, running: list[Request], max_model_len: int) -> None:
        """Give each decoding request of the running batch that may speculate its draft tokens for this step: at
        most its draft length (draft_length), and what its max_tokens and the context leave room for (the token
        after the drafts included); none when the batch is over config.disable_by_batch_size."""
        config = self.config
        if not running or (config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size):
            return
        beta = self.cost.draft_cost(len(running)) if config.adaptive else 0.0
        self.num_steps += 1
        for request in running:
            if not request.sampling_params.speculative or request.num_computed_tokens != request.num_tokens - 1:
                continue
            k = self.draft_length(request, beta) if config.adaptive else config.num_speculative_tokens
            room = min(k, request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                       max_model_len - request.num_tokens - 1)  # fmt: skip
            if room <= 0:
                continue
            if self.draft_model is not None:
                request.spec_token_ids = [PLACEHOLDER] * room
            else:
                request.spec_token_ids = self.proposer.propose(request.token_ids(0, request.num_tokens), room)

    @property
    def acceptance_rate(self) -> float:
        """The instance's recent per-draft acceptance rate (the prior of a request's own), 1/2 to begin with."""
        return (self.accepted_ema + 1) / (self.accepted_ema + self.rejected_ema + 2)

    def draft_length(self, request: Request, beta: float) -> int:
        """The adaptive draft length: the drafts whose expected gain outweighs their cost (Leviathan et al.
        2023, section 3.4, choose the draft length from the acceptance rate and the draft's relative cost; here
        per request and step). The request's i-th draft is accepted with probability about alpha^i and costs
        beta tokens (StepCostModel.draft_cost), so it gets the drafts i <= num_speculative_tokens with
        alpha^i > beta. alpha: its accepted drafts over accepted drafts plus rejections, counts decayed by
        SPEC_DECAY per verified step, with PRIOR_WEIGHT steps' worth of the instance's rate as prior. When no
        draft pays but one could (beta < 1), the request tries a single one now and then, which keeps alpha
        current: every SPEC_REST_STEPS * 2^ceil(log2(beta / alpha)) steps (at most MAX_REST_STEPS), the
        further from paying the rarer."""
        accepted, rejected = request.spec_num_accepted_ema, request.spec_num_rejected_ema
        alpha = (accepted + PRIOR_WEIGHT * self.acceptance_rate) / (accepted + rejected + PRIOR_WEIGHT)
        k = 0
        while k < self.config.num_speculative_tokens and alpha ** (k + 1) > beta:
            k += 1
        if k > 0 or beta >= 1:  # (beta >= 1: not even a sure draft pays, so none is tried)
            return k
        # a single try every `rest` steps, rest a power of two so that the requests resting alike try in the
        # same steps: a draft model's forward costs about the same for one request as for several
        rest = min(SPEC_REST_STEPS * 2 ** max(0, math.ceil(math.log2(beta / alpha))), MAX_REST_STEPS)
        return 1 if self.num_steps % rest == 0 else 0

    def draft(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> None:
        """A draft model's turn, once the step is scheduled: replace the placeholder drafts of
        out.scheduled_spec_decode_tokens by the draft's tokens (the scheduler has allocated their slots), and
        record in out.spec_draft_probs the distributions a sampled request's drafts came from."""
        if self.draft_model is None or not out.scheduled_spec_decode_tokens:
            return
        requests = [r for r in out.scheduled_requests if r.request_id in out.scheduled_spec_decode_tokens]
        num_drafts = [len(out.scheduled_spec_decode_tokens[r.request_id]) for r in requests]
        start = time.perf_counter()
        proposals = self.draft_model.propose(requests, num_drafts, block_tables)
        self.cost.observe_drafts(sum(num_drafts), time.perf_counter() - start)
        for r, (drafts, probs) in zip(requests, proposals):
            out.scheduled_spec_decode_tokens[r.request_id] = drafts
            if probs is not None:
                out.spec_draft_probs[r.request_id] = probs

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count a verified step's drafts, for the request's acceptance rate and the totals."""
        rejected = num_accepted < num_drafts
        request.spec_num_accepted_ema = SPEC_DECAY * request.spec_num_accepted_ema + num_accepted
        request.spec_num_rejected_ema = SPEC_DECAY * request.spec_num_rejected_ema + rejected
        self.accepted_ema = INSTANCE_DECAY * self.accepted_ema + num_accepted
        self.rejected_ema = INSTANCE_DECAY * self.rejected_ema + rejected
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted


class StepCostModel:
    """What a draft token costs, from the steps this engine ran: step seconds = a + b * rows, fitted by least
    squares over the last COST_WINDOW steps, and a draft model's seconds per draft token (an average over its
    recent calls; 0 for n-gram lookup)."""

    def __init__(self):
        self.steps: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)
        self.fit: tuple[float, float] | None = None  # (a, b): seconds per step and per row
        self.draft_seconds_per_token = 0.0

    def observe_step(self, num_rows: int, seconds: float) -> None:
        self.steps.append((num_rows, seconds))

    def observe_drafts(self, num_draft_tokens: int, seconds: float) -> None:
        per_token = seconds / num_draft_tokens
        self.draft_seconds_per_token = 0.9 * self.draft_seconds_per_token + 0.1 * per_token if \
            self.draft_seconds_per_token else per_token

    def draft_cost(self, batch_size: int) -> float:
        """The cost of one draft token in a step of batch_size requests, in tokens: (b + a draft's seconds per
        token) / ((a + b * batch_size) / batch_size), the seconds an extra verified row (and drafting it) takes
        over the seconds per token of a step without drafts. A step with drafts gives more tokens per second iff
        its drafts' expected accepted tokens exceed their summed cost. The fit is redone when the window holds
        MIN_COST_STEPS steps of different row counts, and kept while it does not (a batch that stopped
        drafting has one row count); 0 until the first fit."""
        if len(self.steps) >= MIN_COST_STEPS:
            rows = np.array([r for r, _ in self.steps], dtype=np.float64)
            if rows.std() >= 0.5:
                seconds = np.array([t for _, t in self.steps], dtype=np.float64)
                b, a = np.polyfit(rows, seconds, 1)
                self.fit = max(a, 0.0), max(b, 0.0)
        if self.fit is None:
            return 0.0
        a, b = self.fit
        per_token = (a + b * batch_size) / batch_size
        return (b + self.draft_seconds_per_token) / per_token if per_token > 0 else 0.0
