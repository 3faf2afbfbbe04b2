"""The decoder of every architecture shared/architectures.py serves (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3,
Gemma 2, Gemma 3) over a flat batch of tokens with a paged KV cache: one set of layers, each family's differences
switched on by ModelConfig's fields.

Our own forward (not transformers' modeling code), with HF module names so an HF safetensors checkpoint loads
with load_state_dict and quantized linears can replace nn.Linear by name. Numerics follow the HF references
(RMSNorm in fp32, rotate-half RoPE, gated MLP; Gemma's (1 + weight) norms multiplied before the cast) so greedy
tokens match them. The residual stream is carried beside each layer's output (vLLM's layout) so that its add fuses
into the next RMSNorm. On the CPU in fp32 and bf16 the elementwise ops run as the C++ kernels of
kernels/cpu_layer_ops.py (one call each, rounding as the torch ops do); elsewhere (fp16, Gemma's norms in bf16) as
their torch references. On the CPU a Llama-layout model's layers run as one C++ call with those same kernels
(shared/decoder_stack.py) where every layer is one it computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_layer_ops
from tandem.kernels.cpu_dense import CpuDenseLinear
from tandem.kernels.cpu_layer_ops import fused_add_rms_norm_ref, rms_norm_ref, rotate_half, silu_and_mul_ref
from tandem.kernels.masks import soft_cap
from tandem.shared import decoder_stack
from tandem.shared.attention import AttentionMetadata, paged_attention, write_kv_cache
from tandem.shared.config import ModelConfig, torch_dtype
from tandem.shared.device import use_triton
from tandem.shared.lora.layers import LoRAMetadata
from tandem.shared.model_files import read_safetensors
from tandem.shared.rope import RotaryEmbedding
from tandem.shared.quant.layers import concat_linears


def cpu_kernels(x: torch.Tensor) -> bool:
    """True when x's elementwise layer ops run as the C++ CPU kernels (fp32 or bf16 on the CPU, unless the Triton
    path is forced there)."""
    return cpu_layer_ops.supports(x) and not use_triton(x)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019). unit_offset (Gemma): scales by (1 + weight), multiplied in fp32 before the
    cast back (HF Gemma2RMSNorm); otherwise by weight after the cast (HF LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x) [T, H]; with residual: (RMSNorm(x + residual), x + residual), on the CPU in place in x and
        residual (both fresh tensors of the layer's own)."""
        weight = self.weight.float() + 1.0 if self.unit_offset else self.weight
        fast = cpu_kernels(x) and weight.dtype == x.dtype  # (not Gemma's fp32 1 + weight on bf16 x)
        if residual is None:
            if fast:
                return cpu_layer_ops.rms_norm(x, weight, self.eps)
            return _offset_rms_norm_ref(x, weight, self.eps) if self.unit_offset else rms_norm_ref(x, weight, self.eps)
        if fast and x.is_contiguous() and residual.is_contiguous():
            return cpu_layer_ops.fused_add_rms_norm(x, residual, weight, self.eps)
        if self.unit_offset:
            residual = x + residual
            return _offset_rms_norm_ref(residual, weight, self.eps), residual
        return fused_add_rms_norm_ref(x, residual, weight, self.eps)


def _offset_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x [T, H] normalized in fp32, times weight (1 + the checkpoint's, fp32), then cast."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def linear(layer: nn.Module, x: torch.Tensor, lora: LoRAMetadata | None) -> torch.Tensor:
    """layer(x), with the step's LoRA segments when the batch has any (layer is then a LoRALinear:
    shared/lora/layers.py); without, exactly layer(x)."""
    return layer(x) if lora is None else layer(x, lora)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcapping
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:  # (Qwen3, Gemma 3: over each head's head_dim, before RoPE)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.gemma_norms)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.gemma_norms)

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj (the checkpoint's names) by one qkv_proj: one matmul reads all three weights."""
        self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata,
                lora: LoRAMetadata | None = None) -> torch.Tensor:
        """x [num_tokens, hidden]; cos, sin [num_tokens, head_dim] fp32; kv_cache [2, num_blocks, block_size,
        num_kv_heads, head_dim] (this layer; with meta.kv_quant, uint8 rows of kv_quant.row_size)."""
        qkv = linear(self.qkv_proj, x, lora).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            qkv = torch.cat([self.q_norm(q.reshape(-1, self.head_dim)).view_as(q),
                             self.k_norm(k.reshape(-1, self.head_dim)).view_as(k), v], dim=1)
        # (a quantized cache: the K/V written as x.dtype's values, quantized on write; the query stays in x.dtype)
        kv_dtype = x.dtype if meta.kv_quant is not None else kv_cache.dtype
        if cpu_kernels(qkv) and kv_cache.dtype == qkv.dtype:
            q = cpu_layer_ops.rope_write_kv(qkv, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                                            self.num_heads)  # fmt: skip
        else:
            qk = qkv[:, : self.num_heads + self.num_kv_heads]  # RoPE on query and key heads at once
            qk = (qk * cos[:, None] + rotate_half(qk) * sin[:, None]).to(x.dtype)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.num_heads + self.num_kv_heads :]
            write_kv_cache(k.to(kv_dtype), v.to(kv_dtype), kv_cache[0], kv_cache[1], meta.slot_mapping, meta.kv_quant)
        o = paged_attention(q.to(kv_dtype), kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap)
        return linear(self.o_proj, o.to(x.dtype).flatten(1), lora)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj: one matmul reads both weights."""
        self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, lora: LoRAMetadata | None = None) -> torch.Tensor:
        gate_up = linear(self.gate_up_proj, x, lora)
        if self.gelu:  # (Gemma: GELU, tanh approximation)
            gate, up = gate_up.chunk(2, dim=-1)
            return linear(self.down_proj, F.gelu(gate, approximate="tanh") * up, lora)
        if cpu_kernels(gate_up):
            return linear(self.down_proj, cpu_layer_ops.silu_and_mul(gate_up), lora)
        return linear(self.down_proj, silu_and_mul_ref(gate_up), lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = config.gemma_norms  # Gemma: post_attention_layernorm norms the attention output
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # Gemma 3: the sliding layers' RoPE is their own (LlamaModel.rotary_emb_local)
        self.local_rope = bool(config.rope_local) and config.layer_window(layer) is not None

    def forward(self, x, residual, cos, sin, kv_cache, meta, lora: LoRAMetadata | None = None):
        """x: the previous layer's output (the embeddings, with residual None, for the first layer); residual:
        the residual stream before it; lora: the step's LoRA segments (None: none). Returns (this layer's MLP
        output, the residual stream before it); the stream after the layer is their sum."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta, lora)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x, lora)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # (no random init: the checkpoint fills it; on the meta device torch's normal_ would import torch._dynamo,
        # 1.5 s of every engine's start)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)
        with torch.device("cpu"):  # (computed, not loaded: on the meta device its ops would import torch._dynamo)
            self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_parameters)
            if config.rope_local:
                self.rotary_emb_local = RotaryEmbedding(config.head_dim, dict(config.rope_local))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # on the CPU, the layers as one C++ call where they can be (shared/decoder_stack.py); False: always the
        # Python layers
        self.use_decoder_stack = True

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_indices,
                num_layers: int | None = None, hidden_indices: torch.Tensor | None = None,
                lora: LoRAMetadata | None = None):
        """One step over a flat batch.

        input_ids, positions [num_tokens] int64; kv_caches [num_layers, 2, num_blocks, block_size, num_kv_heads,
        head_dim]; logits_indices [num_sampled] int64 rows whose next-token logits are wanted. num_layers: run
        only the first num_layers decoder layers, then the final norm and the LM head (an early-exit draft, as
        LayerSkip, Elhoushi et al. 2024); kv_caches needs only those layers. hidden_indices [num_pooled] int64:
        rows whose final hidden state (after the final norm) is wanted instead (pooling requests). lora: the
        batch's LoRA segments (shared/lora/layers.py; None: every row runs the base model).
        Returns logits [num_sampled, vocab_size] fp32 (soft-capped where the config says, Gemma 2); with
        hidden_indices, (logits, hidden states [num_pooled, hidden_size] fp32).
        """
        x, residual = self.model.embed_tokens(input_ids), None
        if self.config.gemma_norms:  # (the scale rounded to the activations' dtype first, as HF Gemma)
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ropes = {False: self.model.rotary_emb(positions, meta.rope_long)}
        if self.config.rope_local:
            ropes[True] = self.model.rotary_emb_local(positions)
        if (stack := decoder_stack.for_forward(self, x, kv_caches, meta, lora)) is not None:
            x, residual = decoder_stack.run(stack, x, *ropes[False], kv_caches, meta, num_layers)
        else:
            # (a list's slice: a ModuleList's would build a ModuleList, registering every layer again)
            for layer, kv_cache in zip(list(self.model.layers)[:num_layers], kv_caches):
                x, residual = layer(x, residual, *ropes[layer.local_rope], kv_cache, meta, lora)
        rows = logits_indices if hidden_indices is None else torch.cat([logits_indices, hidden_indices])
        if residual is None:
            x = self.model.norm(x[rows])
        else:
            x, _ = self.model.norm(x[rows], residual[rows])
        num_sampled = len(logits_indices)
        logits = soft_cap(self.lm_head(x[:num_sampled]).float(), self.config.final_logit_softcapping)
        return logits if hidden_indices is None else (logits, x[num_sampled:].float())


def load_model(config: ModelConfig, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Build the model in config.dtype from config.path's safetensors files, or with config.quantization from
    that quantized checkpoint alone (quantized layers swapped in, shared/quant). Strict either way: every weight
    must be present (ValueError otherwise). The loaded model runs fused projections (qkv_proj, gate_up_proj), and
    on the CPU its float linears as CpuDenseLinear."""
    if config.quantization is not None:
        from tandem.shared.quant import apply_quantization

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to_empty(device=device)  # (uninitialised: a complete checkpoint fills every tensor)
        if config.tie_word_embeddings:  # (to_empty gave each of the tied names its own tensor)
            model.lm_head.weight = model.model.embed_tokens.weight
        apply_quantization(model, config.quantization)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        state = _read_state(config, model, device)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):  # (a quantized lm_head has its own)
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch_dtype(config.dtype)).eval()
    # NOTE: built after the cast: RoPE frequencies stay fp32 in every dtype (as in HF), since bf16 ones would
    # shift every position's angle.
    model.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_parameters).to(device)
    if config.rope_local:
        model.model.rotary_emb_local = RotaryEmbedding(config.head_dim, dict(config.rope_local)).to(device)
    for layer in model.model.layers:  # after loading, which uses the checkpoint's per-projection names
        layer.self_attn.fuse_projections()
        layer.mlp.fuse_projections()
    if torch.device(device).type == "cpu":
        for module in model.modules():  # (the float ones: a quantized linear runs its own kernels)
            if type(module) is nn.Linear:
                module.__class__ = CpuDenseLinear
    return model


def _read_state(config: ModelConfig, model: nn.Module, device="cpu") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names: a q/k/v stored as one qkv_proj and gate/up as one
    gate_up_proj (Phi-3) split into the projections the model loads (which load_model fuses again)."""
    from tandem.shared.quant.modules import quantizable_linears, split_fused_linears

    state = {name: tensor.to(device) for name, tensor in read_safetensors(config.path).items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return split_fused_linears(state, quantizable_linears(model))
