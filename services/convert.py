"""Protobuf <-> engine records, in one place for every service."""
from __future__ import annotations

from dataclasses import fields

from tandem.shared.engine_stats import EngineStats
from tandem.shared.errors import InvalidRequestError
from tandem.shared.request import FinishReason, SamplingParams, StructuredOutputParams
from tandem.shared.request import TokenLogprobs
from tandem.v1 import common_pb2

# The proto's optional scalar fields that map one to one onto SamplingParams.
OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "speculative", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "prompt_logprobs")
FINISH_TO_PROTO = {reason: common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") for reason in FinishReason}


def sampling_params_from_proto(p: common_pb2.SamplingParams, **overrides) -> SamplingParams:
    """Proto -> engine SamplingParams: absent fields take SamplingParams' defaults, then overrides apply.
    InvalidRequestError (INVALID_ARGUMENT) on bad values."""
    values = {name: getattr(p, name) for name in OPTIONAL_FIELDS if p.HasField(name)}
    values.update(stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
                  logit_bias=tuple(sorted(p.logit_bias.items())))
    if p.HasField("structured_output"):
        values["structured_output"] = structured_output_from_proto(p.structured_output)
    return SamplingParams(**(values | overrides))


def structured_output_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutputParams:
    """InvalidRequestError when no kind is set (or a kind's value is empty)."""
    kind = p.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output must set one of json_schema, json_object, regex, choice, grammar")
    if kind == "choice":
        return StructuredOutputParams(choice=tuple(p.choice.choices))
    if kind == "json_object":
        return StructuredOutputParams(json_object=p.json_object or None)
    return StructuredOutputParams(**{"json" if kind == "json_schema" else kind: getattr(p, kind)})


def logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=logprobs.token_id, logprob=logprobs.logprob, rank=logprobs.rank,
                                    top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top])


def stats_to_proto(stats: EngineStats) -> common_pb2.InstanceLoad:
    """EngineStats -> InstanceLoad: the proto has one field per EngineStats field, of the same name."""
    return common_pb2.InstanceLoad(**{f.name: getattr(stats, f.name) for f in fields(stats)})
