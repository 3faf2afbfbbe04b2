"""PEFT LoRA adapters of the tiny checkpoints (tests/tiny_models.py), written in the test by PEFT itself (random
lora_A and lora_B: init_lora_weights=False; save_pretrained, no download), and the HF + PEFT references the
engine's LoRA tests compare with. Three adapters of different ranks and targets: q/v by a regex, every linear
with rsLoRA and rank/alpha patterns, the MLP and o_proj of layer 1 only."""
from __future__ import annotations

from pathlib import Path

import torch

# name -> LoraConfig arguments. Phi-3's checkpoints fuse q/k/v and gate/up: its adapters name qkv_proj, gate_up_proj.
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=r".*\.(q_proj|v_proj)"),
    "all": dict(r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear", rank_pattern={"down_proj": 2},
                alpha_pattern={"o_proj": 3}),
    "mlp": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "o_proj"], layers_to_transform=[1]),
}
PHI3_TARGETS = {"attn": r".*\.qkv_proj", "mlp": ["gate_up_proj", "o_proj"]}


def hf_base(path: Path):
    """The checkpoint in HF transformers, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_adapter(base_dir: Path, out: Path, seed: int, **lora_args) -> Path:
    """A PEFT LoRA adapter of the checkpoint in base_dir with random weights (seeded), saved to out."""
    from peft import LoraConfig, get_peft_model

    model = hf_base(base_dir)
    torch.manual_seed(seed)
    get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_args)).save_pretrained(out)
    return out


def save_adapters(base_dir: Path, out: Path, phi3: bool = False) -> dict[str, Path]:
    """ADAPTERS of the checkpoint in base_dir, each in out/<name>; phi3: with Phi-3's fused module names."""
    paths = {}
    for i, (name, args) in enumerate(ADAPTERS.items()):
        if phi3 and name in PHI3_TARGETS:
            args = args | {"target_modules": PHI3_TARGETS[name]}
        paths[name] = save_adapter(base_dir, out / name, 100 + i, **args)
    return paths


def hf_peft(base_dir: Path, adapter_dir: Path | None):
    """HF + PEFT: the base model with the adapter (None: the base model alone), fp32."""
    from peft import PeftModel

    model = hf_base(base_dir)
    return model if adapter_dir is None else PeftModel.from_pretrained(model, adapter_dir).eval()
