"""Speculative decoding's parts: the n-gram proposer, the acceptance rule, drafts in the scheduling rule, the
rollback of rejected drafts' blocks; and the output distribution of a tiny random model (built here, small
vocabulary) with a good and a deliberately bad draft, against the target's own distribution (chi-square)."""
import json

import numpy as np
import pytest
import torch

from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.request import Request, SamplingParams
from tandem.shared.scheduler import Scheduler
from tandem.shared.spec_decode.drafter import SPEC_REST_STEPS, SpeculationGate
from tandem.shared.spec_decode.ngram_proposer import NgramProposer
from tandem.shared.spec_decode.rejection_sampler import accept_draft_tokens


def test_ngram_longest_suffix_then_latest_occurrence():
    p = NgramProposer(1, 3)
    # suffix [1, 2, 3] occurs earlier once, followed by 9, 9; the 1-gram [3] occurs later, followed by 7
    assert p.propose([1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3], 2) == [9, 9]
    assert p.propose([5, 3, 7, 4, 3, 8, 6, 3], 3) == [8, 6, 3]  # no 2-gram match: the latest 1-gram [3]
    assert p.propose([4, 5, 6, 4, 5], 10) == [6, 4, 5]  # cut at the end of the sequence
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose([7, 7], 2) == [7]  # the match never overlaps the suffix itself
    assert p.propose([1, 2, 1], 0) == []
    assert NgramProposer(2, 2).propose([3, 1, 2, 1], 2) == []  # a 1-gram match is below the minimum
    with pytest.raises(ValueError):
        NgramProposer(0, 2)


def test_accept_longest_matching_prefix_plus_one():
    assert accept_draft_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + the bonus token
    assert accept_draft_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target's token at the first mismatch
    assert accept_draft_tokens([5], [4, 1]) == [4]
    assert accept_draft_tokens([], [3]) == [3]


def make_decoding(request_id, num_prompt=5, drafts=()):
    r = Request(request_id, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=20))
    r.output_token_ids = [1]
    r.num_computed_tokens = num_prompt  # the first output token has no KV yet
    r.spec_token_ids = list(drafts)
    return r


def test_drafts_are_more_tokens_of_the_step_and_the_budget_cuts_them():
    kv = KVCacheManager(32, 4)
    s = Scheduler(SchedulerConfig(6, 8), kv)
    a, b = make_decoding("a", drafts=[2, 3, 4]), make_decoding("b", drafts=[5, 6, 7])
    for r in (a, b):
        kv.allocate_slots(r, 0)
        s.add_request(r)
    out = s.schedule()  # a: 1 + 3 drafts; b: what is left of the budget, 1 + 1 draft
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [2, 3, 4], "b": [5]}
    assert a.spec_token_ids == [] and b.spec_token_ids == []  # proposed afresh for each step
    assert len(kv.get_block_table("a")) == 3  # slots for 6 tokens + 3 drafts


def test_rejected_drafts_blocks_return_to_the_pool():
    kv = KVCacheManager(8, 4)
    r = make_decoding("a", num_prompt=3)  # 4 tokens: 1 block
    assert kv.allocate_slots(r, 6)  # the last token + 5 drafts: 9 slots, 3 blocks
    assert len(kv.get_block_table("a")) == 3 and kv.num_free_blocks == 5
    r.output_token_ids += [2, 3]  # one draft accepted, plus the token after it: 6 tokens need 2 blocks
    kv.free_excess_blocks(r)
    assert len(kv.get_block_table("a")) == 2 and kv.num_free_blocks == 6


# -- a tiny model through the engine ----------------------------------------------------------------------

VOCAB = 12


def save_tiny_model(path, seed: int):
    """A random 2-layer Llama with a VOCAB-token vocabulary saved as a checkpoint dir at path; returns HF's copy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the init's, so that good and bad drafts differ
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    return model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Llama saved as a checkpoint dir, and HF's copy of it."""
    path = tmp_path_factory.mktemp("tiny")
    return str(path), save_tiny_model(path, seed=0)


def target_probs(hf_model, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].double()
    return (logits / temperature).softmax(-1).numpy()


def sample_all(engine, requests) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    outputs = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs


def second_and_third_tokens(engine, prompt, a, b, num_batches, temperature):
    """num_batches x 64 requests sample 4 tokens of prompt: the second tokens of those whose first is a, and
    the third tokens of those that begin (a, b)."""
    seconds, thirds = [], []
    for batch in range(num_batches):
        params = SamplingParams(max_tokens=4, temperature=temperature)
        outputs = sample_all(engine, [Request(f"{batch}-{i}", prompt, params) for i in range(64)])
        for tokens in outputs.values():
            assert len(tokens) == 4
            if tokens[0] == a:
                seconds.append(tokens[1])
                if tokens[1] == b:
                    thirds.append(tokens[2])
    return seconds, thirds


class FixedProposer:
    """Proposes the same draft tokens every step (the draft under test)."""

    def __init__(self, drafts):
        self.drafts = list(drafts)

    def propose(self, token_ids, num_tokens):
        return self.drafts[:num_tokens]


def chi_square_pvalue(samples: list[int], probs: np.ndarray) -> float:
    """Pearson's chi-square of samples against probs, cells under 5 expected pooled into one."""
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    keep = expected >= 5
    observed, expected = list(counts[keep]), list(expected[keep])
    if (~keep).any() and expected and sum(probs[~keep]) * len(samples) > 0:
        observed.append(counts[~keep].sum())
        expected.append(probs[~keep].sum() * len(samples))
    expected = np.asarray(expected) * sum(observed) / sum(expected)
    statistic = float(((np.asarray(observed) - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))  # fmt: skip


@pytest.mark.parametrize("quality", ["good", "bad"])
def test_speculative_sampling_keeps_the_target_distribution(tiny_model, quality):
    """Requests sample 4 tokens at temperature 1. The first comes plain; from the second on, two drafts are
    verified per step. Among requests whose first token is the likeliest one (a), the drafts are the target's
    likeliest (good) or least likely (bad) continuation of prompt + a; the second token must follow
    p(. | prompt + a) and, after an accepted first draft, the third p(. | prompt + a + draft)."""
    path, hf_model = tiny_model
    prompt = [3, 1, 4, 1, 5]
    a = int(target_probs(hf_model, prompt).argmax())
    p1 = target_probs(hf_model, prompt + [a])
    pick = np.argmax if quality == "good" else np.argmin
    d0 = int(pick(p1))
    p2 = target_probs(hf_model, prompt + [a, d0])
    d1 = int(pick(p2))
    engine = LLMEngine(ModelConfig.from_dir(path), CacheConfig(4, 600, enable_prefix_caching=False),
                       SchedulerConfig(2048, 64), speculative_config=SpeculativeConfig("ngram", 2))  # fmt: skip
    engine.drafter.proposer = FixedProposer([d0, d1])
    seconds, thirds = second_and_third_tokens(engine, prompt, a, d0, 64, temperature=1.0)
    assert len(seconds) > 500
    assert chi_square_pvalue(seconds, p1) > 1e-3
    if len(thirds) > 100:  # (rare with the bad draft: it is accepted with probability p1[d0])
        assert chi_square_pvalue(thirds, p2) > 1e-3
    assert engine.stats().spec_num_draft_tokens > 0
    assert engine.num_free_blocks == 600  # every block back, rejected drafts' included


@pytest.mark.parametrize("draft", ["itself", "another model", "early exit"])
def test_draft_model_sampling_keeps_the_target_distribution(tiny_model, tmp_path, draft):
    """Requests sample 4 tokens at temperature 0.7, from the second on with two drafts per step drawn from a
    draft model: the target itself (q = p: nearly every draft accepted), another random model (a bad draft), or
    the target's first layer (early exit). Given first token a, the second must follow p(. | prompt + a); given
    (a, b), b the likeliest second, the third p(. | prompt + a + b). A seeded request gives the same tokens
    alone, in a batch, and without speculation."""
    path, hf_model = tiny_model
    prompt, temperature = [3, 1, 4, 1, 5], 0.7
    if draft == "early exit":
        spec = SpeculativeConfig("early-exit", 2, draft_num_layers=1)
    else:
        other = tmp_path / "draft"
        spec = SpeculativeConfig("draft", 2, draft_model=path if draft == "itself" else str(other))
        if draft == "another model":
            save_tiny_model(other, seed=1)
    engine = LLMEngine(ModelConfig.from_dir(path), CacheConfig(4, 600, enable_prefix_caching=False),
                       SchedulerConfig(2048, 64), speculative_config=spec)  # fmt: skip
    a = int(target_probs(hf_model, prompt, temperature).argmax())
    p1 = target_probs(hf_model, prompt + [a], temperature)
    b = int(p1.argmax())
    p2 = target_probs(hf_model, prompt + [a, b], temperature)
    seconds, thirds = second_and_third_tokens(engine, prompt, a, b, 40, temperature)
    assert len(seconds) > 300 and len(thirds) > 100, (len(seconds), len(thirds))
    assert chi_square_pvalue(seconds, p1) > 1e-3
    assert chi_square_pvalue(thirds, p2) > 1e-3
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0
    if draft == "itself":
        assert stats.spec_acceptance_rate > 0.95
    assert engine.num_free_blocks == 600  # every block back, rejected drafts' included
    seeded = SamplingParams(max_tokens=12, temperature=0.7, seed=7)
    alone = sample_all(engine, [Request("alone", prompt, seeded)])["alone"]
    batch = sample_all(engine, [Request("x", [2, 2], SamplingParams(max_tokens=9, temperature=1.0)),
                                Request("seeded", prompt, seeded), Request("y", [7, 1, 7], seeded)])  # fmt: skip
    assert batch["seeded"] == alone
    plain = LLMEngine(ModelConfig.from_dir(path), CacheConfig(4, 64), SchedulerConfig(2048, 64))
    assert sample_all(plain, [Request("plain", prompt, seeded)])["plain"] == alone


def test_a_draft_model_must_share_the_vocabulary(tiny_model, model_config):
    path, _ = tiny_model
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(model_config, CacheConfig(16, 8), SchedulerConfig(64, 4),
                  speculative_config=SpeculativeConfig("draft", draft_model=path))  # fmt: skip
    with pytest.raises(ValueError, match="draft-num-layers"):
        LLMEngine(ModelConfig.from_dir(path), CacheConfig(4, 8), SchedulerConfig(64, 4),
                  speculative_config=SpeculativeConfig("early-exit", draft_num_layers=2))  # fmt: skip
    with pytest.raises(ValueError, match="draft-model"):
        SpeculativeConfig("draft")
    for layers in (0, -1):  # (0 is not "unset")
        with pytest.raises(ValueError, match="draft-num-layers must be at least 1"):
            SpeculativeConfig("early-exit", draft_num_layers=layers)


def test_chi_square_helper_rejects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    samples = rng.choice(3, size=3000, p=p).tolist()
    assert chi_square_pvalue(samples, p) > 1e-3
    assert chi_square_pvalue(samples, np.array([0.4, 0.4, 0.2])) < 1e-6


def test_draft_length_adapts_and_large_batches_do_not_speculate(tiny_model):
    path, _ = tiny_model
    config = SpeculativeConfig("ngram", 4, disable_by_batch_size=2)
    engine = LLMEngine(ModelConfig.from_dir(path), CacheConfig(4, 64), SchedulerConfig(64, 8),
                       speculative_config=config)  # fmt: skip
    engine.drafter.proposer = FixedProposer([1, 2, 1, 2, 1, 2])

    def propose():
        engine.drafter.propose_drafts(engine.scheduler.running, engine.model_config.max_model_len)

    r = Request("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=20, temperature=0.0))
    engine.add_request(r)
    engine.add_request(Request("b", [3, 4, 5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0)))
    engine.step()  # the prompts and the first tokens (two running: the draft length adapts)
    propose()
    assert r.spec_window == 4 and len(r.spec_token_ids) == 4
    for num_drafts, num_accepted, window in ((4, 4, 4), (3, 1, 3), (2, 0, 2), (2, 0, 1), (3, 3, 3), (3, 0, 2),
                                             (2, 0, 1)):  # -1 on a rejection, +2 on none, at most 4
        engine.drafter.record(r, num_drafts, num_accepted)
        assert r.spec_window == window, (num_drafts, num_accepted, window)
    engine.drafter.record(r, 1, 0)  # rejected at length 1: it rests SPEC_REST_STEPS steps, then tries 1 again
    r.spec_token_ids = []
    for _ in range(SPEC_REST_STEPS - 1):
        propose()
        assert r.spec_token_ids == []
    propose()
    assert r.spec_window == 1 and len(r.spec_token_ids) == 1
    r.spec_token_ids = []
    engine.abort_request("b")  # alone in the batch: always the full draft length
    propose()
    assert r.spec_window == 4 and len(r.spec_token_ids) == 4
    r.spec_token_ids = []
    for i in range(2):  # three running requests: over disable_by_batch_size, no drafts for anyone
        engine.add_request(Request(f"c{i}", [1, 2, 1, 2, 1], SamplingParams(max_tokens=20, temperature=0.0)))
    engine.step()
    propose()
    assert len(engine.scheduler.running) == 3 and all(not q.spec_token_ids for q in engine.scheduler.running)


def _run_gate(gate: SpeculationGate, steps: int, rate_with, rate_without, batch_size=lambda step: 32) -> list[bool]:
    """Step the gate where a step with drafts emits rate_with(step) tokens per second and one without
    rate_without(step), at batch_size(step) requests."""
    choices = []
    for step in range(steps):
        batch = batch_size(step)
        speculated = gate.speculate(batch)
        gate.observe(batch, speculated, round(rate_with(step) if speculated else rate_without(step)), 1.0)
        choices.append(speculated)
    return choices


def test_speculation_gate_takes_the_faster_way_per_batch_size_and_keeps_measuring_the_other():
    gate = SpeculationGate()
    # batch 32: drafts lose (95 vs 100 tok/s, within 10%): it alternates to 3 pairs, then off but for one in 8
    choices = _run_gate(gate, 4 + 64, lambda s: 95, lambda s: 100)
    assert choices[:4] == [True, False, True, False]
    assert sum(choices[4:]) == 64 // 8
    assert gate.summary() == "batch 32-63: drafts 0.95x the tokens/s without"
    # batch 1 is another bucket: drafts win 2x there, so on, and the other way runs one step in 32
    choices = _run_gate(gate, 4 + 256, lambda s: 200, lambda s: 100, batch_size=lambda s: 1)
    assert choices[4:].count(False) == 256 // 32
    # when the traffic changes (drafts now win at batch 32), the explored steps turn the median over
    choices = _run_gate(gate, 100, lambda s: 150, lambda s: 100)
    assert choices[-30:].count(True) >= 29


def test_speculation_gate_compares_like_with_like_while_the_batch_drains():
    """Requests finish: the batch shrinks from 63 to 32 and every step gets slower. Drafts cost 5% at any moment;
    unpaired averages would favour whichever way was measured earlier, at the larger batches."""
    gate = SpeculationGate()
    batch = lambda s: 63 - s // 8  # noqa: E731
    choices = _run_gate(gate, 240, lambda s: 0.95 * 2 * batch(s), lambda s: 2 * batch(s), batch_size=batch)
    assert choices[40:].count(True) <= len(choices[40:]) // 8 + 1
    # one slow step (a pause, a descheduled thread) is one pair among seven: the median does not move
    gate.observe(32, True, 1, 1.0)
    assert gate.ratio(gate.bucket(32)) == pytest.approx(0.95, abs=0.01)


def test_early_exit_drafts_stop_when_they_cost_too_much(tiny_model):
    """A draft that makes steps slower than plain ones (here: the gate told so) proposes nothing but the
    gate's occasional measuring steps."""
    path, _ = tiny_model
    engine = LLMEngine(ModelConfig.from_dir(path), CacheConfig(4, 64), SchedulerConfig(64, 8),
                       speculative_config=SpeculativeConfig("early-exit", 2, draft_num_layers=1))  # fmt: skip
    r = Request("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=30, temperature=0.0))
    engine.add_request(r)
    engine.step()
    engine.drafter.propose_drafts(engine.scheduler.running, 64)
    assert r.spec_token_ids == [-1, -1]  # placeholders, filled in once the step is scheduled
    r.spec_token_ids = []
    gate = engine.drafter.gate
    for speculated in [True, False] * gate.MIN_PAIRS:
        gate.observe(1, speculated, 1, 0.03 if speculated else 0.01)  # with drafts: a third of the tokens/s
    proposed = []
    for _ in range(32):
        engine.drafter.propose_drafts(engine.scheduler.running, 64)
        proposed.append(len(r.spec_token_ids))
        r.spec_token_ids = []
    assert proposed == [0] * 31 + [2]  # one step in 32 measures the draft again
