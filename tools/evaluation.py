"""Quantization quality against the float model: KL(fp32 || quant) of next-token distributions and top-1
agreement, averaged over every position of fixed-length windows of text shipped with the package (tools/data/).

    KL = mean over positions t of sum_v p(v | x_<=t) (log p(v | x_<=t) - log q(v | x_<=t))
    top1 = mean over positions of [argmax p == argmax q]

p comes from the float model, q from the quantized one; both see the same windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DATA_DIR = Path(__file__).resolve().parent / "data"  # package data (pyproject.toml), installed with tools/
EVAL_TEXT = DATA_DIR / "quant_eval.txt"
CALIBRATION_TEXT = DATA_DIR / "quant_calibration.txt"


def load_hf_model(model_dir: str | Path) -> nn.Module:
    """HF transformers causal LM in fp32, eval mode (module names as the engine's model: fused projections split,
    split_fused_modules).

    Raises:
        ValueError: model_dir is a quantized checkpoint (transformers would skip the unknown "tandem" format and
            leave random weights), lacks weights, or holds NaN/inf."""
    from transformers import AutoModelForCausalLM

    from tandem.shared.quant.checkpoint import read_quant_config
    from tandem.shared.quant.modules import first_non_finite

    if read_quant_config(Path(model_dir)) is not None:
        raise ValueError(f"{model_dir} is a quantized checkpoint; --model needs the float model it came from")
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                       output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if missing:
        raise ValueError(f"{model_dir} lacks {len(missing)} weights, e.g. {missing[0]}")
    bad = first_non_finite(model.state_dict())
    if bad is not None:  # quantizing it would silently zero the affected rows
        raise ValueError(f"{model_dir}: weight {bad} holds NaN or inf")
    return split_fused_modules(model).eval()


class _ConcatOutputs:
    """Stands in for a fused linear: the outputs of the owner's named linears, concatenated. Not an nn.Module, so
    the parts stay the owner's own children (one name each) and a part swapped for a quantized layer is used."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner, self.names = owner, names

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self.owner, name)(x) for name in self.names], dim=-1)


def split_fused_modules(model: nn.Module) -> nn.Module:
    """Give an HF model with fused projections (Phi-3: self_attn.qkv_proj, mlp.gate_up_proj) the per-projection
    nn.Linear modules the engine's model has (q/k/v_proj, gate/up_proj: rows split as the engine splits the
    checkpoint, shared/quant/modules.split_fused_linears); HF's own forward still runs, on their outputs
    concatenated. So quantization, calibration and the reference see the same linears as the engine. Other
    models are returned unchanged. ValueError for a fused linear with a bias (the engine's split has none)."""
    from tandem.shared.quant.modules import FUSED_LINEARS, split_fused_linears

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # (as HF's Phi3)
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size}
    for name, owner in list(model.named_modules()):
        for fused, parts in FUSED_LINEARS.items():
            kind, fused_name = fused.split(".")
            linear = getattr(owner, fused_name, None)
            if name.rpartition(".")[2] != kind or not isinstance(linear, nn.Linear):
                continue
            if linear.bias is not None:
                raise ValueError(f"{name}.{fused_name} has a bias; fused projections with biases are not supported")
            names = [part.split(".")[1] for part in parts]
            modules = {f"model.layers.0.{part}": nn.Linear(linear.in_features, rows[n], bias=False,
                                                            dtype=linear.weight.dtype)
                       for part, n in zip(parts, names)}  # fmt: skip
            split = split_fused_linears({f"model.layers.0.{fused}.weight": linear.weight.detach()}, modules)
            delattr(owner, fused_name)
            for (key, module), n in zip(modules.items(), names):
                module.weight.data.copy_(split[f"{key}.weight"])
                setattr(owner, n, module)
            setattr(owner, fused_name, _ConcatOutputs(owner, tuple(names)))
    return model


def text_token_ids(model_dir: str | Path, path: Path) -> torch.Tensor:
    """Token ids [T] int64 of a UTF-8 text file, with the tokenizer of model_dir (ValueError if not UTF-8)."""
    from transformers import AutoTokenizer

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from e
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def eval_windows(token_ids: torch.Tensor, seq_len: int = 512, max_positions: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [B, seq_len] covering up to max_positions tokens (whole windows only).

    Raises ValueError if not even one window fits."""
    limit = token_ids.numel() if max_positions is None else min(max_positions, token_ids.numel())
    seq_len = min(seq_len, limit)
    rows = limit // seq_len
    if rows < 1:
        raise ValueError("no evaluation tokens")
    return token_ids[: rows * seq_len].view(rows, seq_len)


@torch.no_grad()
def reference_logprobs(model: nn.Module, windows: torch.Tensor) -> list[torch.Tensor]:
    """Float model's log-probabilities, one [seq_len, vocab] float32 tensor per window."""
    return [torch.log_softmax(model(window[None], use_cache=False).logits[0].float(), dim=-1) for window in windows]


@dataclass(frozen=True)
class Agreement:
    kl: float  # nats per position, KL(reference || model)
    top1: float  # fraction of positions with the same argmax
    num_positions: int


@torch.no_grad()
def compare_to_reference(model: nn.Module, windows: torch.Tensor, reference: list[torch.Tensor]) -> Agreement:
    """KL(reference || model) and top-1 agreement over all positions of windows [B, seq_len]."""
    kl_sum, agree, count = 0.0, 0, 0
    for window, ref in zip(windows, reference):
        logq = torch.log_softmax(model(window[None], use_cache=False).logits[0].float(), dim=-1)
        kl_sum += (ref.exp() * (ref - logq)).sum().item()
        agree += (ref.argmax(-1) == logq.argmax(-1)).sum().item()
        count += window.numel()
    return Agreement(kl=kl_sum / count, top1=agree / count, num_positions=count)


def engine_speed(config, device: str = "cpu", prompt_len: int = 512, decode_tokens: int = 64) -> dict:
    """Weight bytes, prefill tokens/s (one prompt_len-token prompt in one step) and single-stream greedy decode
    tokens/s of the serving engine (shared.engine.LLMEngine) for one ModelConfig, on device; torch's thread
    count is the caller's. Returns {"weight_format", "weight_bytes", "prefill_tokens_per_s",
    "decode_tokens_per_s"}."""
    import time

    from tandem.shared.config import CacheConfig, SchedulerConfig
    from tandem.shared.engine import LLMEngine
    from tandem.shared.quant import weight_bytes
    from tandem.shared.request import Request, SamplingParams

    engine = LLMEngine(config, CacheConfig(16, 256, enable_prefix_caching=False), SchedulerConfig(prompt_len, 8),
                       device)
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    engine.add_request(Request("warm", prompt[:32], SamplingParams(max_tokens=2, temperature=0.0)))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(Request("r", prompt, SamplingParams(max_tokens=decode_tokens, temperature=0.0,
                                                           ignore_eos=True)))
    start = time.perf_counter()
    engine.step()  # the whole prompt in one step
    prefill_s = time.perf_counter() - start
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return {"weight_format": config.weight_format, "weight_bytes": weight_bytes(engine.model_runner.model),
            "prefill_tokens_per_s": round(prompt_len / prefill_s, 1),
            "decode_tokens_per_s": round(generated / (time.perf_counter() - start), 1)}
