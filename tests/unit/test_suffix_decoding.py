"""Suffix decoding's parts: the suffix tree's counts against brute force while sequences grow and go, the longest
match and the most frequent continuation, the draft length rules (max_spec_factor x match length, the cap,
min_token_prob), the global cache's token bound and oldest-first eviction, the proposer's choice between the
request's tree and the cache, the drafter's gate seeing only decode steps; and, with hypothesis, that a draft is
always what followed an earlier occurrence of the matched suffix in the indexed text."""
import random
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.shared.config import SpeculativeConfig
from tandem.shared.request import FinishReason, Request, SamplingParams
from tandem.shared.scheduler import SchedulerOutput
from tandem.shared.spec_decode.drafter import Drafter
from tandem.shared.spec_decode.suffix_proposer import MAX_DEPTH, SuffixProposer
from tandem.shared.spec_decode.suffix_tree import SuffixTree
from tests.passes import fuzz_settings


def occurrences(seqs, pattern) -> int:
    n = len(pattern)
    return sum(s[i : i + n] == pattern for s in seqs for i in range(len(s) - n + 1))


def substrings(seqs, max_len):
    return {tuple(s[i : i + n]) for s in seqs for i in range(len(s)) for n in range(1, min(max_len, len(s) - i) + 1)}


def tree_of(*seqs, depth=8) -> SuffixTree:
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, list(s))
    return tree


def test_counts_are_the_occurrences_of_every_substring_while_sequences_grow_and_go():
    rng = random.Random(0)
    for _ in range(60):
        depth = rng.choice([2, 3, 5])
        tree, seqs = SuffixTree(depth), {}
        for _ in range(10):
            if seqs and rng.random() < 0.2:
                k = rng.choice(list(seqs))
                tree.remove(k)
                del seqs[k]
            else:  # a few tokens at a time, as a request grows
                k, new = rng.randrange(3), [rng.randrange(3) for _ in range(rng.randrange(7))]
                tree.extend(k, new)
                seqs.setdefault(k, []).extend(new)
            for pattern in substrings(seqs.values(), depth):
                assert tree.count(list(pattern)) == occurrences(seqs.values(), list(pattern))
            assert tree.num_tokens == sum(map(len, seqs.values()))
        for k in list(seqs):
            tree.remove(k)
        assert tree.num_nodes == 1 and tree.root.children is None  # every node freed


def test_text_that_repeats_nothing_costs_one_node_per_token_and_repeated_text_shares_its_nodes():
    tree = tree_of(range(100), depth=8)
    assert tree.num_nodes == 1 + 100  # one leaf per suffix: its own tokens continue it
    assert tree.count([5, 6, 7]) == 1 and tree.count([7, 5]) == 0
    # 0..4 again: its 15 substrings get nodes of count 2 (5 of them were leaves), and the 5 suffixes of the first
    # text that owned those leaves move down to new ones (token 5)
    tree.extend(1, list(range(5)))
    assert tree.num_nodes == 1 + 100 + 15 and tree.count([1, 2, 3]) == 2
    tree.remove(0)
    assert tree.count([1, 2, 3]) == 1 and tree.count([50]) == 0 and tree.num_nodes == 1 + 15
    with pytest.raises(ValueError):
        tree.count(list(range(9)))


def own(tokens, num_tokens=8, factor=1.0, min_prob=0.1, max_pattern=4):
    """A request's own tree over tokens, and its draft."""
    tree = SuffixTree(8)
    tree.extend("r", list(tokens))
    return tree.speculate(tree.tokens("r"), num_tokens, max_pattern, factor, min_prob)


def test_the_longest_suffix_seen_before_with_a_continuation_is_matched():
    # [1, 2, 3] occurred once before (followed by 9, 9, 3, 7); the trailing occurrence itself never counts
    draft = own([1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3])
    assert (draft.token_ids, draft.match_len, draft.score) == ([9, 9, 3], 3, 3.0)  # at most 1 x 3 tokens
    assert own([1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3], factor=2).token_ids == [9, 9, 3, 7, 5, 1]
    assert own([4, 5, 6, 4, 5], factor=2).token_ids == [6, 4, 5]  # cut at the end of the text
    assert own([7, 7]).token_ids == [7]
    assert own([1, 2, 3, 4]) == own([1, 2, 3, 4], num_tokens=3) and own([1, 2, 3, 4]).match_len == 0
    # a pattern is at most max_pattern tokens, and a draft at most num_tokens
    draft = own(list(range(10)) * 2, num_tokens=3, max_pattern=5)
    assert (draft.token_ids, draft.match_len) == ([0, 1, 2], 5)


def test_the_draft_follows_the_most_frequent_continuation_while_its_probability_holds():
    # after 5: 1 three times, 4 once; after 5 1: 2 twice, 3 once
    tree = tree_of([5, 1, 2], [5, 1, 2], [5, 1, 3], [5, 4])

    def draft(context, factor=1.0, min_prob=0.1):
        return tree.speculate(context, 8, 4, factor, min_prob)

    assert draft([8, 5]).token_ids == [1]  # [8, 5] never occurred: matched 1 token, so 1 x 1 draft
    d = draft([8, 5], factor=2)
    assert (d.token_ids, d.match_len, d.score) == ([1, 2], 1, pytest.approx(3 / 4 + 3 / 4 * 2 / 3))
    assert draft([8, 5], factor=2, min_prob=0.6).token_ids == [1]  # 3/4, then 3/4 x 2/3 = 1/2 < 0.6
    assert draft([8, 5], min_prob=0.8).token_ids == []
    assert draft([5, 1], factor=4).token_ids == [2]  # [5, 1, 2] ends every text that has it
    assert draft([5, 4]).match_len == 0 and draft([5, 4]).token_ids == []  # neither [5, 4] nor [4] goes on


def finish(proposer, request_id, output, reason=FinishReason.STOP, prompt=(1,)):
    r = Request(request_id, list(prompt), SamplingParams(max_tokens=100))
    r.output_token_ids, r.finish_reason = list(output), reason
    proposer.request_finished(r)


def test_the_cache_of_outputs_keeps_at_most_its_tokens_and_evicts_the_oldest_first():
    proposer = SuffixProposer(1.0, 0.1, cache_tokens=10)
    finish(proposer, "a", [1, 2, 3, 4])
    finish(proposer, "b", [5, 6, 7, 8])
    finish(proposer, "x", [40, 41], reason=FinishReason.ABORT)  # an aborted request's output is not kept
    assert proposer.cache.num_tokens == 8 and proposer.cache.count([40]) == 0
    finish(proposer, "c", [9, 10, 11, 12])  # 12 tokens > 10: a goes
    assert proposer.cache.num_tokens == 8 and list(proposer.cached) == [2, 3]
    assert proposer.cache.count([1, 2]) == 0 and proposer.cache.count([5, 6]) == 1
    finish(proposer, "d", list(range(20, 34)))  # longer than the cache: its last 10 tokens, and nothing else
    assert proposer.cache.num_tokens == 10 and proposer.cache.count([24]) == 1 and proposer.cache.count([23]) == 0
    assert proposer.cache.num_nodes == tree_of(range(24, 34), depth=MAX_DEPTH).num_nodes  # the rest freed
    assert SuffixProposer(1.0, 0.1, cache_tokens=0).cache.num_tokens == 0


def test_a_request_drafts_from_the_cache_or_its_own_tokens_whichever_scores_higher():
    proposer = SuffixProposer(1.0, 0.1, cache_tokens=100)
    finish(proposer, "old", [10, 11, 12, 13, 14, 15, 16])
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=20))
    r.output_token_ids = [10]
    assert proposer.propose(r, 8) == [11]  # its own tokens repeat nothing; the cache has [10]: 1 x 1 token
    r.output_token_ids += [11, 12]
    assert proposer.propose(r, 8) == [13, 14, 15]  # matched 3 tokens
    assert proposer.request_trees["r"].tokens("r") == [1, 2, 3, 10, 11, 12]  # its tree grew with its tokens
    r.output_token_ids += [1, 2, 3, 10, 11]  # now its own tokens have [1, 2, 3, 10, 11] before, then 12
    assert proposer.propose(r, 8) == [12, 1, 2, 3, 10]
    r.finish_reason = FinishReason.LENGTH
    proposer.request_finished(r)
    assert "r" not in proposer.request_trees and proposer.cache.count([10, 11, 12, 1]) == 1


def fake_runner():
    return SimpleNamespace(model_config=SimpleNamespace(longrope_context=None),
                           cache_config=SimpleNamespace(block_size=16))  # fmt: skip


def test_the_drafter_treats_suffix_like_ngram_and_its_gate_measures_only_decode_steps():
    drafter = Drafter(SpeculativeConfig("suffix"), fake_runner())
    assert drafter.config.num_speculative_tokens == 15
    r = Request("a", [1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=20))
    r.output_token_ids, r.num_computed_tokens = [4], 7
    drafter.propose_drafts([r], 2048)  # alone in the batch: the full window, drafts as long as the match
    assert r.spec_window == 15 and r.spec_token_ids == [1, 2, 3, 4]
    other = Request("b", [9] * 40, SamplingParams(max_tokens=20))
    drafter.observe_step(SchedulerOutput([r], {"a": 5}, {"a": [1, 2, 3, 4]}), 5, 0.1)
    assert drafter.gate.num_steps == 1
    drafter.observe_step(SchedulerOutput([r, other], {"a": 1, "b": 12}), 1, 0.1)  # a prompt chunk: not timed
    assert drafter.gate.num_steps == 1
    r.finish_reason = FinishReason.STOP
    drafter.request_finished(r)
    assert drafter.proposer.cache.count([4, 1, 2, 3, 4]) == 0 and drafter.proposer.cache.count([4]) == 1


FUZZ = fuzz_settings(200)
tokens = st.lists(st.integers(0, 3), max_size=14)


@pytest.mark.fuzz
@FUZZ
@given(texts=st.lists(tokens, max_size=3), context=tokens.filter(bool), split=st.integers(0, 14),
       factor=st.sampled_from([0.5, 1.0, 2.0, 8.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_matched_suffix(texts, context, split, factor,
                                                                              min_prob):
    """Other texts (a cache of outputs) and the context itself (a request's own tree, grown in two steps): the
    match is the longest suffix (at most 3 tokens) with an occurrence that has a token after it, the trailing one
    never; the draft is what followed such an occurrence, at most factor x its length, and its first token the
    most frequent one after the match."""
    tree = SuffixTree(6)
    for i, text in enumerate(texts):
        tree.extend(i, text)
    tree.extend("own", context[:split])
    tree.extend("own", context[split:])
    draft = tree.speculate(tree.tokens("own"), 8, 3, factor, min_prob)
    seqs = [*texts, context]

    def followed(pattern, then):
        """Whether pattern occurs with then after it (then empty: with some token after it)."""
        n = len(pattern)
        return any(s[i : i + n] == pattern and s[i + n : i + n + len(then)] == then
                   for s in seqs for i in range(len(s) - n))  # fmt: skip

    m = draft.match_len
    if m < min(3, len(context)):
        assert not followed(context[len(context) - m - 1 :], [])  # no longer suffix occurs with a continuation
    if m == 0:
        assert draft.token_ids == []
        return
    pattern = context[-m:]
    assert followed(pattern, draft.token_ids) and followed(pattern, [])
    assert len(draft.token_ids) <= min(8, int(factor * m))
    nexts = [s[i + m] for s in seqs for i in range(len(s) - m) if s[i : i + m] == pattern]
    if draft.token_ids:
        assert nexts.count(draft.token_ids[0]) == max(nexts.count(t) for t in nexts)
    elif int(factor * m) >= 1:  # nothing drafted: the likeliest continuation is below min_prob
        assert max(nexts.count(t) for t in nexts) / len(nexts) < min_prob
