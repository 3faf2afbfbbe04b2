"""Tensor parallelism over a loaded model (Megatron-LM's split, Shoeybi et al. 2019; vLLM's layer names): each
rank keeps its slice of every weight and the layers that must agree all-reduce.

- qkv_proj, gate_up_proj: column-parallel (ColumnParallelLinear): a rank keeps the output rows of its query heads
  and KV heads (a KV head replicated when there are fewer KV heads than ranks) and of its slice of the MLP.
- o_proj, down_proj: row-parallel (RowParallelLinear): a rank keeps the input columns of its heads / MLP slice;
  the partial outputs are summed by one all-reduce per attention and per MLP block, the bias added after it.
- embed_tokens: VocabParallelEmbedding (a rank's rows of the vocabulary, the others' tokens zero, one all-reduce);
  lm_head: ParallelLMHead (a rank's vocabulary rows; the logits all-gathered).
Float, INT8 and INT4 linears are sliced in place (quantized ones on group boundaries); a shape that does not
divide is refused with the layer named. The residual stream, norms and RoPE stay whole on every rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.shared.config import ModelConfig
from tandem.shared.parallel.group import TensorParallelGroup
from tandem.shared.quant.layers import ConcatLinear, WeightOnlyInt4Linear, WeightOnlyInt8Linear


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming the field when config's shapes do not split over size ranks (as vLLM refuses them):
    query heads and the MLP's width must divide by size; KV heads must divide by it, or divide it (replicated)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"--tensor-parallel-size {size}: num_attention_heads {heads} of {config.name} is not "
                         f"divisible by {size}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"--tensor-parallel-size {size}: num_key_value_heads {kv_heads} of {config.name} neither "
                         f"divides by {size} nor divides it (to be replicated)")
    if config.intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size}: intermediate_size {config.intermediate_size} of "
                         f"{config.name} is not divisible by {size}")


def num_kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    """KV heads each rank holds (and pages in its KV pool): its share, or 1 replicated when fewer than ranks."""
    return max(1, config.num_key_value_heads // size)


class RowParallelLinear(nn.Module):
    """A linear holding a slice of its input columns: y = all_reduce(x_slice @ W_slice.T) + bias."""

    def __init__(self, layer: nn.Module, bias: torch.Tensor | None, group: TensorParallelGroup):
        super().__init__()
        self.layer, self.group = layer, group
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.layer(x).contiguous())
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, end) of the vocabulary: tokens outside give zeros, and one all-reduce sums the
    ranks' rows (exactly one rank holds each token, so the sum is that row)."""

    def __init__(self, weight: torch.Tensor, start: int, group: TensorParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [end - start, hidden]
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(x * mine[:, None].to(x.dtype))


class ParallelLMHead(nn.Module):
    """The LM head's vocabulary rows [start, end) (a float or quantized linear): each rank's logits, padded to the
    largest shard, all-gathered in rank order and cut to the vocabulary."""

    def __init__(self, layer: nn.Module, shard: int, vocab_size: int, group: TensorParallelGroup):
        super().__init__()
        self.layer, self.shard, self.vocab_size, self.group = layer, shard, vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.layer(x)  # [T, end - start]
        if logits.shape[-1] < self.shard:
            logits = F.pad(logits, (0, self.shard - logits.shape[-1]))
        return self.group.all_gather(logits)[:, : self.vocab_size]


def shard_model(model: nn.Module, config: ModelConfig, group: TensorParallelGroup) -> None:
    """Slice a loaded model (shared/model.py load_model: fused qkv_proj / gate_up_proj) to this rank's shards in
    place. ValueError naming the layer when a quantized linear's groups do not split on a rank boundary, or for a
    layer kind that is not sharded (outlier-aware INT8, LoRA wrappers)."""
    rank, size = group.rank, group.size
    check_tensor_parallel(config, size)
    d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q_per_rank, kv_per_rank = heads // size, num_kv_heads_per_rank(config, size)
    q0 = rank * q_per_rank
    kv0 = q0 // (heads // kv_heads)  # the KV head of its first query head (GQA; replicated ones: shared)
    q_rows = torch.arange(q0 * d, (q0 + q_per_rank) * d)
    k_rows = heads * d + torch.arange(kv0 * d, (kv0 + kv_per_rank) * d)
    qkv_rows = torch.cat([q_rows, k_rows, k_rows + kv_heads * d])
    inter = config.intermediate_size
    i0, i1 = rank * inter // size, (rank + 1) * inter // size
    mlp_rows = torch.cat([torch.arange(i0, i1), inter + torch.arange(i0, i1)])
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = select_rows(attn.qkv_proj, qkv_rows, f"layers.{i}.self_attn.qkv_proj")
        attn.o_proj = row_parallel(attn.o_proj, q0 * d, (q0 + q_per_rank) * d, group, f"layers.{i}.self_attn.o_proj")
        attn.num_heads, attn.num_kv_heads = q_per_rank, kv_per_rank
        mlp.gate_up_proj = select_rows(mlp.gate_up_proj, mlp_rows, f"layers.{i}.mlp.gate_up_proj")
        mlp.down_proj = row_parallel(mlp.down_proj, i0, i1, group, f"layers.{i}.mlp.down_proj")
    vocab = config.vocab_size
    shard = -(-vocab // size)
    v0, v1 = min(rank * shard, vocab), min((rank + 1) * shard, vocab)
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight if isinstance(model.lm_head, nn.Linear) else False
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight.detach()[v0:v1].clone(), v0, group)
    head = select_rows(model.lm_head, torch.arange(v0, v1), "lm_head")
    if tied:  # (one tensor, as before)
        head.weight = model.model.embed_tokens.weight
    model.lm_head = ParallelLMHead(head, shard, vocab, group)


def select_rows(layer: nn.Module, rows: torch.Tensor, name: str) -> nn.Module:
    """Column-parallel: keep the output rows (features) `rows` of a float, INT8 or INT4 linear, or of each part of
    a ConcatLinear (rows are of the concatenated output). Returns the layer, changed in place."""
    if isinstance(layer, ConcatLinear):
        offset, parts = 0, []
        for part in layer.layers:
            mine = rows[(rows >= offset) & (rows < offset + part.out_features)] - offset
            parts.append(select_rows(part, mine, name))
            offset += part.out_features
        layer.layers = nn.ModuleList(parts)
        layer.out_features = len(rows)
        return layer
    _check_kind(layer, name)
    tensors = ("weight", "bias") if isinstance(layer, nn.Linear) else ("qweight", "scales", "zeros", "bias")
    for t in tensors:
        value = getattr(layer, t, None)
        if value is not None:
            _replace(layer, t, value.detach()[rows.to(value.device)].clone())
    layer.out_features = len(rows)
    return layer


def row_parallel(layer: nn.Module, k0: int, k1: int, group: TensorParallelGroup, name: str) -> RowParallelLinear:
    """Row-parallel: keep the input columns [k0, k1) of a float, INT8 or INT4 linear (quantized groups must not
    straddle k0 or k1: ValueError naming the layer), its bias moved after the all-reduce."""
    _check_kind(layer, name)
    if isinstance(layer, ConcatLinear):
        raise ValueError(f"{name}: a mixed-precision fused linear is not sharded over input columns")
    bias = layer.bias.detach().clone() if layer.bias is not None else None
    _replace(layer, "bias", None)
    if isinstance(layer, nn.Linear):
        _replace(layer, "weight", layer.weight.detach()[:, k0:k1].clone())
    else:
        group_size = layer.group_size  # (INT8 per channel: None)
        if isinstance(layer, WeightOnlyInt4Linear) and layer.padded_in_features != layer.in_features:
            raise ValueError(f"{name}: int4 group_size {group_size} does not divide in_features {layer.in_features}: "
                             f"its padded last group cannot be split over ranks")
        if group_size is not None and (k0 % group_size or k1 % group_size):
            raise ValueError(f"{name}: its {k1 - k0} input columns per rank (from {k0}) do not split on its "
                             f"quantization groups of {group_size}: refused with --tensor-parallel-size "
                             f"{group.size}")
        if isinstance(layer, WeightOnlyInt4Linear):
            _replace(layer, "qweight", layer.qweight[:, k0 // 2 : k1 // 2].clone())
        else:
            _replace(layer, "qweight", layer.qweight[:, k0:k1].clone())
        if group_size is not None:
            for t in ("scales", "zeros"):
                value = getattr(layer, t, None)
                if value is not None:
                    _replace(layer, t, value[:, k0 // group_size : k1 // group_size].clone())
    layer.in_features = k1 - k0
    return RowParallelLinear(layer, bias, group)


def _check_kind(layer: nn.Module, name: str) -> None:
    if isinstance(layer, ConcatLinear):
        return
    if not isinstance(layer, (nn.Linear, WeightOnlyInt8Linear, WeightOnlyInt4Linear)):
        raise ValueError(f"{name}: a {type(layer).__name__} is not sharded with --tensor-parallel-size > 1")
    if getattr(layer, "outlier_idx", None) is not None:
        raise ValueError(f"{name}: outlier-aware INT8 (float outlier columns) is not sharded with "
                         f"--tensor-parallel-size > 1")


def _replace(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set a parameter or buffer to a new tensor (a parameter stays one, frozen)."""
    if name in layer._parameters:
        layer._parameters[name] = None if value is None else nn.Parameter(value, requires_grad=False)
    else:
        layer._buffers[name] = value
