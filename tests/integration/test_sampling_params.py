"""Every sampling parameter of the public API, through the whole cluster (the first token is sampled on the
prefill, the rest on the decode): greedy outputs against HF transformers fp32 with the same parameter, seeded
sampled outputs against the same engine in one process (a colocated run), logprobs against HF's log_softmax,
and n completions sharing one prompt's KV. Each test fails if its parameter were ignored."""
import grpc
import pytest
import torch

from tandem.services.client import generate, make_request
from tandem.shared.config import CacheConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tandem.v1 import gateway_pb2, gateway_pb2_grpc
from tests.prompts import prompt_token_ids

CAPITAL = "What is the capital of France?"  # its greedy answer ends with EOS after 8 tokens
STORY = "Once upon a time, in a small village by the mountains,"


def request(text: str, raw: bool = False, **params) -> gateway_pb2.GenerateRequest:
    r = make_request(text, raw=raw)
    for name, value in params.items():
        if isinstance(value, list):
            getattr(r.sampling_params, name).extend(value)
        else:
            setattr(r.sampling_params, name, value)
    return r


def run(cluster, text: str, raw: bool = False, **params):
    return generate(cluster.gateway_address, request(text, raw, **params), timeout=300)


def hf_generate(hf_model, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


class OpenAIPenalties:
    """A reference written for this test from OpenAI's formula, as an HF logits processor: logit -= frequency *
    count + presence * (count > 0), counts over the generated tokens only."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float):
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            for token, count in zip(*torch.unique(ids[self.num_prompt_tokens :], return_counts=True)):
                scores[row, token] -= self.frequency * count + self.presence
        return scores


# (presence: in .ci/run's heavy pass; make test runs frequency, which goes through the same OpenAI penalty code)
@pytest.mark.parametrize("penalty", ["repetition_penalty", pytest.param("presence_penalty", marks=pytest.mark.heavy),
                                     "frequency_penalty"])
def test_greedy_penalties_equal_hf(cluster, tokenizer, hf_model, penalty):
    ids = prompt_token_ids(tokenizer, "raw", STORY)
    value = {"repetition_penalty": 1.5, "presence_penalty": 1.5, "frequency_penalty": 1.0}[penalty]
    if penalty == "repetition_penalty":
        expected = hf_generate(hf_model, ids, 32, repetition_penalty=value)
    else:
        from transformers import LogitsProcessorList

        processor = OpenAIPenalties(len(ids), value if penalty == "presence_penalty" else 0,
                                    value if penalty == "frequency_penalty" else 0)  # fmt: skip
        expected = hf_generate(hf_model, ids, 32, logits_processor=LogitsProcessorList([processor]))
    out = run(cluster, STORY, raw=True, max_tokens=32, temperature=0.0, **{penalty: value})
    assert out.token_ids == expected
    assert expected != hf_generate(hf_model, ids, 32), "the penalty must change this greedy output"


def test_min_tokens_holds_back_eos_as_hf_min_new_tokens(cluster, tokenizer, hf_model):
    ids = prompt_token_ids(tokenizer, "chat", CAPITAL)
    plain = run(cluster, CAPITAL, max_tokens=16, temperature=0.0)
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 12
    out = run(cluster, CAPITAL, max_tokens=16, temperature=0.0, min_tokens=12)
    assert out.token_ids == hf_generate(hf_model, ids, 16, min_new_tokens=12)
    assert len(out.token_ids) >= 12
    # min_tokens 1: the prefill's first token may not be EOS either (a stop id given as EOS's id here)
    eos = tokenizer.eos_token_id
    first = run(cluster, CAPITAL, max_tokens=4, temperature=0.0, stop_token_ids=[plain.token_ids[0]], min_tokens=1)
    assert first.token_ids[0] != plain.token_ids[0] and eos not in first.token_ids[:1]


def test_logprobs_equal_hf_log_softmax(cluster, tokenizer, hf_model):
    ids = prompt_token_ids(tokenizer, "chat", CAPITAL)
    out_msgs = list(_stream(cluster, request(CAPITAL, max_tokens=8, temperature=0.0, logprobs=5)))
    logprobs = [lp for m in out_msgs for lp in m.logprobs]
    tokens = [t for m in out_msgs for t in m.token_ids]
    assert len(logprobs) == len(tokens) == 8
    with torch.inference_mode():
        hf = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)  # fmt: skip
    for step, (lp, token) in enumerate(zip(logprobs, tokens)):
        reference = hf.logits[step][0].log_softmax(-1)
        assert lp.token_id == token and lp.rank == 1  # greedy: the most likely token
        assert lp.logprob == pytest.approx(float(reference[token]), abs=2e-3)
        top = reference.topk(5)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=2e-3)
    # absent: no logprobs at all
    assert not any(m.logprobs for m in _stream(cluster, request(CAPITAL, max_tokens=4, temperature=0.0)))


def test_prompt_logprobs_equal_hf_over_the_whole_prompt(cluster, tokenizer, hf_model):
    """Every prompt token after the first, computed on the prefill in several chunks (the prompt spans 64-token
    chunks) though its prefix is cached by then, against HF's log_softmax of one forward; once per prompt with n;
    over HTTP in vLLM's shape."""
    import openai

    text = STORY * 12
    ids = prompt_token_ids(tokenizer, "raw", text)
    assert len(ids) > 2 * 64
    run(cluster, text, raw=True, max_tokens=2, temperature=0.0)  # (its prefix is cached on both tiers now)
    msgs = list(_stream(cluster, request(text, raw=True, max_tokens=2, temperature=0.0, prompt_logprobs=3, n=2)))
    carrying = [m for m in msgs if m.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0].index == 0
    prompt_logprobs = carrying[0].prompt_logprobs
    with torch.inference_mode():
        reference = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert [lp.token_id for lp in prompt_logprobs] == ids[1:]
    for p, lp in enumerate(prompt_logprobs):  # (position p scores prompt token p + 1)
        assert lp.logprob == pytest.approx(float(reference[p, ids[p + 1]]), abs=2e-3)
        assert lp.rank == int((reference[p] > reference[p, ids[p + 1]]).sum()) + 1
        assert [t.token_id for t in lp.top] == reference[p].topk(3).indices.tolist()
    assert not any(m.prompt_logprobs for m in _stream(cluster, request(text, raw=True, max_tokens=2, temperature=0.0)))
    client = openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused")
    reply = client.completions.create(model="", prompt=ids, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 1})  # fmt: skip
    http = reply.choices[0].model_extra["prompt_logprobs"]
    assert http[0] is None and len(http) == len(ids)
    assert [float(http[p + 1][str(ids[p + 1])]["logprob"]) for p in range(len(ids) - 1)] == \
        pytest.approx([lp.logprob for lp in prompt_logprobs], abs=1e-5)


def test_deadline_ms_ends_the_stream_and_frees_both_tiers(cluster):
    """A request that would run for minutes (2,000 tokens, ignore_eos) with deadline_ms 1,500: DEADLINE_EXCEEDED
    long before it could finish, and every block free at once after; a priority is accepted on the way."""
    import time

    from tests.integration.helpers import wait_all_blocks_free

    r = request(STORY, raw=True, max_tokens=2000, temperature=0.0, ignore_eos=True)
    r.deadline_ms, r.priority = 1500, -3
    start = time.monotonic()
    received = []
    with pytest.raises(grpc.RpcError) as e:
        for msg in _stream(cluster, r):
            received += msg.token_ids
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(received) < 2000 and time.monotonic() - start < 60
    loads = wait_all_blocks_free(cluster, timeout_s=5)
    assert all(load.num_free_blocks == load.num_blocks for load in loads.values())
    r.deadline_ms = 0
    with pytest.raises(grpc.RpcError) as e:
        list(_stream(cluster, r))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline_ms" in e.value.details()


def test_logit_bias_equals_hf_sequence_bias(cluster, tokenizer, hf_model):
    ids = prompt_token_ids(tokenizer, "chat", CAPITAL)
    plain = run(cluster, CAPITAL, max_tokens=8, temperature=0.0).token_ids
    bias = {plain[0]: -100.0, plain[2]: -3.0}
    bias.setdefault(28, 2.5)
    r = request(CAPITAL, max_tokens=8, temperature=0.0)
    r.sampling_params.logit_bias.update(bias)
    got = generate(cluster.gateway_address, r, timeout=300).token_ids
    assert got[0] != plain[0]
    assert got == hf_generate(hf_model, ids, 8, sequence_bias={(t,): b for t, b in bias.items()})
    import openai

    client = openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused")
    reply = client.chat.completions.create(model="", messages=[{"role": "user", "content": CAPITAL}], max_tokens=8,
                                           temperature=0, logit_bias={str(t): b for t, b in bias.items()})
    assert reply.choices[0].message.content == generate(cluster.gateway_address, r, timeout=300).text


def test_min_p_one_keeps_only_the_top_token(cluster):
    greedy = run(cluster, STORY, raw=True, max_tokens=16, temperature=0.0)
    sampled = run(cluster, STORY, raw=True, max_tokens=16, temperature=1.5, seed=11)
    assert sampled.token_ids != greedy.token_ids, "this seed must sample away from greedy without min_p"
    assert run(cluster, STORY, raw=True, max_tokens=16, temperature=1.5, seed=11, min_p=1.0).token_ids == greedy.token_ids


def test_include_stop_str_in_output(cluster):
    plain = run(cluster, CAPITAL, max_tokens=16, temperature=0.0)
    assert "Paris" in plain.text
    cut = run(cluster, CAPITAL, max_tokens=16, temperature=0.0, stop=["Paris"])
    kept = run(cluster, CAPITAL, max_tokens=16, temperature=0.0, stop=["Paris"], include_stop_str_in_output=True)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + "Paris" == plain.text[: plain.text.index("Paris") + 5]


SEEDED_CASES = {
    "plain": {},
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 2.0},
    "repetition": {"repetition_penalty": 1.8},
    "min_tokens": {"min_tokens": 12},
    "min_p": {"min_p": 0.3},
    "top_k_top_p": {"top_k": 3, "top_p": 0.7},
    "logprobs": {"logprobs": 2},
}


@pytest.fixture(scope="module")
def colocated(model_config):
    """The same engine in this process: no tiers, no transfer (a colocated run)."""
    engine = LLMEngine(model_config, CacheConfig(block_size=16, num_blocks=256), SchedulerConfig(256, 8))

    def run_engine(ids: list[int], params: SamplingParams):
        engine.add_request(Request("colocated", ids, params))
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += o.new_token_ids
                logprobs += o.logprobs or []
        return tokens, logprobs

    return run_engine


@pytest.mark.parametrize("case", list(SEEDED_CASES))
def test_seeded_sampling_equals_a_colocated_run(cluster, tokenizer, colocated, case):
    """Each parameter means the same on the prefill (first token) as on the decode: the cluster's seeded
    output equals the in-process engine's, token for token (and logprob for logprob)."""
    # (min_tokens: CAPITAL's greedy answer ends early, where min_tokens holds EOS back; sampled ones run long)
    params = dict(SEEDED_CASES[case], max_tokens=24, temperature=0.0 if case == "min_tokens" else 1.0, seed=1234)
    kind, text = ("chat", CAPITAL) if case == "min_tokens" else ("raw", STORY)  # (CAPITAL's answer ends early)
    ids = prompt_token_ids(tokenizer, kind, text)
    tokens, logprobs = colocated(ids, SamplingParams(**params))
    msgs = list(_stream(cluster, request(text, raw=kind == "raw", **params)))
    assert [t for m in msgs for t in m.token_ids] == tokens
    if case == "logprobs":
        got = [lp for m in msgs for lp in m.logprobs]
        assert [lp.token_id for lp in got] == [lp.token_id for lp in logprobs] == tokens
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4)
        assert all(len(lp.top) == 2 for lp in got)
    if case not in ("plain", "logprobs"):
        plain, _ = colocated(ids, SamplingParams(**(params | {k: SamplingParams.__dataclass_fields__[k].default
                                                              for k in SEEDED_CASES[case]})))
        assert tokens != plain, f"{case} must change this seeded output"


def test_n_completions_share_the_prompt_kv(cluster, tokenizer):
    ids = prompt_token_ids(tokenizer, "raw", STORY * 3)
    msgs = list(_stream(cluster, request(STORY * 3, raw=True, max_tokens=8, temperature=1.0, seed=5, n=3)))
    finals = {m.index: m for m in msgs if m.HasField("finish_reason")}
    assert sorted(finals) == [0, 1, 2]
    texts = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in range(3)}
    assert len({tuple(t) for t in texts.values()}) == 3, "each completion samples with its own seed"
    full_blocks = (len(ids) - 1) // 16 * 16
    for i in (1, 2):  # computed on completion 0's decode from its cached blocks, not prefilled again (the prompt's
        # last partly filled block is a hit too once completion 0's output has filled it, which depends on timing)
        assert len(ids) - 1 >= finals[i].usage.cached_tokens >= full_blocks > 0
        assert finals[i].usage.completion_tokens == 8
    # completion 0 is the n = 1 request; the whole set is reproducible
    single = run(cluster, STORY * 3, raw=True, max_tokens=8, temperature=1.0, seed=5)
    assert single.token_ids == texts[0]
    again = list(_stream(cluster, request(STORY * 3, raw=True, max_tokens=8, temperature=1.0, seed=5, n=3)))
    assert {i: [t for m in again if m.index == i for t in m.token_ids] for i in range(3)} == texts


@pytest.mark.parametrize("field,value,words", [
    ("min_p", 1.5, "min_p"), ("presence_penalty", 3.0, "presence_penalty"), ("frequency_penalty", -2.5, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("min_tokens", -1, "min_tokens"), ("min_tokens", 99, "min_tokens"),
    ("logprobs", 21, "logprobs"), ("prompt_logprobs", -1, "prompt_logprobs"), ("n", 0, "n must"), ("n", 17, "n must"), ("stop_token_ids", [10**6], "stop_token_ids"),
])  # fmt: skip
def test_bad_parameters_are_invalid_argument_naming_the_field(cluster, field, value, words):
    with pytest.raises(grpc.RpcError) as e:
        run(cluster, CAPITAL, max_tokens=16, **{field: value})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()


def _stream(cluster, req):
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        yield from gateway_pb2_grpc.GatewayStub(channel).Generate(req, timeout=300)


def test_logprobs_and_min_tokens_with_speculation_equal_plain_and_penalties_do_not_speculate(model_config, tokenizer):
    """Speculative decoding (n-gram) keeps logprobs and min_tokens exactly as plain decoding; a request with
    penalties never speculates (its drafts would need a penalty state per position) and still decodes right."""
    from tandem.shared.config import SpeculativeConfig

    text = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
    ids = prompt_token_ids(tokenizer, "chat", text)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)

    def run_engine(speculative: bool, params: SamplingParams):
        engine = LLMEngine(model_config, CacheConfig(block_size=16, num_blocks=128), SchedulerConfig(256, 8),
                           speculative_config=spec if speculative else None)  # fmt: skip
        engine.add_request(Request("r", ids, params))
        tokens, logprobs, drafts = [], [], 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += o.new_token_ids
                logprobs += o.logprobs or []
                drafts += o.num_draft_tokens
        return tokens, logprobs, drafts

    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, min_tokens=24)
    plain, plain_logprobs, _ = run_engine(False, params)
    tokens, logprobs, drafts = run_engine(True, params)
    assert drafts > 0 and tokens == plain and len(tokens) == 24
    assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in logprobs] == \
        [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in plain_logprobs]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in plain_logprobs], abs=1e-4)
    penalized = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3)
    plain, _, _ = run_engine(False, penalized)
    tokens, _, drafts = run_engine(True, penalized)
    assert drafts == 0 and tokens == plain
