"""Protobuf <-> engine records, in one place for every service."""
from __future__ import annotations

from dataclasses import fields

from shared.engine import EngineStats
from shared.request import FinishReason, SamplingParams
from tandem.v1 import common_pb2

FINISH_TO_PROTO = {reason: common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") for reason in FinishReason}


def sampling_params_from_proto(p: common_pb2.SamplingParams, **overrides) -> SamplingParams:
    """Proto -> engine SamplingParams: absent fields take SamplingParams' defaults, then overrides apply.
    InvalidRequestError (INVALID_ARGUMENT) on bad values."""
    values = {name: getattr(p, name) for name in ("max_tokens", "temperature", "top_k", "top_p", "seed",
                                                  "speculative") if p.HasField(name)}  # fmt: skip
    values.update(stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos)
    return SamplingParams(**(values | overrides))


def stats_to_proto(stats: EngineStats) -> common_pb2.InstanceLoad:
    """EngineStats -> InstanceLoad: the proto has one field per EngineStats field, of the same name."""
    return common_pb2.InstanceLoad(**{f.name: getattr(stats, f.name) for f in fields(stats)})
