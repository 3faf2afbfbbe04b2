"""EngineArgs: every engine setting a user gives (flags, environment, `tandem up`), its default, and how it
resolves into the records an LLMEngine takes (shared/config.py: ModelConfig, CacheConfig, SchedulerConfig,
SpeculativeConfig, KVTierConfig, LoRAConfig), as vLLM's EngineArgs builds its configs. services/flags.py makes the
command-line flags from its fields.

Imports neither torch nor the engine, so the `tandem` CLI can build its parser quickly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tandem.shared.config import (AUTO, DTYPES, KV_DTYPES, KV_TIER_EVICTION_POLICIES, NO_QUANTIZATION,
                                  SPECULATIVE_METHODS, CacheConfig, KVTierConfig, LoRAConfig, ModelConfig,
                                  ParallelConfig, SchedulerConfig, SpeculativeConfig)
from tandem.shared.utils import usable_cpus

GIB = 1 << 30


def positive_number(value: str) -> float:
    """A flag's type: a number above 0 (float flags are otherwise fractions in (0, 1])."""
    number = float(value)
    if not number > 0:
        raise ValueError(value)
    return number


def non_negative_number(value: str) -> float:
    """A flag's type: a number of 0 or more (a size where 0 means off)."""
    number = float(value)
    if not 0 <= number < math.inf:
        raise ValueError(value)
    return number


def lora_module(value: str) -> str:
    """A flag's type: a --lora-modules item, NAME=PATH (ValueError otherwise)."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(value)
    return value


def _setting(default, help: str, kind: type | None = None, choices=None, group: str = "engine",
             aliases: tuple[str, ...] = (), nargs: str | None = None):
    """A field of EngineArgs: its default and what the flag built from it says (services/flags.py). kind: the
    flag's type when the default is None; group: "model" for the settings the gateway needs too; aliases: other
    names the flag also answers to (another engine's name for it); nargs "+": a flag of one or more values (a tuple;
    its environment variable separates them by whitespace)."""
    metadata = {"help": help, "type": kind or type(default), "choices": choices, "group": group, "aliases": aliases,
                "nargs": nargs}
    return field(default=default, metadata=metadata)


# The settings whose default depends on the tier; everything else has one default for both, in EngineArgs.
TIER_DEFAULTS = {
    "prefill": {"num_blocks": 1024, "max_num_batched_tokens": 512},
    "decode": {"num_blocks": 2048, "max_num_batched_tokens": 256},
}


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting and its default, in one place (as vLLM's EngineArgs, nano-vllm's Config).

    services/flags.py makes one command-line flag per field (--block-size for block_size), for the engine
    services and `tandem up`; a field with env reads that variable (shared/envs.py) when the flag is absent.
    None for num_blocks / max_num_batched_tokens means the tier's default (TIER_DEFAULTS), for kernel_threads every CPU
    this process may run on. A test checks that
    the defaults the README and the protos document equal these.
    """

    model: str | None = _setting(None, "HF safetensors dir of a served architecture (default: the converted "
                                       "SmolLM2)", str,
                                 group="model")
    quantization: str | None = _setting(
        None, "quantized checkpoint holding every weight, run with --model's architecture and tokenizer: a "
        "`tandem quantize` / HF AWQ / HF GPTQ dir, a .gguf file, 'gguf' for the packaged Q4_1 GGUF, or 'none' "
        "for --model's own weights (default: 'gguf' for the packaged model, whose converted fp32 dir is only "
        "that GGUF dequantized; none otherwise; all tiers must agree)", str, group="model")
    dtype: str = _setting(AUTO, "float type of weights and activations (part of the model id); auto: the "
                          "checkpoint's torch_dtype (float32 for quantized weights)", choices=(AUTO, *DTYPES),
                          group="model")
    device: str = _setting("cpu", "cpu or cuda (CUDA runs the Triton kernels)", choices=("cpu", "cuda"))
    block_size: int = _setting(16, "tokens per KV block (part of the prefix-cache hash contract: the gateway's "
                               "must equal the instances')", group="model")
    num_blocks: int | None = _setting(None, "KV blocks in the pool", int)
    memory_utilization: float | None = _setting(
        None, "size the KV pool instead as this fraction (0-1] of the memory free once the weights are loaded "
        "(GPU memory, or available RAM on CPU), like vLLM's --gpu-memory-utilization; excludes --num-blocks", float)
    max_model_len: int | None = _setting(None, "context length in tokens, prompt + output (default: the model's "
                                         "max_position_embeddings; at most that)", int, group="model")
    kv_dtype: str = _setting(AUTO, "KV cache element type (part of the prefix-cache hash contract, and of the KV "
                             "transfer: prefill and decode must agree); auto: the model's --dtype; fp8_e4m3, fp8_e5m2, "
                             "int8: quantized KV (fp8 unscaled as vLLM's, int8 scaled per token and head; "
                             "docs/quantization.md#quantized-kv-cache)",
                             choices=(AUTO, *KV_DTYPES), group="model", aliases=("kv_cache_dtype",))
    enable_prefix_caching: bool = _setting(True, "keep computed blocks by their hash and reuse them for prompts "
                                           "that share a prefix (docs/prefix-caching.md)")
    max_num_batched_tokens: int | None = _setting(None, "tokens computed per step (the prefill chunk)", int)
    max_num_seqs: int = _setting(64, "requests in the running batch at most")
    threads: int = _setting(1, "torch intra-op threads for this process")
    kernel_threads: int | None = _setting(
        None, "threads of the C++ CPU kernels (dense and quantized GEMMs, layer ops, decode attention), the engine's "
        "own included (default: every CPU this process may use: its affinity, capped by its cgroup's CPU quota); "
        "helpers claim work from a shared counter, so a busy neighbour process never stalls a step", int)
    tensor_parallel_size: int = _setting(
        1, "ranks of this instance: one process each, the model's heads and MLP split over them (gloo on CPU, NCCL on "
        "CUDA; each rank takes --threads and --kernel-threads; docs/parallelism.md)")
    speculative_method: str | None = _setting(
        None, "speculative decoding on this engine: 'ngram' (prompt lookup), 'draft' (--draft-model), "
        "'early-exit' (the model's first layers draft), 'suffix' (suffix decoding: the request's tokens and recent "
        "outputs); decode tier only (default: off)", str, choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int | None = _setting(
        None, "tokens proposed per step and request at most with --speculative-method (default: 4; suffix: 15)", int)
    prompt_lookup_min: int = _setting(2, "ngram: the shortest suffix looked up")
    prompt_lookup_max: int = _setting(4, "ngram: the longest suffix looked up (tried first)")
    speculative_adaptive: bool = _setting(True, "adapt each request's draft length to its acceptance (shrink "
                                          "after a rejection, grow after a fully accepted step), and offer drafts "
                                          "only at batch sizes where steps with them measured more tokens/s than "
                                          "steps without")
    speculative_disable_by_batch_size: int | None = _setting(
        None, "no drafts in steps whose running batch has more requests than this (default: never off)", int)
    draft_model: str | None = _setting(None, "draft: a checkpoint dir with the model's tokenizer (e.g. a "
                                       "`tandem quantize` copy), run over its own KV pool", str)
    draft_num_layers: int | None = _setting(None, "early-exit: the model's layers that draft (default: a quarter "
                                            "of them)", int)
    suffix_max_spec_factor: float = _setting(1.0, "suffix: drafts of at most this times the matched suffix's "
                                             "length", kind=positive_number)
    suffix_min_token_prob: float = _setting(0.1, "suffix: a draft stops where its empirical probability (the "
                                            "product of its tokens' counts over their siblings') falls below this")
    suffix_cache_tokens: int = _setting(65536, "suffix: output tokens of finished requests kept in the global "
                                        "suffix tree (the oldest requests go first)")
    kv_host_tier_gib: float = _setting(
        0.0, "GiB of host memory for the KV tier below the pool: cached blocks the pool evicts are copied here and "
        "loaded back on a prefix hit, beside the steps (0: off; docs/prefix-caching.md#tiers-below-the-pool)",
        kind=non_negative_number)
    kv_disk_tier_dir: str | None = _setting(
        None, "directory of the disk KV tier below the host tier: blocks it evicts (or the pool's, without one) are "
        "written here, one checksummed file each, in a slot of its own (DIR/<hash contract>/slot-N, locked while "
        "it runs; a restarted instance takes over a free slot and its blocks) (default: off)", str)
    kv_disk_tier_gib: float = _setting(16.0, "GiB the disk KV tier may hold (its first blocks by --kv-tier-eviction "
                                       "are deleted beyond that)", kind=non_negative_number)
    kv_tier_eviction: str = _setting("lru", "which block the host and disk KV tiers evict first: lru (least "
                                     "recently stored or hit) or lfu (fewest hits, then least recent)",
                                     choices=KV_TIER_EVICTION_POLICIES)
    enable_lora: bool = _setting(False, "serve LoRA adapters: requests name one, or none for the base model; "
                                 "adapters load at start (--lora-modules) and at run time (docs/lora.md)")
    lora_modules: tuple[str, ...] | None = _setting(
        None, "LoRA adapters loaded at start, as NAME=PATH items (PATH: a PEFT adapter dir, adapter_config.json + "
        "adapter_model.safetensors); implies --enable-lora", lora_module, nargs="+")
    max_loras: int = _setting(4, "LoRA: distinct adapters in one step's batch at most (the slots of their weights); "
                              "requests of others wait their turn")
    max_cpu_loras: int | None = _setting(
        None, "LoRA: adapters whose weights are held in memory at most, the least recently used dropped first and "
        "read from disk again when a request needs it (default: --max-loras)", int)
    max_lora_rank: int = _setting(16, "LoRA: the largest adapter rank served (the size of the slots; an adapter of "
                                  "a higher rank is refused)")

    def create_configs(self, tier: str, model_dir: str | Path) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        """The three records an LLMEngine takes; model_dir is used when model is None. ValueError on bad values."""
        tier_defaults = TIER_DEFAULTS[tier]
        if self.num_blocks is not None and self.memory_utilization is not None:
            raise ValueError("--num-blocks and --memory-utilization both size the KV pool: give one")
        num_blocks = self.num_blocks
        if num_blocks is None and self.memory_utilization is None:
            num_blocks = tier_defaults["num_blocks"]
        budget = self.max_num_batched_tokens
        budget = budget if budget is not None else tier_defaults["max_num_batched_tokens"]
        model_config = self.create_model_config(model_dir)
        return (model_config, CacheConfig(self.block_size, num_blocks, self.resolved_kv_dtype(model_config),
                                          self.memory_utilization, self.enable_prefix_caching),
                SchedulerConfig(budget, self.max_num_seqs))

    def resolved_quantization(self) -> str | None:
        """The quantized checkpoint to run (ModelConfig.from_dir's argument): quantization as given, 'gguf' for
        the packaged model (no --model) when none is given, None for 'none' or a --model without one."""
        if self.quantization == NO_QUANTIZATION:
            return None
        if self.quantization is None and self.model is None:
            return "gguf"
        return self.quantization

    def resolved_kv_dtype(self, model_config: ModelConfig) -> str:
        """kv_dtype, or with auto the model's dtype."""
        return model_config.dtype if self.kv_dtype == AUTO else self.kv_dtype

    def weights_line(self, model_config: ModelConfig) -> str:
        """What runs and why, for a service's start-up line: 'gguf-q4_1 from .../SmolLM2-135M-Instruct.Q4_1.gguf
        (the default for the packaged model: its native weights; ...)'."""
        what = f"{model_config.weight_format} from {model_config.quantization or model_config.path}"
        why = []
        if self.quantization is None and self.model is None:
            why.append("the default for the packaged model: its native weights; --quantization none runs their "
                       "fp32 dequantization")
        if self.dtype == AUTO:
            why.append(f"activations in {model_config.dtype}: "
                       + ("the checkpoint's torch_dtype" if model_config.quantization is None
                          else "what the integer kernels take"))
        return what + (f" ({'; '.join(why)})" if why else "")

    def resolved_kernel_threads(self, tier: str) -> int:
        """kernel_threads, or every CPU this process may use (shared/utils.py usable_cpus: its affinity capped by its
        cgroup's CPU quota, so a pod limited to 2 CPUs takes 2, not the node's), in both tiers: the kernels' helpers
        claim work from a shared counter, so an engine that shares its CPUs with a busy neighbour loses nothing
        waiting for them, and one whose neighbour is idle gets its cores. ValueError below 1."""
        threads = self.kernel_threads if self.kernel_threads is not None else usable_cpus()
        if threads < 1:
            raise ValueError(f"--kernel-threads must be at least 1, got {threads}")
        return threads

    def create_parallel_config(self, tier: str, worker_module: str | None = None) -> ParallelConfig:
        """The ParallelConfig of these settings (each rank's threads as this process's; worker_module: what ranks > 0
        run, None: ParallelConfig's default). ValueError on bad values."""
        return ParallelConfig(self.tensor_parallel_size, self.threads, self.resolved_kernel_threads(tier),
                              **({"worker_module": worker_module} if worker_module else {}))

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig of these settings, None with speculation off. ValueError on bad values."""
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens, self.prompt_lookup_min,
                                 self.prompt_lookup_max, self.speculative_adaptive,
                                 self.speculative_disable_by_batch_size, self.draft_model, self.draft_num_layers,
                                 self.suffix_max_spec_factor, self.suffix_min_token_prob, self.suffix_cache_tokens)

    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig of these settings, None with LoRA off (neither --enable-lora nor --lora-modules).
        ValueError on bad values."""
        if not self.enable_lora and not self.lora_modules:
            return None
        modules = tuple(tuple(m.partition("=")[::2]) for m in self.lora_modules or ())
        return LoRAConfig(self.max_loras, self.max_cpu_loras, self.max_lora_rank, modules)

    def create_kv_tier_config(self) -> KVTierConfig:
        """The KVTierConfig of these settings (the disk tier claims a slot under kv_disk_tier_dir: DiskTier).
        ValueError on bad values."""
        return KVTierConfig(int(self.kv_host_tier_gib * GIB), self.kv_disk_tier_dir, int(self.kv_disk_tier_gib * GIB),
                            self.kv_tier_eviction)

    def create_model_config(self, model_dir: str | Path) -> ModelConfig:
        """The ModelConfig of model (or model_dir), quantization and dtype, its context cut to max_model_len: the
        same record for the gateway and the engines. ValueError on a bad model or a max_model_len beyond it."""
        model_config = ModelConfig.from_dir(self.model or model_dir, self.resolved_quantization(), self.dtype)
        if self.max_model_len is None:
            return model_config
        if self.max_model_len > model_config.max_model_len:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's context "
                             f"({model_config.max_model_len} tokens)")
        return replace(model_config, max_model_len=self.max_model_len)

    @classmethod
    def from_namespace(cls, args) -> EngineArgs:
        """The fields of an argparse namespace (or any object) that EngineArgs has."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
