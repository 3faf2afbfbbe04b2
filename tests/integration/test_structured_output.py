"""Structured output (JSON schema, json_object, regex, choice, Lark grammar) through the whole cluster: the first
token sampled on the prefill under the grammar, the rest on the decode from the same grammar state. Greedy
outputs equal HF transformers fp32 under llguidance's own mask (tests.integration.helpers.hf_constrained), token
for token, in a batch mixed with unconstrained requests; JSON outputs parse and validate against their schema;
seeded sampled outputs equal a colocated run; speculative decoding (n-gram and a draft) changes nothing; bad
constraints are INVALID_ARGUMENT / HTTP 400 naming the field."""
import json
import re

import grpc
import jsonschema
import pytest

from tandem.services.client import generate, make_request
from tandem.shared.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams, StructuredOutputParams
from tandem.shared.structured_output import grammar_for
from tandem.v1 import common_pb2
from tests.integration.helpers import generate_all, hf_constrained, wait_all_blocks_free
from tests.prompts import prompt_token_ids

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}  # fmt: skip
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "minItems": 2,
                                                      "maxItems": 3}}, "required": ["colors"]}  # fmt: skip
VERDICT = {"type": "object", "properties": {"answer": {"type": "boolean"},
                                            "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
           "required": ["answer", "confidence"]}  # fmt: skip
ARITHMETIC = '''start: expr
expr: term (("+" | "-") term)*
term: NUMBER
NUMBER: /[0-9]{1,3}/
'''
# (prompt, constraint): several kinds and schemas
CASES = {
    "person": ("Describe a person as JSON with a name, an age and a city.", StructuredOutputParams(json=json.dumps(PERSON))),
    "colors": ("List a few colors of the rainbow as JSON.", StructuredOutputParams(json=json.dumps(COLORS))),
    "verdict": ("Is the sky blue? Answer as JSON with your confidence.", StructuredOutputParams(json=json.dumps(VERDICT))),
    "object": ("Give me a small JSON object with a cat's name and age.", StructuredOutputParams(json_object=True)),
    "date": ("When did the French revolution start? Give the date.", StructuredOutputParams(regex=r"\d{4}-\d{2}-\d{2}")),
    "choice": ("Is Paris in France? Answer yes or no.", StructuredOutputParams(choice=("yes", "no", 'it "depends"'))),
    "sum": ("Write a sum of three small numbers.", StructuredOutputParams(grammar=ARITHMETIC)),
}  # fmt: skip
SCHEMAS = {"person": PERSON, "colors": COLORS, "verdict": VERDICT, "object": {"type": "object"}}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def references(hf_model, model_config, tokenizer):
    """{case: (prompt ids, HF greedy tokens under the case's grammar)}."""
    refs = {}
    for name, (text, constraint) in CASES.items():
        ids = prompt_token_ids(tokenizer, "chat", text)
        refs[name] = (ids, hf_constrained(hf_model, model_config, ids, grammar_for(constraint), MAX_TOKENS))
    return refs


def to_proto(constraint: StructuredOutputParams) -> common_pb2.StructuredOutput:
    if constraint.choice is not None:
        return common_pb2.StructuredOutput(choice=common_pb2.StructuredOutput.Choices(choices=constraint.choice))
    if constraint.json is not None:
        return common_pb2.StructuredOutput(json_schema=constraint.json)
    if constraint.json_object:
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(regex=constraint.regex) if constraint.regex is not None else \
        common_pb2.StructuredOutput(grammar=constraint.grammar)


def constrained_request(name: str, **params):
    text, constraint = CASES[name]
    r = make_request(text, max_tokens=MAX_TOKENS, **({"temperature": 0.0} | params))
    r.sampling_params.structured_output.CopyFrom(to_proto(constraint))
    return r


def check_text(name: str, text: str) -> None:
    """The text satisfies the case's constraint (parsed and validated, not only masked)."""
    constraint = CASES[name][1]
    if name in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice
    else:
        assert re.fullmatch(r"[0-9]{1,3}([+-][0-9]{1,3})*", text), text


def test_references_are_constrained(references, tokenizer):
    for name, (_, tokens) in references.items():  # (the oracle itself obeys the grammars, and completes them)
        assert len(tokens) < MAX_TOKENS, name
        check_text(name, tokenizer.decode(tokens, skip_special_tokens=True))


def test_cluster_equals_hf_under_the_grammar_in_a_mixed_batch(cluster, references, hf_references):
    names = list(CASES)
    plain = ["capital", "haiku"]
    requests = [constrained_request(n) for n in names]
    requests += [make_request(t, raw=k == "raw", max_tokens=48, temperature=0.0) for n, k, t in _prompts(plain)]
    outs = generate_all(cluster.gateway_address, requests)
    for name, out in zip(names, outs):
        assert out.token_ids == references[name][1], name
        assert out.finish_reason == "stop", name
        check_text(name, out.text)
    for name, out in zip(plain, outs[len(names):]):
        assert out.token_ids == hf_references[name][1], name
    wait_all_blocks_free(cluster)


def _prompts(names):
    from tests.prompts import PROMPTS

    return [p for p in PROMPTS if p[0] in names]


def run_engine(model_config, requests: list[Request], spec: SpeculativeConfig | None = None) -> dict[str, list[int]]:
    engine = LLMEngine(model_config, CacheConfig(16, 256), SchedulerConfig(256, 16), speculative_config=spec)
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == 256
    return {r.request_id: r.output_token_ids for r in requests}


def test_seeded_sampling_under_a_grammar_equals_a_colocated_run(cluster, model_config, tokenizer):
    outs = generate_all(cluster.gateway_address, [constrained_request(n, temperature=1.0, seed=7 + i)
                                                  for i, n in enumerate(CASES)])  # fmt: skip
    requests = [Request(n, prompt_token_ids(tokenizer, "chat", CASES[n][0]),
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7 + i, structured_output=CASES[n][1]))
                for i, n in enumerate(CASES)]  # fmt: skip
    colocated = run_engine(model_config, requests)
    for name, out in zip(CASES, outs):
        assert out.token_ids == colocated[name], name
        if out.finish_reason == "stop":
            check_text(name, out.text)


def greedy_seeded_and_sampled(references) -> list[Request]:
    """For each case: a greedy, a seeded and an unseeded request under its grammar."""
    out = []
    for name, (ids, _) in references.items():
        constraint = CASES[name][1]
        out.append(Request(name, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                     structured_output=constraint)))  # fmt: skip
        out.append(Request(name + "-seeded", ids, SamplingParams(max_tokens=MAX_TOKENS, seed=3,
                                                                 structured_output=constraint)))  # fmt: skip
        out.append(Request(name + "-sampled", ids, SamplingParams(max_tokens=MAX_TOKENS,
                                                                  structured_output=constraint)))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def plain_outputs(model_config, references):
    """greedy_seeded_and_sampled run without speculation (one run for every method below)."""
    return run_engine(model_config, greedy_seeded_and_sampled(references))


# (early exit: .ci/run's heavy pass; make test verifies a draft model's drafts under the mask through a cluster,
# test_spec_decoding.py test_cluster_structured_output_with_speculation)
@pytest.mark.parametrize("method", ["ngram", pytest.param("early-exit", marks=pytest.mark.heavy)])
def test_speculative_decoding_keeps_constrained_outputs(model_config, tokenizer, references, plain_outputs, method):
    """Greedy and seeded outputs with drafts (n-gram: truncated to what the grammar allows; early exit: a draft
    model's sampled drafts, verified under the mask) equal plain decoding; unseeded samples still validate."""
    spec = SpeculativeConfig(method, num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
                             draft_num_layers=8 if method == "early-exit" else None, adaptive=False)  # fmt: skip
    plain = plain_outputs
    spec_requests = greedy_seeded_and_sampled(references)
    speculative = run_engine(model_config, spec_requests, spec)
    for name, (_, tokens) in references.items():
        assert speculative[name] == tokens == plain[name], name
        assert speculative[name + "-seeded"] == plain[name + "-seeded"], name
    for r in spec_requests:
        if r.finish_reason.value == "stop":
            check_text(r.request_id.split("-")[0], tokenizer.decode(r.output_token_ids, skip_special_tokens=True))
    assert sum(r.num_draft_tokens for r in spec_requests) > 0


@pytest.mark.parametrize("constraint, words", [
    (common_pb2.StructuredOutput(), "structured_output must set one of"),
    (common_pb2.StructuredOutput(json_schema="{not json"), "structured_output.json is not valid JSON"),
    (common_pb2.StructuredOutput(json_schema="[1]"), "structured_output.json must be a JSON schema object"),
    (common_pb2.StructuredOutput(json_schema='{"type": "foo"}'), "structured_output"),
    (common_pb2.StructuredOutput(regex="[0-9"), "structured_output"),
    (common_pb2.StructuredOutput(grammar="start: undefined_rule"), "structured_output"),
    (common_pb2.StructuredOutput(regex="a[^\\x00-\\U0010FFFF]"), "structured_output: the constraint matches no text"),
    (common_pb2.StructuredOutput(choice=common_pb2.StructuredOutput.Choices()), "structured_output.choice"),
    (common_pb2.StructuredOutput(choice=common_pb2.StructuredOutput.Choices(choices=["a", ""])),
     "structured_output.choice"),
])  # fmt: skip
def test_bad_constraints_are_invalid_argument(cluster, constraint, words):
    r = make_request("Hello", max_tokens=8, temperature=0.0)
    r.sampling_params.structured_output.CopyFrom(constraint)
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.gateway_address, r, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()


def test_decode_refuses_a_first_token_the_grammar_refuses(model_config, tokenizer):
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8))
    ids = prompt_token_ids(tokenizer, "chat", "Answer yes or no.")
    engine.reserve(Request("r", ids, SamplingParams(max_tokens=8, structured_output=StructuredOutputParams(
        choice=("yes", "no")))))  # fmt: skip
    with pytest.raises(Exception, match="violates the request's structured_output"):
        engine.finish_kv_import("r", tokenizer.encode("maybe")[0])
    engine.abort_request("r")
    assert engine.num_free_blocks == 64


def test_openai_response_format_and_structured_outputs(cluster, references):
    """The official client: response_format json_schema equals the gRPC greedy answer and validates; vLLM's
    structured_outputs choice and regex hold; a bad schema is a 400 naming response_format."""
    import openai

    client = openai.OpenAI(base_url=cluster.openai_base_url, api_key="unused")
    text, constraint = CASES["person"]
    reply = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": text}], max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    content = reply.choices[0].message.content
    jsonschema.validate(json.loads(content), PERSON)
    assert reply.usage.completion_tokens == len(references["person"][1])
    assert reply.choices[0].finish_reason == "stop"
    reply = client.chat.completions.create(model="", messages=[{"role": "user", "content": CASES["choice"][0]}],
                                           max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].message.content in ("yes", "no")
    reply = client.completions.create(model="", prompt="The year the Eiffel tower opened:", max_tokens=8,
                                      temperature=0, extra_body={"structured_outputs": {"regex": r" \d{4}"}})
    assert re.fullmatch(r" \d{4}", reply.choices[0].text)
    reply = client.chat.completions.create(model="", messages=[{"role": "user", "content": CASES["object"][0]}],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    assert e.value.body["param"] == "response_format" and "structured_output" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.body["param"] == "structured_outputs"
    wait_all_blocks_free(cluster)


def test_a_grammar_past_llguidance_limits_fails_alone(model_config, tokenizer, references):
    """A Lark alternation of 2,500 strings compiles but breaks llguidance's row limit once decoding: that request ends
    ABORT with the error (marked as the request's fault), and the request batched with it still equals HF."""
    engine = LLMEngine(model_config, CacheConfig(16, 256), SchedulerConfig(256, 16))
    ids, expected = references["person"]
    engine.add_request(Request("plain", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                            structured_output=CASES["person"][1])))  # fmt: skip
    engine.add_request(Request("huge", prompt_token_ids(tokenizer, "chat", "Pick a number."), SamplingParams(
        max_tokens=8, temperature=0.0, structured_output=StructuredOutputParams(
            grammar="start: " + " | ".join(f'"{i}"' for i in range(2500))))))
    outs, errors = {"plain": [], "huge": []}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                errors[o.request_id] = (o.error, o.error_is_invalid_request)
    assert outs["plain"] == expected and errors["plain"] == (None, False)
    assert errors["huge"][0] and "structured_output" in errors["huge"][0]
    assert errors["huge"][1]  # the request's fault: INVALID_ARGUMENT to the client, not INTERNAL
    assert engine.num_free_blocks == 256
