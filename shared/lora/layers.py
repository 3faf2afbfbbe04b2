"""LoRALinear: one of the model's linears with the LoRA deltas of a mixed-adapter batch added to its output, and
LoRAMetadata, the step's segments of rows per adapter slot (kernels/lora.py add_lora: Punica's SGMV layout).

The wrapper holds, per linear, the weights of the adapters the step runs in max_loras slots: lora_a [max_loras, R, K]
and lora_b [max_loras, N, R], R = max_lora_rank per fused part (an adapter of lower rank is zero-padded; the
scaling is folded into lora_b at load: shared/lora/peft.py). The base layer is any of the model's linears (float,
CpuDenseLinear, the quantized layers of shared/quant, a ConcatLinear of mixed formats): the delta is added to its
output. The model runner builds one LoRAMetadata per forward and passes it down explicitly (LlamaForCausalLM's
lora argument); without one (no request of the batch has an adapter) the wrapper costs one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels.lora import add_lora
from tandem.shared.device import use_triton
from tandem.shared.lora.targets import LoRATarget


@dataclass(frozen=True, slots=True)
class LoRAMetadata:
    """The rows of one forward's flat batch that carry an adapter: segment s is rows seg_starts[s] ..
    + seg_lens[s], adapter slot seg_slots[s] (all [S] int64, CPU). Rows in no segment are the base model's."""

    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor

    @classmethod
    def build(cls, query_start_loc: list[int], slots: list[int | None]) -> LoRAMetadata | None:
        """From the batch's sequences: sequence i is rows query_start_loc[i] .. query_start_loc[i + 1], with adapter
        slot slots[i] (None: the base model). Neighbouring sequences of one slot form one segment. None when no
        sequence has a slot."""
        starts, lens, seg_slots = [], [], []
        for i, slot in enumerate(slots):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if slot is None or end == start:
                continue
            if seg_slots and seg_slots[-1] == slot and starts[-1] + lens[-1] == start:
                lens[-1] += end - start
            else:
                starts.append(start)
                lens.append(end - start)
                seg_slots.append(slot)
        if not starts:
            return None
        return cls(*(torch.tensor(v, dtype=torch.int64) for v in (starts, lens, seg_slots)))


class LoRALinear(nn.Module):
    """base_layer's output plus, for the rows of each segment of a LoRAMetadata, the delta of that slot's adapter.
    Buffers lora_a [max_loras, R, K] and lora_b [max_loras, N, R] in dtype (zeros: an empty slot adds nothing)."""

    def __init__(self, base_layer: nn.Module, target: LoRATarget, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = target.in_features, target.out_features
        rank = target.slot_rank(max_lora_rank)
        self.register_buffer("lora_a", torch.zeros(max_loras, rank, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, rank, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, lora: LoRAMetadata | None = None) -> torch.Tensor:
        """x [T, K] -> y [T, N]."""
        y = self.base_layer(x)
        if lora is not None:  # (the Triton kernels where the engine's GPU path runs: shared/device.py)
            add_lora(y, x, self.lora_a, self.lora_b, lora.seg_starts, lora.seg_lens, lora.seg_slots,
                     use_triton=use_triton(x))
        return y

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (lora_a [r, K], lora_b [N, r]) for this linear into slot, zero-padded to the slot's rank
        (None: the adapter leaves this linear alone; the slot is zeroed)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            a, b = weights
            self.lora_a[slot, : a.shape[0]].copy_(a)
            self.lora_b[slot, :, : b.shape[1]].copy_(b)


def wrap_lora_linears(model: nn.Module, targets: dict[str, LoRATarget], max_loras: int, max_lora_rank: int,
                      dtype: torch.dtype, device: torch.device | str) -> dict[str, LoRALinear]:
    """Replace each target linear of model (by module name) by a LoRALinear around it, in place. Returns the
    wrappers by name. ValueError when the model lacks a target or its shape differs."""
    wrapped = {}
    for name, target in targets.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, attr, None)
        if base is None or (base.in_features, base.out_features) != (target.in_features, target.out_features):
            raise ValueError(f"the model's {name} is not the [{target.out_features}, {target.in_features}] linear "
                             "LoRA expects")
        wrapped[name] = LoRALinear(base, target, max_loras, max_lora_rank, dtype, device)
        setattr(parent, attr, wrapped[name])
    return wrapped
