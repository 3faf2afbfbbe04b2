"""Protobuf <-> engine records, in one place for every service."""
from __future__ import annotations

from shared.engine import EngineStats
from shared.request import FinishReason, SamplingParams
from tandem.v1 import common_pb2

FINISH_TO_PROTO = {reason: common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") for reason in FinishReason}


def sampling_params_from_proto(p: common_pb2.SamplingParams, **overrides) -> SamplingParams:
    """Proto -> engine SamplingParams: absent fields take SamplingParams' defaults, then overrides apply.
    InvalidRequestError (INVALID_ARGUMENT) on bad values."""
    values = {name: getattr(p, name) for name in ("max_tokens", "temperature", "top_k", "top_p", "seed")
              if p.HasField(name)}  # fmt: skip
    values.update(stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos)
    return SamplingParams(**(values | overrides))


def stats_to_proto(stats: EngineStats) -> common_pb2.InstanceLoad:
    return common_pb2.InstanceLoad(
        model_id=stats.model_id,
        block_size=stats.block_size,
        num_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_queued_tokens=stats.num_queued_tokens,
        num_cached_blocks=stats.num_cached_blocks,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_evictions=stats.num_evictions,
        num_blocks_exported=stats.num_blocks_exported,
        num_blocks_imported=stats.num_blocks_imported,
    )
