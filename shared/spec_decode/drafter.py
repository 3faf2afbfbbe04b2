"""Drafter: the engine's speculative-decoding bookkeeping. Before each step it gives every decoding request that
may speculate its draft tokens (spec_token_ids): the n-gram proposals, or for a draft model as many placeholder
ids, whose slots the scheduler then allocates and budgets like any others, and which draft() fills in once the
step is scheduled. After the step, record() counts the verified drafts and (SpeculativeConfig.adaptive) adapts
the request's draft length (HF assisted generation's "heuristic" schedule); a draft model whose token costs at
least the target's, by this engine's own timings (StepCostModel), proposes nothing."""
from __future__ import annotations

import logging
import time

import torch

from shared.config import ModelConfig, SpeculativeConfig
from shared.request import Request
from shared.scheduler import SchedulerOutput
from shared.spec_decode.draft_model import DraftModelProposer
from shared.spec_decode.ngram_proposer import NgramProposer

log = logging.getLogger(__name__)

SPEC_REST_STEPS = 8  # adaptive: steps without drafts after a rejection at draft length 1
GATE_RETRY_STEPS = 64  # adaptive: a draft model that costs too much drafts one step in this many


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
        self.num_gated_steps = 0  # steps without drafts because the draft model cost too much
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
        most its draft length, and what its max_tokens and the context leave room for (the token after the
        drafts included). None when the batch is over config.disable_by_batch_size, nor (adaptive) when a draft
        model's token costs at least a target's (StepCostModel.draft_cost): then no acceptance rate could pay,
        except one step in GATE_RETRY_STEPS, which keeps the draft's timing current."""
        config = self.config
        if not running or (config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size):
            return
        if config.adaptive and self.draft_model is not None and self.cost.draft_cost() >= 1:
            self.num_gated_steps += 1
            if self.num_gated_steps % GATE_RETRY_STEPS:  # (a step of drafts now and then measures it again)
                return
        # NOTE: alone in the batch, a request with n-gram drafts always gets the full draft length: they cost no
        # model call, and the forward is bound by reading the weights, so verifying k + 1 rows costs about what
        # one does (measured: 2.15x plain on the copy task vs 1.82x with the adaptive length)
        free_drafts = len(running) == 1 and self.draft_model is None
        for request in running:
            params = request.sampling_params
            if not params.speculative or params.has_penalties or request.num_computed_tokens != request.num_tokens - 1:
                continue
            if request.spec_window is None or free_drafts or not config.adaptive:
                request.spec_window = config.num_speculative_tokens
            if request.spec_window < 1:  # resting after rejections at draft length 1: one step nearer
                request.spec_window += 1
                if request.spec_window < 1:
                    continue
            room = min(request.spec_window, request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                       max_model_len - request.num_tokens - 1)  # fmt: skip
            if room <= 0:
                continue
            if self.draft_model is not None:
                request.spec_token_ids = [PLACEHOLDER] * room
            else:
                drafts = self.proposer.propose(request.token_ids(0, request.num_tokens), room)
                if request.grammar is not None:  # (a draft the grammar refuses could never be accepted)
                    drafts = drafts[: request.grammar.num_valid(drafts)]
                request.spec_token_ids = drafts

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the cost model a step that only decoded (each request at most 1 + num_speculative_tokens rows)."""
        num_requests = len(out.scheduled_requests)
        if num_requests and out.total_num_scheduled_tokens <= num_requests * (1 + self.config.num_speculative_tokens):
            self.cost.observe_step(num_requests, seconds)

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
        """Count a verified step's drafts, and (adaptive) adapt the request's draft length to them: one shorter
        after a rejection, two longer after a step that accepted every draft (HF assisted generation's
        "heuristic" schedule); after a rejection at length 1, no drafts for SPEC_REST_STEPS steps."""
        if self.config.adaptive:
            if num_accepted == num_drafts:
                request.spec_window = min(request.spec_window + 2, self.config.num_speculative_tokens)
            elif request.spec_window > 1:
                request.spec_window -= 1
            else:
                request.spec_window = 1 - SPEC_REST_STEPS
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted


class StepCostModel:
    """What a draft model's token costs against a target's, from this engine's own timings: the seconds per
    request of its decode steps and the draft model's seconds per draft token (averages over recent steps and
    calls)."""

    def __init__(self):
        self.seconds_per_request = 0.0
        self.draft_seconds_per_token = 0.0

    def observe_step(self, batch_size: int, seconds: float) -> None:
        self.seconds_per_request = _average(self.seconds_per_request, seconds / batch_size)

    def observe_drafts(self, num_draft_tokens: int, seconds: float) -> None:
        self.draft_seconds_per_token = _average(self.draft_seconds_per_token, seconds / num_draft_tokens)

    def draft_cost(self) -> float:
        """A draft token's seconds over a target token's: at 1 or more not even a draft accepted every time
        pays (the verification comes on top). 0 until both were measured."""
        if not self.seconds_per_request or not self.draft_seconds_per_token:
            return 0.0
        return self.draft_seconds_per_token / self.seconds_per_request


def _average(mean: float, value: float) -> float:
    """An exponential moving average (weight 0.1 for the new value); the first value as it is."""
    return 0.9 * mean + 0.1 * value if mean else value
