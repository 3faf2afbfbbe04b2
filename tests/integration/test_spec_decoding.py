"""Speculative decoding with the real model and each proposer (n-gram; a draft model, an INT8 copy made here;
early exit; suffix decoding), fp32 greedy against HF transformers: in one engine (chunked prefill of a long prompt and
non-speculative requests in the same steps, preemption, aborts, stops inside an accepted run) and through a
whole cluster (stop strings, usage counts)."""
import grpc
import pytest

from tandem.services.client import generate, make_request, stream
from tandem.shared.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import FinishReason, Request, SamplingParams
from tests.integration.conftest import NUM_REFERENCE_TOKENS
from tests.integration.helpers import wait_all_blocks_free
from tests.prompts import PROMPTS, prompt_token_ids
from tandem.v1 import common_pb2

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
EARLY_EXIT_LAYERS = 8  # of 30: its drafts are rarely accepted (docs/speculative-decoding.md), but they run
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\ndef diagonal(width, height):\n    return (width ** 2 + height ** 2) ** 0.5\n")
EXTRA = [  # (name, kind, text): output that copies its prompt, and text that repeats itself
    ("code_edit", "chat", "Rewrite this code with `width` renamed to `w`. Reply with the code only.\n\n" + CODE),
    ("repeat", "raw", "one two three four, one two three four, one two three four, one two three four, one two"),
]


def greedy(n=NUM_REFERENCE_TOKENS, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def run(engine, requests):
    """Step to the end: {request id: the tokens of each step's output, as a list of chunks}."""
    for r in requests:
        engine.add_request(r)
    chunks = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                chunks[out.request_id].append(list(out.new_token_ids))
    return chunks


def flat(chunks):
    return [t for c in chunks for t in c]


@pytest.fixture(scope="module")
def int8_draft(int8_dir) -> str:
    """An INT8 (RTN, per channel) copy of the model: a separate draft checkpoint with the same tokenizer."""
    return str(int8_dir)


# (the draft model in one engine: .ci/run's heavy pass; make test runs it through a cluster, below, and in
# test_stop_token_and_max_tokens_inside_an_accepted_run)
@pytest.fixture(params=["ngram", pytest.param("draft", marks=pytest.mark.heavy), "early-exit", "suffix"])
def spec(request, int8_draft) -> SpeculativeConfig:
    # (the draft is not adaptive: on CPU an INT8 copy's token costs about a target's, and adaptive speculation
    # then stops proposing, docs/speculative-decoding.md)
    return {"ngram": NGRAM, "draft": SpeculativeConfig("draft", 4, adaptive=False, draft_model=int8_draft),
            "early-exit": SpeculativeConfig("early-exit", 4, draft_num_layers=EARLY_EXIT_LAYERS),
            "suffix": SpeculativeConfig("suffix")}[request.param]  # (up to 15 drafts: its default)


@pytest.fixture(scope="module")
def references(tokenizer, hf_greedy):
    """{name: (prompt ids, HF greedy tokens)} for the shared prompts and the copy-heavy ones."""
    return {name: (ids, hf_greedy(ids, NUM_REFERENCE_TOKENS))
            for name, kind, text in PROMPTS + EXTRA for ids in [prompt_token_ids(tokenizer, kind, text)]}  # fmt: skip


def test_greedy_equals_hf_beside_chunked_prefill_and_plain_requests(model_config, references, spec):
    engine = LLMEngine(model_config, CacheConfig(16, 256), SchedulerConfig(64, 16), speculative_config=spec)
    requests = [Request(name, ids, greedy(speculative=name != "haiku")) for name, (ids, _) in references.items()]
    chunks = run(engine, requests)  # the long prompt is prefilled 64 tokens a step while the others speculate
    for name, (_, expected) in references.items():
        assert flat(chunks[name]) == expected, name
    assert max(len(c) for c in chunks["haiku"]) == 1 and requests[1].num_draft_tokens == 0  # it opted out
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0
    if spec.method != "early-exit":
        code = requests[[r.request_id for r in requests].index("code_edit")]
        assert code.num_accepted_tokens > 0 and max(len(c) for c in chunks["code_edit"]) > 1
        assert stats.spec_num_accepted_tokens > 0 and stats.spec_mean_acceptance_length > 1
    assert engine.num_free_blocks == 256


HEAVY = pytest.mark.heavy


# (early exit and suffix in .ci/run's heavy pass: their drafts are verified by the same rejection sampler as n-gram's)
@pytest.mark.parametrize("spec", ["ngram", pytest.param("draft", marks=HEAVY), pytest.param("early-exit", marks=HEAVY),
                                  pytest.param("suffix", marks=HEAVY)], indirect=True)  # fmt: skip
def test_seeded_sampling_is_the_same_with_and_without_speculation(model_config, references, spec):
    names = ["code_edit", "capital", "repeat"]
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11)
    plain = run(LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8)),
                [Request("alone", references["code_edit"][0], params)])  # fmt: skip
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8), speculative_config=spec)
    requests = [Request(n, references[n][0], params) for n in names]
    chunks = run(engine, requests)
    assert flat(chunks["code_edit"]) == flat(plain["alone"])  # batched, speculating, or neither: one sample
    assert sum(r.num_draft_tokens for r in requests) > 0 and engine.num_free_blocks == 64


# (early exit in .ci/run's heavy pass: a preempted request's drafts are dropped alike for every proposer)
@pytest.mark.parametrize("spec", ["ngram", pytest.param("draft", marks=HEAVY), pytest.param("early-exit", marks=HEAVY),
                                  "suffix"], indirect=True)  # fmt: skip
def test_preemption_and_abort_while_speculating(model_config, references, spec):
    names = ["capital", "haiku", "raw_story", "raw_chinese", "repeat"]
    engine = LLMEngine(model_config, CacheConfig(8, 24), SchedulerConfig(32, 8), speculative_config=spec)
    requests = [Request(n, references[n][0], greedy()) for n in names]
    for r in requests:
        engine.add_request(r)
    outs, preempted = {n: [] for n in names}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        preempted += sum(r.num_computed_tokens == 0 and r.output_token_ids != [] for r in requests)
    assert preempted > 0, "the pool was meant to be too small for all five at once"
    for n in names:
        assert outs[n] == references[n][1], n
    assert engine.num_free_blocks == 24
    assert sum(r.num_draft_tokens for r in requests) > 0
    # aborted after a speculative step: every block back
    r = Request("abort-me", references["repeat"][0], greedy())
    engine.add_request(r)
    while r.num_draft_tokens == 0:
        engine.step()
    assert engine.abort_request("abort-me") and engine.num_free_blocks == 24


@pytest.mark.parametrize("spec", ["ngram", "draft", "suffix"], indirect=True)  # (early exit: too few accepted runs)
def test_stop_token_and_max_tokens_inside_an_accepted_run(model_config, references, spec):
    ids, expected = references["code_edit"]
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8), speculative_config=spec)
    chunks = run(engine, [Request("probe", ids, greedy())])["probe"]
    # a step that emitted several tokens, and one of them, not the last, seen nowhere before it
    position, stop_token = next((start + i, c[i]) for start, c in _starts(chunks) if len(c) >= 3
                                for i in range(len(c) - 1) if c[i] not in expected[: start + i])  # fmt: skip
    req = Request("stop", ids, greedy(stop_token_ids=(stop_token,)))
    out = run(engine, [req])["stop"]
    assert flat(out) == expected[: position + 1] and req.finish_reason == FinishReason.STOP
    assert req.num_accepted_tokens <= position  # drafts cut by the stop are not counted as accepted
    max_tokens = position + 1
    req = Request("length", ids, greedy(max_tokens))
    out = run(engine, [req])["length"]
    assert flat(out) == expected[:max_tokens] and req.finish_reason == FinishReason.LENGTH
    assert engine.num_free_blocks == 64


def test_suffix_decoding_drafts_a_repeated_request_from_its_cache_of_outputs(model_config, references):
    """A request asked again: the first answer is in the engine's cache of outputs, so suffix decoding drafts the
    second from it, nearly every draft accepted; both equal plain decoding and HF's. Not adaptive: the counts do
    not depend on the gate's timings."""
    ids, expected = references["raw_story"]
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8),
                       speculative_config=SpeculativeConfig("suffix", adaptive=False))  # fmt: skip
    first, again = Request("first", ids, greedy()), Request("again", ids, greedy())
    assert flat(run(engine, [first])["first"]) == expected
    chunks = run(engine, [again])["again"]
    plain = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8))
    assert flat(chunks) == flat(run(plain, [Request("plain", ids, greedy())])["plain"]) == expected
    # the match and the draft length double each step (max_spec_factor 1) up to 15 drafts: 1, 3, 7, 15, 15
    assert again.num_accepted_tokens >= 0.8 * len(expected) and again.num_accepted_tokens > first.num_accepted_tokens
    assert again.num_accepted_tokens >= 0.95 * again.num_draft_tokens
    assert len(chunks) <= 8 and max(map(len, chunks)) == 16
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == first.num_accepted_tokens + again.num_accepted_tokens
    assert engine.num_free_blocks == 64


def _starts(chunks):
    start = 0
    for c in chunks:
        yield start, c
        start += len(c)


# (early exit through a cluster: in .ci/run's heavy pass; make test runs it through test_architectures' clusters)
@pytest.fixture(scope="module", params=["ngram", "draft", pytest.param("early-exit", marks=pytest.mark.heavy)])
def spec_cluster(request, model_dir, int8_draft):
    from tandem.services.launcher import LocalCluster

    engine = ["--num-blocks", "256", "--threads", "1"]
    spec = ["--speculative-method", request.param, "--num-speculative-tokens", "4"]
    # (no adaptation for ngram and draft: their tests need drafts in every step, which the adaptive policy drops
    # at batch sizes where, on a loaded machine, it measured steps with drafts slower)
    spec += {"ngram": ["--no-speculative-adaptive"],
             "draft": ["--draft-model", int8_draft, "--no-speculative-adaptive"],
             "early-exit": ["--draft-num-layers", str(EARLY_EXIT_LAYERS)]}[request.param]  # fmt: skip
    with LocalCluster(str(model_dir), prefill_args=engine, decode_args=engine + spec) as cluster:
        cluster.method = request.param
        yield cluster


def test_cluster_greedy_equals_hf_and_reports_drafts(spec_cluster, references):
    from tests.integration.helpers import generate_all, greedy_request

    names = [name for name, _, _ in PROMPTS + EXTRA]
    kinds = {name: (kind, text) for name, kind, text in PROMPTS + EXTRA}
    outs = generate_all(spec_cluster.gateway_address,
                        [greedy_request(*kinds[n], NUM_REFERENCE_TOKENS) for n in names])  # fmt: skip
    for name, out in zip(names, outs):
        assert out.token_ids == references[name][1], name
        assert out.completion_tokens == len(out.token_ids)
    code = outs[names.index("code_edit")]
    assert code.num_draft_tokens > 0 and code.num_accepted_tokens <= code.num_draft_tokens
    if spec_cluster.method != "early-exit":
        assert code.num_accepted_tokens > 0
    wait_all_blocks_free(spec_cluster)


@pytest.mark.parametrize("spec_cluster", ["ngram", "draft"], indirect=True)
def test_cluster_stop_string_inside_an_accepted_run(spec_cluster, references, tokenizer):
    ids, expected = references["code_edit"]
    text = {name: text for name, _, text in EXTRA}["code_edit"]  # a chat prompt
    messages = [list(m.token_ids) for m in stream(spec_cluster.gateway_address, make_request(
        text, max_tokens=NUM_REFERENCE_TOKENS, temperature=0.0), timeout=300) if m.token_ids]  # fmt: skip
    assert flat(messages) == expected
    # the text a token adds, inside a message of several tokens, that appears nowhere before it
    for start, chunk in _starts(messages):
        if len(chunk) < 3:
            continue
        k = start + 1
        before = tokenizer.decode(expected[:k], skip_special_tokens=True)
        upto = tokenizer.decode(expected[: k + 1], skip_special_tokens=True)
        stop = upto[len(before):]
        if upto.startswith(before) and stop.strip() and stop not in before:
            break
    else:
        pytest.fail(f"no message of 3+ tokens with a fresh token text: {messages}")
    replies = list(stream(spec_cluster.gateway_address, make_request(
        text, max_tokens=NUM_REFERENCE_TOKENS, temperature=0.0, stop=[stop]), timeout=300))  # fmt: skip
    got = [t for m in replies for t in m.token_ids]
    assert got == expected[: k + 1], (stop, got)  # the token that completed the stop string, nothing after
    assert "".join(m.text for m in replies) == before
    usage = replies[-1].usage
    assert usage.completion_tokens == k + 1  # and the counts survive the early end of the stream:
    assert 0 < usage.num_accepted_tokens <= k and usage.num_accepted_tokens <= usage.num_draft_tokens
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    wait_all_blocks_free(spec_cluster)


def test_cluster_structured_output_with_speculation(spec_cluster, model_config, tokenizer):
    """Constrained requests (greedy and seeded, JSON and a regex) mixed with a plain one, through a speculating
    decode: the same tokens as a plain colocated engine (itself equal to HF under the grammar,
    test_structured_output.py), and the JSON validates."""
    from tests.integration.helpers import generate_all
    from tests.integration.test_structured_output import CASES, check_text, constrained_request, run_engine

    names = ["person", "colors", "date"]
    requests = [constrained_request(n) for n in names] + [constrained_request(n, temperature=1.0, seed=5)
                                                          for n in names]  # fmt: skip
    requests.append(make_request(EXTRA[0][2], max_tokens=NUM_REFERENCE_TOKENS, temperature=0.0))
    outs = generate_all(spec_cluster.gateway_address, requests)
    plain = run_engine(model_config, [
        Request(f"{n}-{i}", prompt_token_ids(tokenizer, "chat", CASES[n][0]), SamplingParams(
            max_tokens=r.sampling_params.max_tokens, temperature=r.sampling_params.temperature,
            seed=r.sampling_params.seed if r.sampling_params.HasField("seed") else None,
            structured_output=CASES[n][1]))
        for i, (n, r) in enumerate(zip(names * 2, requests))])  # fmt: skip
    for i, (name, out) in enumerate(zip(names * 2, outs)):
        assert out.token_ids == plain[f"{name}-{i}"], (name, i)
        if out.finish_reason == "stop":
            check_text(name, out.text)
    assert sum(o.num_draft_tokens for o in outs) > 0
    wait_all_blocks_free(spec_cluster)


def test_cluster_tool_calls_with_speculation_and_prefix_hits(spec_cluster, cluster):
    """A required tool call (its grammar built from the tools' schemas) through a speculating decode: the same
    tokens as on the plain test cluster, again with its prompt's blocks found in the prefix cache."""
    from tandem.v1 import gateway_pb2
    from tests.integration.test_tool_calling import grpc_tool_request

    request = grpc_tool_request(gateway_pb2.TOOL_CHOICE_REQUIRED)
    plain = generate(cluster.gateway_address, request, timeout=300)
    first, again = (generate(spec_cluster.gateway_address, request, timeout=300) for _ in range(2))
    assert plain.finish_reason == first.finish_reason == again.finish_reason == "tool_calls"
    assert first.token_ids == again.token_ids == plain.token_ids
    assert again.cached_tokens > 0 and first.num_draft_tokens + again.num_draft_tokens > 0


def test_bad_speculative_flags_are_refused(model_dir):
    from tandem.services.launcher import LocalCluster

    with pytest.raises((RuntimeError, grpc.RpcError), match="speculative|num_speculative_tokens"):
        LocalCluster(str(model_dir), decode_args=["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
                     prefill_args=["--threads", "1"]).start(timeout_s=120)  # fmt: skip
