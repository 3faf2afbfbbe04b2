"""Drafter: the engine's speculative-decoding bookkeeping. Before each step it gives every decoding request that
may speculate its draft tokens (spec_token_ids); after the step it counts the verified drafts and adapts the
request's draft length (SpeculativeConfig.adaptive: HF assisted generation's "heuristic" schedule)."""
from __future__ import annotations

from shared.config import SpeculativeConfig
from shared.request import Request
from shared.spec_decode.ngram_proposer import NgramProposer

SPEC_REST_STEPS = 8  # adaptive: steps without drafts after a rejection at draft length 1


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # since start

    def propose_drafts(self, running: list[Request], max_model_len: int) -> None:
        """Give each decoding request of the running batch that may speculate its draft tokens for this step: at
        most its draft length, and what its max_tokens and the context leave room for (the token after the
        drafts included); none when the batch is over config.disable_by_batch_size."""
        config = self.config
        if config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size:
            return
        # NOTE: alone in the batch, a request always gets the full draft length: the forward is bound by reading
        # the weights, so verifying k + 1 rows costs about what one does (measured: 2.15x plain on the copy task
        # vs 1.82x with the adaptive length)
        alone = len(running) == 1
        for request in running:
            if not request.sampling_params.speculative or request.num_computed_tokens != request.num_tokens - 1:
                continue
            if request.spec_window is None or alone:
                request.spec_window = config.num_speculative_tokens
            if request.spec_window < 1:  # resting after rejections at draft length 1: one step nearer
                request.spec_window += 1
                if request.spec_window < 1:
                    continue
            room = min(request.spec_window, request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                       max_model_len - request.num_tokens - 1)  # fmt: skip
            if room > 0:
                request.spec_token_ids = self.proposer.propose(request.token_ids(0, request.num_tokens), room)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count a verified step's drafts, and adapt the request's draft length to them."""
        if self.config.adaptive:
            if num_accepted == num_drafts:
                request.spec_window = min(request.spec_window + 2, self.config.num_speculative_tokens)
            elif request.spec_window > 1:
                request.spec_window -= 1
            else:  # its single draft rejected too: no drafts for the next SPEC_REST_STEPS steps
                request.spec_window = 1 - SPEC_REST_STEPS
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
