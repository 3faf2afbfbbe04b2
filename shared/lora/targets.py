"""The linears of the model a LoRA adapter adapts, named as the engine's model runs them: every decoder layer's
self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj and mlp.down_proj (shared/model.py fuses the checkpoint's
q/k/v and gate/up projections on load). A LoRATarget says which checkpoint projections (PEFT's module names) a
fused linear's output rows hold, in order, so an adapter of q_proj and v_proj lands in qkv_proj's q and v rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.config import ModelConfig

# the engine's linear -> the checkpoint projections its output rows hold, in order (shared/model.py's fusion)
FUSED_PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
               "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoRATarget:
    """One linear an adapter may adapt. name: its module name in the model ("model.layers.3.self_attn.qkv_proj");
    in_features: K; parts: (checkpoint projection, its out_features) in the order of the linear's output rows."""

    name: str
    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)

    def slot_rank(self, max_lora_rank: int) -> int:
        """The rank of this linear's slots: max_lora_rank per part (an adapter's part ranks stack along it)."""
        return max_lora_rank * len(self.parts)


def lora_targets(config: ModelConfig) -> dict[str, LoRATarget]:
    """Module name -> LoRATarget for every linear of every decoder layer of config's model, in model order."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"self_attn.qkv_proj": (hidden, (q, kv, kv)), "self_attn.o_proj": (q, (hidden,)),
              "mlp.gate_up_proj": (hidden, (inter, inter)), "mlp.down_proj": (inter, (hidden,))}
    targets = {}
    for layer in range(config.num_hidden_layers):
        for suffix, (k, outs) in shapes.items():
            name = f"model.layers.{layer}.{suffix}"
            targets[name] = LoRATarget(name, k, tuple(zip(FUSED_PARTS[suffix], outs)))
    return targets
