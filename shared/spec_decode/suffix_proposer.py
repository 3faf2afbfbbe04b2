"""Suffix decoding (Oliveira et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975; ArcticInference's implementation is the reference design): drafts from suffix
trees (shared/spec_decode/suffix_tree.py) over (a) the request's own prompt and output so far and (b) a cache of
the outputs of the engine's recent requests. Each step matches the longest suffix of the request's tokens in each
tree, drafts the most frequent continuation there (at most max_spec_factor x the match length, while its
empirical probability stays at or above min_token_prob), and proposes the draft whose expected accepted tokens
(score) are higher. Costs no model call: it pays when outputs repeat the prompt, themselves or earlier requests'
outputs (code edits, agent loops, a question asked again)."""
from __future__ import annotations

from collections import OrderedDict

from tandem.shared.request import FinishReason, Request
from tandem.shared.spec_decode.suffix_tree import NO_DRAFT, SuffixTree

# The tree's depth: a matched pattern plus its draft, where the text repeats (past a leaf, a draft follows its one
# occurrence further). Patterns match up to half of it, so the longest match leaves as much room to draft as
# num_speculative_tokens (15 by default) needs. (vLLM's default is 24, ArcticInference's 64: in pure Python text
# seen twice builds up to max_depth nodes per token, shared/spec_decode/suffix_tree.py)
MAX_DEPTH = 32


class SuffixProposer:
    """max_spec_factor: drafts of at most this times the matched length (SuffixDecoding's MAX_SPEC = alpha * p);
    min_token_prob: a draft stops where the product of its tokens' empirical probabilities falls below this;
    cache_tokens: the global cache's size, in output tokens of finished requests (the oldest go first past it;
    0: no global cache); SpeculativeConfig checks them."""

    def __init__(self, max_spec_factor: float, min_token_prob: float, cache_tokens: int, max_depth: int = MAX_DEPTH):
        self.max_spec_factor, self.min_token_prob, self.cache_tokens = max_spec_factor, min_token_prob, cache_tokens
        self.max_depth, self.max_pattern_len = max_depth, max_depth // 2
        self.request_trees: dict[str, SuffixTree] = {}  # request id -> its prompt + output
        self.cache = SuffixTree(max_depth)  # recent requests' outputs, one sequence each
        self.cached: OrderedDict[int, None] = OrderedDict()  # their ids, oldest first
        self.num_cached = 0  # requests cached since start (the next id)

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Up to num_tokens draft token ids to follow the request's tokens; [] without a match. Indexes the tokens
        it has not seen yet first (its tree grows with the accepted tokens)."""
        rid = request.request_id
        tree = self.request_trees.get(rid)
        if tree is not None and len(tree.tokens(rid)) > request.num_tokens:  # (not its tokens: index them anew)
            tree.close(rid)
            tree = None
        if tree is None:
            tree = self.request_trees[rid] = SuffixTree(self.max_depth)
            tree.extend(rid, [])
        context = tree.tokens(rid)
        if len(context) < request.num_tokens:
            tree.extend(rid, request.token_ids(len(context), request.num_tokens))
        if num_tokens <= 0:
            return []
        args = (num_tokens, self.max_pattern_len, self.max_spec_factor, self.min_token_prob)
        own = tree.speculate(context, *args)
        cached = self.cache.speculate(context, *args) if self.cached else NO_DRAFT
        return (cached if cached.score > own.score else own).token_ids

    def request_finished(self, request: Request) -> None:
        """Drop the request's tree; add its output to the global cache unless it was aborted, then evict the
        oldest cached outputs past cache_tokens."""
        tree = self.request_trees.pop(request.request_id, None)
        if tree is not None:
            tree.close(request.request_id)  # (freed at once, not by the garbage collector)
        output = request.output_token_ids
        if request.finish_reason == FinishReason.ABORT or not output or self.cache_tokens == 0:
            return
        self.num_cached += 1
        self.cache.extend(self.num_cached, output[-self.cache_tokens :])
        self.cache.close(self.num_cached)
        self.cached[self.num_cached] = None
        while self.cache.num_tokens > self.cache_tokens:
            self.cache.remove(self.cached.popitem(last=False)[0])
