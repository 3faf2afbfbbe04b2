"""Drafter: the engine's speculative-decoding bookkeeping. Before each step it gives every decoding request that
may speculate its draft tokens (spec_token_ids): the n-gram or suffix proposals, or for a draft model as many
placeholder ids, whose slots the scheduler then allocates and budgets like any others, and which draft() fills in
once the step is scheduled. After the step, record() counts the verified drafts and (SpeculativeConfig.adaptive) adapts
the request's draft length (HF assisted generation's "heuristic" schedule), and a SpeculationGate keeps drafts
off at the batch sizes where this engine measured more tokens per second without them."""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque

import torch

from tandem.kernels.kv_quant import check_head_dim
from tandem.shared.config import ModelConfig, SpeculativeConfig
from tandem.shared.request import Request
from tandem.shared.scheduler import SchedulerOutput
from tandem.shared.spec_decode.draft_model import DraftModelProposer
from tandem.shared.spec_decode.ngram_proposer import NgramProposer
from tandem.shared.spec_decode.suffix_proposer import SuffixProposer

log = logging.getLogger(__name__)

SPEC_REST_STEPS = 8  # adaptive: steps without drafts after a rejection at draft length 1
GATE_LOG_INTERVAL_S = 30.0  # the gate's measurements go to the log at most this often


PLACEHOLDER = -1  # a draft model's draft before draft() runs (never a valid token id: it would fail loudly)


class Drafter:
    """model_runner: the target's (its model and pool, for early exit; its device and pool size, for a draft
    model). ValueError when the draft model does not fit the target (another vocabulary, or an early exit at
    or past the target's depth)."""

    def __init__(self, config: SpeculativeConfig, model_runner):
        self.config = config
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # since start
        self.proposer = self.draft_model = None
        self.draft_config: ModelConfig | None = None  # method "draft": the draft checkpoint's architecture
        self.gate = SpeculationGate()
        self.step_speculates = False  # whether this step's batch was offered drafts
        self.last_gate_log = time.monotonic()
        target = model_runner.model_config
        self.longrope_context = target.longrope_context
        block_size = model_runner.cache_config.block_size
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(config.suffix_max_spec_factor, config.suffix_min_token_prob,
                                           config.suffix_cache_tokens)
        elif config.method == "early-exit":
            num_layers = config.draft_num_layers
            if num_layers is None:
                num_layers = max(1, target.num_hidden_layers // 4)
            if not 1 <= num_layers < target.num_hidden_layers:
                raise ValueError(f"--draft-num-layers must be in [1, {target.num_hidden_layers}) for this model, "
                                 f"got {num_layers}")
            self.draft_model = DraftModelProposer(model_runner.model, model_runner.kv_caches, block_size,
                                                  num_layers, model_runner.cache_config.kv_quant)
        else:  # "draft": a separate checkpoint with its own pool, paged by the target's block tables
            from tandem.shared.model import load_model

            draft = ModelConfig.from_dir(config.draft_model, dtype=target.dtype)
            if draft.vocab_size != target.vocab_size:
                raise ValueError(f"draft model {config.draft_model} has a vocabulary of {draft.vocab_size} tokens; "
                                 f"the target's has {target.vocab_size}: they must share the tokenizer")
            cache = model_runner.cache_config  # (the draft's KV in the target's KV dtype, quantized or not)
            if cache.kv_quant is not None:
                check_head_dim(draft.head_dim, cache.kv_quant)
            kv_caches = torch.zeros(draft.num_hidden_layers, 2, cache.num_blocks, block_size,
                                    draft.num_key_value_heads, cache.row_size(draft), dtype=cache.dtype,
                                    device=model_runner.device)  # fmt: skip
            log.info("draft model %s: %d layers, its KV pool %.2f GB", draft.model_id, draft.num_hidden_layers,
                     kv_caches.numel() * kv_caches.element_size() / 1e9)
            self.draft_model = DraftModelProposer(load_model(draft, model_runner.device), kv_caches, block_size,
                                                  kv_quant=cache.kv_quant)
            self.draft_config = draft

    def propose_drafts(self, running: list[Request], max_model_len: int) -> None:
        """Give each decoding request of the running batch that may speculate its draft tokens for this step: at
        most its draft length, and what its max_tokens and the context leave room for (the token after the
        drafts included). None when the batch is over config.disable_by_batch_size, nor (adaptive) when the
        SpeculationGate measured more tokens per second without drafts at this batch size."""
        config = self.config
        self.step_speculates = bool(running) and (config.disable_by_batch_size is None
                                                  or len(running) <= config.disable_by_batch_size)
        if self.step_speculates and config.adaptive:
            self.step_speculates = self.gate.speculate(len(running))
        if not self.step_speculates:
            return
        # NOTE: alone in the batch, a request with n-gram or suffix drafts always gets the full draft length: they
        # cost no model call, and the forward is bound by reading the weights, so verifying k + 1 rows costs about
        # what one does (measured: 2.15x plain on the copy task vs 1.82x with the adaptive length)
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
            if request.rope_long is False:  # (longrope: drafts stop short of the original context's end)
                room = min(room, self.longrope_context - request.num_tokens)
            if room <= 0:
                continue
            if self.draft_model is not None:
                request.spec_token_ids = [PLACEHOLDER] * room
            else:
                drafts = (self.proposer.propose(request, room) if isinstance(self.proposer, SuffixProposer)
                          else self.proposer.propose(request.token_ids(0, request.num_tokens), room))
                if request.grammar is not None:  # (a draft the grammar refuses could never be accepted)
                    drafts = drafts[: request.grammar.num_valid(drafts)]
                request.spec_token_ids = drafts

    def observe_step(self, out: SchedulerOutput, num_tokens: int, seconds: float) -> None:
        """Feed the gate a step that only decoded (each request its next token and its drafts, no prompt chunk):
        the tokens it emitted and its seconds, drafting included."""
        num_requests = len(out.scheduled_requests)
        if num_requests and all(out.num_scheduled_tokens[r.request_id]
                                == 1 + len(out.scheduled_spec_decode_tokens.get(r.request_id, ()))
                                for r in out.scheduled_requests):  # fmt: skip
            self.gate.observe(num_requests, self.step_speculates, num_tokens, seconds)
            now = time.monotonic()
            if now - self.last_gate_log >= GATE_LOG_INTERVAL_S and (summary := self.gate.summary()):
                self.last_gate_log = now
                log.info("speculation gate: %s", summary)

    def draft(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> None:
        """A draft model's turn, once the step is scheduled: replace the placeholder drafts of
        out.scheduled_spec_decode_tokens by the draft's tokens (the scheduler has allocated their slots), and
        record in out.spec_draft_probs the distributions a sampled request's drafts came from."""
        if self.draft_model is None or not out.scheduled_spec_decode_tokens:
            return
        requests = [r for r in out.scheduled_requests if r.request_id in out.scheduled_spec_decode_tokens]
        num_drafts = [len(out.scheduled_spec_decode_tokens[r.request_id]) for r in requests]
        lora_slots = out.lora_slots if self.draft_config is None else None  # (early exit: the target's adapters)
        proposals = self.draft_model.propose(requests, num_drafts, block_tables, lora_slots)
        for r, (drafts, probs) in zip(requests, proposals):
            out.scheduled_spec_decode_tokens[r.request_id] = drafts
            if probs is not None:
                out.spec_draft_probs[r.request_id] = probs

    def request_finished(self, request: Request) -> None:
        """A request ended (its tokens final): suffix decoding drops its tree and caches its output."""
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.request_finished(request)

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


class SpeculationGate:
    """Whether a step offers drafts, from what this engine measured: paired comparisons of decode tokens emitted
    per second of step (drafting and verification included) with drafts and without, per bucket of batch sizes
    (1, 2-3, 4-7, 8-15, ...). A pair is a step of each way at the same batch size at most PAIR_STEPS steps apart,
    so it compares like with like while requests finish and contexts grow (unpaired averages drifted: one way's
    samples came from larger batches than the other's). The gate decides by the median log ratio of the last
    WINDOW pairs. A bucket first alternates until it has MIN_PAIRS pairs; then each step takes the faster way,
    and one step in 8 (the two within 10%) or 32 the other way, which pairs with the step before it.

    Why measured and not modelled: on CPU a verification row's cost depends on the batch's layout (a per-step
    cost model fitted to step times lost 7-15% on free chat, docs/speculative-decoding.md), and the tokens a
    draft gains depend on the traffic; their ratio is what decides, and each pair of steps measures it."""

    MIN_PAIRS = 3
    WINDOW = 7
    PAIR_STEPS = 2

    def __init__(self):
        self.num_steps = 0
        self.log_ratios: dict[int, deque] = {}  # bucket -> log(tokens/s with drafts / without), recent pairs
        self.last: dict[int, list] = {}  # bucket -> [(step, batch size, tokens/s) without, the same with drafts]
        self.since_explore: dict[int, int] = {}  # bucket -> steps since the slower way last ran

    @staticmethod
    def bucket(batch_size: int) -> int:
        return batch_size.bit_length()

    def ratio(self, bucket: int) -> float | None:
        """Tokens/s with drafts over without in a bucket (median of its recent pairs), once it has MIN_PAIRS."""
        ratios = self.log_ratios.get(bucket, ())
        return math.exp(statistics.median(ratios)) if len(ratios) >= self.MIN_PAIRS else None

    def speculate(self, batch_size: int) -> bool:
        """Whether a step of batch_size decoding requests offers drafts (counts the step)."""
        b = self.bucket(batch_size)
        ratio = self.ratio(b)
        if ratio is None:  # alternate, drafts first
            last = self.last.get(b, [None, None])
            return last[1] is None or (last[0] is not None and last[0][0] > last[1][0])
        best = ratio >= 1
        self.since_explore[b] = self.since_explore.get(b, 0) + 1
        if self.since_explore[b] >= (8 if 1 / 1.1 < ratio < 1.1 else 32):
            self.since_explore[b] = 0
            return not best
        return best

    def observe(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A decode step's outcome: the tokens it emitted in seconds, with drafts offered or not."""
        self.num_steps += 1
        if seconds <= 0 or num_tokens <= 0:
            return
        b = self.bucket(batch_size)
        last = self.last.setdefault(b, [None, None])
        rate, other = num_tokens / seconds, last[not speculated]
        if other is not None and self.num_steps - other[0] <= self.PAIR_STEPS and other[1] == batch_size:
            ratio = rate / other[2] if speculated else other[2] / rate
            self.log_ratios.setdefault(b, deque(maxlen=self.WINDOW)).append(math.log(ratio))
        last[speculated] = (self.num_steps, batch_size, rate)

    def summary(self) -> str:
        """The measured buckets, for the logs: their batch sizes and tokens/s with drafts over without."""
        return ", ".join(f"batch {1 << (b - 1)}-{(1 << b) - 1}: drafts {r:.2f}x the tokens/s without"
                         for b in sorted(self.log_ratios) if (r := self.ratio(b)) is not None)
