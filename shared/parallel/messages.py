"""The typed messages rank 0 sends the other ranks of a tensor-parallel instance (one pipe each,
shared/parallel/group.py): WorkerInit once, then a StepInput per forward, and Shutdown. Pickled, and read back by
an unpickler that admits only these classes and the config records they carry (never a callable)."""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

from tandem.shared.config import CacheConfig, ModelConfig


@dataclass(frozen=True, slots=True)
class WorkerInit:
    """What a rank > 0 needs to build its ModelRunner: the model and the KV pool (num_blocks may still be None:
    rank 0 resolves it after loading and sends the resolved CacheConfig next)."""

    model_config: ModelConfig
    cache_config: CacheConfig


@dataclass(frozen=True, slots=True)
class StepInput:
    """One forward of the model runner (shared/model_runner.py run_model's arguments): block copies first, then
    per sequence (token_ids, start, block_table, num_logits); rope_long per sequence or None; pooled: indices of
    the sequences whose final hidden state is wanted, or None. Every rank runs it on its own shards and KV pool."""

    block_copies: list[tuple[int, int]]
    seqs: list[tuple[list[int], int, list[int | None], int]]
    rope_long: list[bool] | None
    pooled: list[int] | None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The instance stops: a rank > 0 exits 0."""


_ALLOWED = {(__name__, "WorkerInit"), (__name__, "StepInput"), (__name__, "Shutdown"),
            ("tandem.shared.config", "ModelConfig"), ("tandem.shared.config", "CacheConfig")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a tensor-parallel message")
        return super().find_class(module, name)


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


__all__ = ["CacheConfig", "ModelConfig", "Shutdown", "StepInput", "WorkerInit", "decode", "encode"]
