"""What an instance of several ranks refuses at start, by name (docs/parallelism.md): shapes that do not split
(shared/parallel/layers.py check_tensor_parallel), and the engine features that do not run sharded yet."""
from __future__ import annotations

from tandem.shared.config import KVTierConfig, LoRAConfig, ModelConfig, SpeculativeConfig
from tandem.shared.parallel.layers import check_tensor_parallel


def check_tensor_parallel_features(model_config: ModelConfig, size: int,
                                   speculative_config: SpeculativeConfig | None, kv_tier_config: KVTierConfig | None,
                                   lora_config: LoRAConfig | None, model) -> None:
    """ValueError naming the first setting that --tensor-parallel-size size > 1 does not combine with."""
    check_tensor_parallel(model_config, size)
    refused = []
    if speculative_config is not None and speculative_config.method in ("draft", "early-exit"):
        refused.append(f"--speculative-method {speculative_config.method} (its drafts run the model outside the "
                       f"ranks' steps; ngram and suffix work)")
    if kv_tier_config is not None and kv_tier_config.enabled:
        refused.append("the KV tiers below the pool (--kv-host-tier-gib, --kv-disk-tier-dir)")
    if lora_config is not None:
        refused.append("LoRA adapters (--enable-lora, --lora-modules)")
    if model is not None:
        refused.append("a model object passed in (each rank loads its own from model_config)")
    if refused:
        raise ValueError(f"--tensor-parallel-size {size} does not run with {refused[0]}")
