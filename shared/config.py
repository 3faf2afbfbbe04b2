"""Configuration records an LLMEngine takes: the model's architecture, the KV cache, the scheduler's budgets and
speculative decoding. The settings users give, and how they resolve into these: shared/engine_args.py.

Imports neither torch nor the engine (torch only inside torch_dtype), so the client CLI can build its flags fast.

Over 400 lines on purpose: every record an engine takes, with its checks, in one place (as nano-vllm's config.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from tandem.kernels.kv_quant import KV_QUANT_DTYPES, is_quantized, row_size
from tandem.shared.architectures import LLAMA_FEATURES, architecture_features
from tandem.shared.model_files import fingerprint

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"  # what ModelConfig / CacheConfig run in unless told otherwise
AUTO = "auto"  # --dtype / --kv-dtype default: the checkpoint's own type (the model's, for the KV cache)
NO_QUANTIZATION = "none"  # --quantization none: the --model dir's own float weights, even for the packaged model
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# KV cache element types: a float one, or a quantized format (kernels/kv_quant.py: uint8 rows of codes + scale)
KV_DTYPES = (*DTYPES, *KV_QUANT_DTYPES)


def check_dtype(name: str) -> str:
    """name if it is one of DTYPES; ValueError otherwise."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {list(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype; ValueError on anything else. (torch is imported here,
    not at module level, so that the flag definitions built from this module load without it.)"""
    import torch

    return getattr(torch, check_dtype(name))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(cfg: dict) -> str:
    """The float type a checkpoint's config.json says its weights are stored in (`torch_dtype`, or `dtype` as
    transformers 5 writes it); float32 when it names none or a type not in DTYPES."""
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


@dataclass(frozen=True)
class ModelConfig:
    """The architecture read from an HF config.json (the families of shared/architectures.py)."""

    path: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    digest: str
    weight_format: str = "fp32"
    quantization: str | None = None  # quantized checkpoint (dir or .gguf) whose linears replace the float ones
    dtype: str = DEFAULT_DTYPE  # weights and activations (the float ones; quantized codes keep their own type)
    # the architecture beyond Llama's fields (shared/architectures.py)
    model_type: str = "llama"
    attention_bias: bool = False  # bias on q/k/v_proj (Qwen2)
    o_proj_bias: bool = False  # bias on o_proj (Llama and Qwen3 with attention_bias, Gemma)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + weight) norms, four a layer, embeddings times sqrt(hidden_size) (Gemma)
    hidden_act: str = "silu"  # the MLP gate's activation: silu or gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5 (Gemma); None: head_dim's
    attn_logit_softcapping: float | None = None  # attention scores s -> cap * tanh(s / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    sliding_window: int | None = None  # the window of the layers layer_types marks "sliding_attention"
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" or "sliding_attention"; () all full
    rope: tuple[tuple[str, object], ...] = ()  # rope_parameters' items (shared/rope.py); () is default RoPE
    rope_local: tuple[tuple[str, object], ...] = ()  # the sliding layers' own RoPE (Gemma 3); () the same as rope
    # sampling defaults of generation_config.json (GENERATION_DEFAULTS' names as SamplingParams calls them), for
    # the fields a request leaves unset (the gateway applies them; vLLM's --generation-config auto); not part of
    # the model id: they change no KV
    generation_defaults: tuple[tuple[str, float], ...] = ()

    @property
    def rope_parameters(self) -> dict:
        """rope_theta, rope_type and that type's numbers (shared/rope.py)."""
        return dict(self.rope) if self.rope else {"rope_theta": self.rope_theta, "rope_type": "default"}

    @property
    def longrope_context(self) -> int | None:
        """longrope: the original context (original_max_position_embeddings). A sequence longer than it computes
        every position with the long factors, a shorter one with the short factors; one that grows past it is
        recomputed with the long ones (HF's Phi-3 does the same: it drops its cache at that token). None for
        other RoPE."""
        params = self.rope_parameters
        return params["original_max_position_embeddings"] if params["rope_type"] == "longrope" else None

    def kv_variant(self, num_tokens: int) -> str | None:
        """What besides the tokens makes a sequence's KV differ, for its block hashes (shared/block_hash.py):
        "rope:long" for a longrope sequence of num_tokens past the original context, else None."""
        context = self.longrope_context
        return "rope:long" if context is not None and num_tokens > context else None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (0-based), or None where it attends to the whole context."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding_attention" else None

    @property
    def kv_window(self) -> int | None:
        """The sliding window when every layer has one (a request's blocks wholly before it are never read again,
        and are freed early: shared/kv_cache_manager.py); None when some layer attends to the whole context."""
        return self.sliding_window if self.layer_types and "full_attention" not in self.layer_types else None

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: query_pre_attn_scalar ** -0.5 (Gemma) or head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def model_id(self) -> str:
        """Identity checked by KV transfer and block hashes: the name and weight format of the checkpoint the
        weights come from (the quantized one when there is one, since it fills every tensor; so --model Q and
        --model BASE --quantization Q give the same id), and a digest of those weights plus the architecture
        fields they run with."""
        return f"{self.name}:{self.digest}:{self.weight_format}"

    @classmethod
    def from_dir(cls, path: str | Path, quantization: str | None = None, dtype: str = DEFAULT_DTYPE) -> ModelConfig:
        """Read config.json (+ generation_config.json for extra EOS ids). ValueError naming the field when the
        architecture or one of its features is not served (shared/architectures.py).

        quantization: a quantized checkpoint (tandem / HF AWQ / HF GPTQ dir, a .gguf file, or "gguf" for the
        packaged GGUF) with this model's architecture, which supplies every weight; a path that is itself a
        quantized checkpoint needs none.
        dtype: the float type weights and activations run in ("float32", "bfloat16", "float16"); part of the
        weight format, so tiers running different types never share KV. "auto": the checkpoint's own type
        (checkpoint_dtype) for float weights, float32 for quantized ones (the integer kernels' activations).
        """
        from tandem.shared.model_files import packaged_gguf_path
        from tandem.shared.quant import detect_quant_config

        path = Path(path)
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is not a model directory (no config.json); run `tandem prepare-model`")
        cfg = json.loads((path / "config.json").read_text())
        features = architecture_features(cfg)  # (ValueError naming what is not supported)
        rope = dict(features["rope"])
        eos = set(_as_list(cfg.get("eos_token_id")))
        gen_path = path / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        eos |= set(_as_list(generation.get("eos_token_id")))
        heads = cfg["num_attention_heads"]
        outside = sorted(t for t in eos if not 0 <= t < cfg["vocab_size"])
        if outside:
            raise ValueError(f"eos_token_id {outside} (config.json, generation_config.json) is outside the "
                             f"vocabulary of {cfg['vocab_size']}")
        if quantization == "gguf":
            quantization = str(packaged_gguf_path())
        if quantization is None and detect_quant_config(path).bits is not None:
            quantization = str(path)
        weights = path if quantization is None else Path(quantization)
        if dtype == AUTO:
            dtype = checkpoint_dtype(cfg) if quantization is None else "float32"
        arch = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            max_model_len=features["max_model_len"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", features["gemma_norms"]),  # (HF's defaults)
            eos_token_ids=tuple(sorted(eos)),
        )
        # beyond Llama's fields, only what differs from Llama (so that a Llama's id is what it was before them)
        arch |= {k: v for k, v in features.items() if k not in arch and v != LLAMA_FEATURES.get(k, v)}
        if rope["rope_type"] != "default":
            arch["rope"] = features["rope"]
        # The same weights run with another architecture config (rope_theta, eps, ...) are another model.
        digest = xxhash.xxh3_64_hexdigest(f"{fingerprint(weights)}|{sorted(arch.items())}".encode())[:12]
        weight_format = detect_quant_config(quantization).weight_format
        if check_dtype(dtype) != "float32":  # fp32 weights keep the format's bare name
            weight_format = _SHORT_DTYPE[dtype] if quantization is None else f"{weight_format}-{_SHORT_DTYPE[dtype]}"
        defaults = tuple((name, generation[key]) for key, name in GENERATION_DEFAULTS.items()
                         if generation.get(key) is not None)  # fmt: skip
        for name, value in defaults:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"generation_config.json: {name} must be a number, got {value!r}")
        return cls(path=str(path), name=weights.stem if weights.suffix == ".gguf" else weights.name, digest=digest,
                   weight_format=weight_format, quantization=quantization, dtype=dtype, generation_defaults=defaults,
                   **arch)


# generation_config.json's sampling fields -> the SamplingParams fields they default (vLLM reads the same ones)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: num_blocks blocks of block_size token slots per layer, for K and for V.

    num_blocks None: the ModelRunner sizes the pool once the weights are loaded, as memory_utilization (a
    fraction in (0, 1]) of the memory then free on the device (vLLM's --gpu-memory-utilization rule, applied to
    what is left after the weights; on CPU, the RAM the OS reports available)."""

    block_size: int
    num_blocks: int | None
    kv_dtype: str = DEFAULT_DTYPE  # one of KV_DTYPES
    memory_utilization: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size <= 0 or (self.num_blocks is not None and self.num_blocks <= 0):
            raise ValueError("block_size and num_blocks must be positive")
        if (self.num_blocks is None) == (self.memory_utilization is None):
            raise ValueError("give the KV pool's size either as num_blocks or as memory_utilization")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.kv_dtype!r}; expected one of {list(KV_DTYPES)}")

    @property
    def kv_quant(self) -> str | None:
        """The quantized KV format (kernels/kv_quant.py) the pool holds, None for float KV."""
        return self.kv_dtype if is_quantized(self.kv_dtype) else None

    @property
    def dtype(self) -> torch.dtype:
        """The pool's torch element type: kv_dtype's float type, uint8 for a quantized format."""
        if self.kv_quant is not None:
            import torch

            return torch.uint8
        return torch_dtype(self.kv_dtype)

    def row_size(self, model: ModelConfig) -> int:
        """The pool's last dim: head_dim elements (float KV), or head_dim codes + the fp32 scale in bytes."""
        return row_size(model.head_dim, self.kv_quant)

    def block_bytes(self, model: ModelConfig) -> int:
        """Bytes of one block over all layers, K and V (a quantized row's scale included)."""
        return (model.num_hidden_layers * 2 * self.block_size * model.num_key_value_heads * self.row_size(model)
                * self.dtype.itemsize)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets: tokens computed in one forward and requests running at once."""

    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self):
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


SPECULATIVE_METHODS = ("ngram", "draft", "early-exit", "suffix")
# num_speculative_tokens when none is given: suffix decoding drafts long runs; 15 drafts + the token verified with
# them are 16 query rows, the most a CPU request runs in the decode attention kernel (attention.MAX_ROWS_AS_DECODE)
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 4, "draft": 4, "early-exit": 4, "suffix": 15}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on one engine (Leviathan et al. 2023; Chen et al. 2023): each step a decoding
    request gets up to num_speculative_tokens proposed tokens, verified in the same forward as its next token.

    method "ngram": prompt lookup (Saxena 2023; vLLM's ngram proposer): the last n tokens, n from
    prompt_lookup_max down to prompt_lookup_min, are looked up in the request's earlier tokens, and what followed
    their latest earlier occurrence is proposed. adaptive: each request's draft length starts at
    num_speculative_tokens, shrinks by one after a step that rejected a draft and grows by two (up to
    num_speculative_tokens) after one that accepted all (HF assisted generation's "heuristic" schedule); after a
    rejection at length 1 the request rests a few steps; n-gram drafts of a request alone in the batch always get
    the full length; and a SpeculationGate offers drafts only at batch sizes where steps with them measured more
    tokens per second than steps without (shared/spec_decode/drafter.py).
    disable_by_batch_size: no drafts in a step whose running batch has more requests (vLLM's name).

    method "draft": draft_model, a checkpoint dir with the target's tokenizer, runs num_speculative_tokens times
    per step over its own paged KV (shared/spec_decode/draft_model.py). method "early-exit": the target's first
    draft_num_layers layers and its LM head draft, over the target's KV (None: a quarter of the model's layers).
    method "suffix": suffix decoding (shared/spec_decode/suffix_proposer.py): suffix trees over the request's tokens
    and over recent requests' outputs (suffix_cache_tokens tokens at most, the oldest evicted first); drafts of at
    most suffix_max_spec_factor x the matched length, cut where their empirical probability falls below
    suffix_min_token_prob.
    num_speculative_tokens None: DEFAULT_NUM_SPECULATIVE_TOKENS. ValueError on bad values."""

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    draft_model: str | None = None
    draft_num_layers: int | None = None
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_tokens: int = 65536

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS[self.method])
        if self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size <= 0:
            raise ValueError(f"disable_by_batch_size must be positive, got {self.disable_by_batch_size}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("--draft-model goes with --speculative-method draft, and that method needs it")
        if self.draft_num_layers is not None and self.method != "early-exit":
            raise ValueError("--draft-num-layers goes with --speculative-method early-exit")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"--draft-num-layers must be at least 1, got {self.draft_num_layers}")
        if self.suffix_max_spec_factor <= 0 or not 0 <= self.suffix_min_token_prob <= 1 or self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix decoding needs --suffix-max-spec-factor > 0, --suffix-min-token-prob in [0, 1] "
                             f"and --suffix-cache-tokens >= 0, got {self.suffix_max_spec_factor}, "
                             f"{self.suffix_min_token_prob}, {self.suffix_cache_tokens}")


KV_TIER_EVICTION_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class KVTierConfig:
    """The KV tiers below the pool (shared/kv_tiers.py): sizes in bytes (0: no such tier), the disk tier's
    directory (None: none) and the order they evict in (KV_TIER_EVICTION_POLICIES)."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    eviction: str = "lru"

    def __post_init__(self):
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("KV tier sizes must be 0 or more bytes")
        if self.eviction not in KV_TIER_EVICTION_POLICIES:
            raise ValueError(f"KV tier eviction must be one of {KV_TIER_EVICTION_POLICIES}, got {self.eviction!r}")

    @property
    def has_disk(self) -> bool:
        return self.disk_dir is not None and self.disk_bytes > 0

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.has_disk


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on one engine (docs/lora.md, shared/lora/; vLLM's LoRAConfig names): at most max_loras distinct
    adapters in one step's batch (the stacked weight slots each LoRA-wrapped linear holds), max_cpu_loras adapters'
    weights held in memory (least recently used dropped first, read from disk again when a request needs them;
    None: max_loras), ranks up to max_lora_rank (the slots' rank; a higher one is refused). lora_modules: (name,
    PEFT directory) pairs loaded at start. ValueError on bad values."""

    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if self.max_loras <= 0 or self.max_lora_rank <= 0:
            raise ValueError(f"--max-loras and --max-lora-rank must be positive, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                             f"({self.max_loras}): the adapters of one step are held in memory together")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)}")


@dataclass(frozen=True)
class ParallelConfig:
    """An instance of tensor_parallel_size ranks (shared/parallel/, docs/parallelism.md): one process per rank,
    each with threads torch threads and kernel_threads C++ kernel threads; ranks > 0 run `python -m worker_module`
    (shared/parallel/worker.py: the model's steps only; the services' services/tp_worker.py adds the KV transfer
    between tiers). ValueError on bad values."""

    tensor_parallel_size: int = 1
    threads: int = 1
    kernel_threads: int = 1
    worker_module: str = "tandem.shared.parallel.worker"

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.threads < 1 or self.kernel_threads < 1:
            raise ValueError(f"--tensor-parallel-size, --threads and --kernel-threads must be at least 1, got "
                             f"{self.tensor_parallel_size}, {self.threads}, {self.kernel_threads}")
