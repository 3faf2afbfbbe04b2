"""Migration, engine side (issue 36): a request that arrives with the output another engine generated before it
failed (Request.output_token_ids, what the gateway sends after a decode died mid-stream) continues exactly as the
uninterrupted run. Both ways a migrated request re-enters are checked: computed on a decode (add_request, the
decode-local path) and computed on a prefill whose KV goes to a decode (reserve, import_kv, finish_kv_import),
for the state that counts generated tokens: seeded positions, penalties, min_tokens, max_tokens, structured
output (replayed through the grammar), logprobs and speculation. The cut points are the first token and the
middle. The uninterrupted run is the reference (its greedy tokens are checked against HF in test_engine.py); a
resumed run recomputes the output's KV in one prefill chunk where the original decoded it token by token, so
this also checks that the engine's arithmetic does not depend on how tokens are batched."""
import dataclasses
import json

import pytest

from tandem.shared.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.errors import InvalidRequestError
from tandem.shared.request import Request, SamplingParams, StructuredOutputParams
from tests.prompts import prompt_token_ids

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
PROMPTS = {"story": ("raw", "Once upon a time, in a small village by the mountains,"),
           "capital": ("chat", "What is the capital of France?"),
           "person": ("chat", "Describe a person as JSON with a name and an age.")}  # fmt: skip
# name -> (prompt, sampling parameters)
CASES = {
    "greedy": ("story", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
    "seeded": ("story", SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)),
    "penalties": ("story", SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.7,
                                          repetition_penalty=1.3, ignore_eos=True)),
    # (the answer ends with EOS after a few tokens unless min_tokens holds it back)
    "min_tokens": ("capital", SamplingParams(max_tokens=20, temperature=0.0, min_tokens=14)),
    "json": ("person", SamplingParams(max_tokens=40, temperature=0.0,
                                      structured_output=StructuredOutputParams(json=json.dumps(PERSON)))),
    "logprobs": ("story", SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)),
}  # fmt: skip


@pytest.fixture(scope="module")
def engines(model_config):
    """A decode-tier engine and a prefill-tier engine (export_kv), and a decode with n-gram speculation."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)
    return (LLMEngine(model_config, CacheConfig(16, 128), SchedulerConfig(256, 8)),
            LLMEngine(model_config, CacheConfig(16, 128), SchedulerConfig(256, 8), export_kv=True),
            LLMEngine(model_config, CacheConfig(16, 128), SchedulerConfig(256, 8), speculative_config=spec))


def run(engine, request: Request):
    """(new tokens, their logprobs, finish reason) of request run alone to its end."""
    engine.add_request(request)
    return drain(engine, request.request_id)


def drain(engine, request_id: str, tokens=(), logprobs=(), finish=None):
    tokens, logprobs = list(tokens), list(logprobs)
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == request_id and o.error is None, o
            tokens += o.new_token_ids
            logprobs += o.logprobs or []
            finish = o.finish_reason or finish
    return tokens, logprobs, finish


def through_prefill(prefill, decode, request_id, ids, params, output):
    """The prefill path as the tiers run it (services/prefill/server.py, services/decode/server.py): the prefill
    samples one token after prompt + output with max_tokens len(output) + 1; the decode reserves prompt + output."""
    prefill.add_request(Request(request_id, ids, dataclasses.replace(params, max_tokens=len(output) + 1),
                                output_token_ids=list(output)))  # fmt: skip
    decode.reserve(Request(request_id, ids, params, output_token_ids=list(output)))
    first, first_logprobs = None, []
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            if o.kv is not None:
                decode.import_kv(request_id, o.kv)
            if o.new_token_ids:
                first, first_logprobs = o.new_token_ids[0], o.logprobs or []
    done = decode.finish_kv_import(request_id, first)
    if done is not None:
        return [first], first_logprobs, done.finish_reason
    return drain(decode, request_id, [first], first_logprobs)


@pytest.mark.parametrize("case", list(CASES))
def test_a_migrated_request_continues_as_the_uninterrupted_run(engines, tokenizer, case):
    decode, prefill, _ = engines
    prompt, params = CASES[case]
    ids = prompt_token_ids(tokenizer, *PROMPTS[prompt])
    tokens, logprobs, finish = run(decode, Request(f"{case}-whole", ids, params))
    assert len(tokens) >= 8, tokens
    if case == "min_tokens":
        # (alone it answers in 8 tokens, EOS included: min_tokens holds EOS back past both cuts)
        eos = set(decode.model_config.eos_token_ids)
        assert len(tokens) > params.min_tokens and not eos & set(tokens[: params.min_tokens]), tokens
    if case == "json":
        json.loads(tokenizer.decode(tokens, skip_special_tokens=True))  # (complete before max_tokens)
    for cut in (1, len(tokens) // 2):
        for path in ("decode", "prefill"):
            rid = f"{case}-{path}-{cut}"
            if path == "decode":
                rest = run(decode, Request(rid, ids, params, output_token_ids=tokens[:cut]))
            else:
                rest = through_prefill(prefill, decode, rid, ids, params, tokens[:cut])
            assert rest[0] == tokens[cut:], (path, cut)
            assert rest[2] == finish, (path, cut)
            if params.logprobs is not None:
                assert [lp.token_id for lp in rest[1]] == tokens[cut:]
                for got, want in zip(rest[1], logprobs[cut:]):
                    assert got.rank == want.rank and abs(got.logprob - want.logprob) < 1e-4, (got, want)
                    assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert decode.num_free_blocks == decode.cache_config.num_blocks
    assert prefill.num_free_blocks == prefill.cache_config.num_blocks


def test_a_migrated_request_speculates_from_its_output(engines, tokenizer):
    """n-gram drafts come from prompt + output, the migrated output included: the continuation is the same and
    drafts are accepted after the seam."""
    *_, speculative = engines
    ids = prompt_token_ids(tokenizer, "raw", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens, _, finish = run(speculative, Request("spec-whole", ids, params))
    request = Request("spec-resumed", ids, params, output_token_ids=tokens[:10])
    assert run(speculative, request)[0] == tokens[10:]
    assert request.num_accepted_tokens > 0, "no draft accepted after the seam"


def test_a_migrated_request_that_cannot_continue_is_refused(engines, tokenizer):
    decode, *_ = engines
    ids = prompt_token_ids(tokenizer, *PROMPTS["person"])
    json_params = CASES["json"][1]
    for output, params, match in [
        ([5] * 20, SamplingParams(max_tokens=20), "max_tokens"),
        ([10**7], SamplingParams(max_tokens=20), "output token ids"),
        (tokenizer.encode("hello", add_special_tokens=False), json_params, r"output_token_ids\[0\]"),
        (tokenizer.encode('{"name": "A", "age": 3}', add_special_tokens=False) + [1], json_params,
         "completes the structured output"),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=match):
            decode.add_request(Request("bad", ids, params, output_token_ids=output))
        assert "bad" not in decode.requests
    assert decode.num_free_blocks == decode.cache_config.num_blocks
