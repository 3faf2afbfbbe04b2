"""Tiny LoRA adapters of the default model made offline with PEFT (random weights: init_lora_weights=False), and
their reference: HF transformers + PEFT in fp32, greedy."""
from __future__ import annotations

import torch

# (name, target modules, rank): one adapter of the attention's q and v, one of every other projection
ADAPTERS = (("sql", ("q_proj", "v_proj"), 8), ("poet", ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 4))


def make_adapters(model_dir, out_dir, specs=ADAPTERS) -> dict[str, str]:
    """{name: PEFT directory} of each (name, target modules, rank) of specs, written under out_dir (seeded: the same
    weights on every run; lora_alpha 4r)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for seed, (name, targets, rank) in enumerate(specs):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=4 * rank, target_modules=list(targets), init_lora_weights=False)
        path = out_dir / name
        get_peft_model(model, config).save_pretrained(path)
        paths[name] = str(path)
    return paths


class PeftReference:
    """greedy(adapter name or None, prompt ids, n): HF transformers + PEFT (PeftModel.from_pretrained) fp32 greedy
    tokens (at most n, ending at EOS), on a model of its own (the session's hf_model stays unadapted)."""

    def __init__(self, model_dir, paths: dict[str, str]):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        names = list(paths)
        self.model = PeftModel.from_pretrained(base, paths[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(paths[name], adapter_name=name)

    def greedy(self, name: str | None, ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            if name is None:
                with self.model.disable_adapter():
                    out = self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
            else:
                self.model.set_adapter(name)
                out = self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        return out[0, len(ids) :].tolist()
