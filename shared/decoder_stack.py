"""A model's decoder layers as one C++ call on the CPU (kernels/cpu/decoder_stack.cpp): the loop of
LlamaForCausalLM.forward over its layers, with the kernels the Python layers call, in the same order, so the
results are the same bits; without the 5-15 us of Python around each of a step's ~270 kernel calls (4 ms of a
10-16 ms decode step of the packaged GGUF at 1-8 sequences, 1.4-3 ms in fp32 and bf16: docs/performance.md).

It runs a forward when every layer is one the stack computes as the Python layers would (Llama's layout: RMSNorm
before attention and MLP, rotate-half RoPE, SwiGLU; no Gemma norms, QK norms or local RoPE), each linear dense
(CpuDenseLinear) or integer on gemm_vnni (WeightOnlyInt4Linear, WeightOnlyInt8Linear without outlier columns, on a
CPU with AVX-512 VNNI), the activations fp32 or bf16 with a float KV pool of their dtype, and the step has no LoRA
adapters; otherwise the Python layers run. model.use_decoder_stack = False turns it off (step_profile times the
Python layers' calls).

The stack is built on the first forward that can use it and kept on the model. It holds the model's own float
parameters (not copies: a change in place, or `.data =`, `.to()`, is seen as it is). It is built again:
- when the codes, scales or zero points an integer layout was derived from change in place or get new storage
  (DecoderStack.stale: each one's data_ptr and version, the key of shared/quant/layers.py's _derived);
- when any module anywhere registers a parameter, buffer or submodule (torch's global registration hooks bump a
  counter: a replaced weight or linear, load_state_dict(assign=True), shard_model), or the number of layers
  changes.
Per-layer settings that are plain attributes (a norm's eps, a layer's window, the head counts) are read when it
is built.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import cpu_dense, cpu_ext, cpu_layer_ops, cpu_qgemm
from tandem.shared.attention import AttentionMetadata, decode_kernel_rows
from tandem.shared.device import use_triton
from tandem.shared.lora.layers import LoRAMetadata
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear


# NOTE: bumped by torch's global hooks whenever a module registers a parameter, buffer or submodule by assignment
# (nn.Module.__setattr__ / register_*): a cached stack built before may hold a replaced tensor or module. Rare
# while serving (models are built and wrapped before their first forward).
_registrations = 0


def _count_registration(*_) -> None:
    global _registrations
    _registrations += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)
nn.modules.module.register_module_buffer_registration_hook(_count_registration)
nn.modules.module.register_module_module_registration_hook(_count_registration)


def for_forward(model: nn.Module, x: torch.Tensor, kv_caches, meta: AttentionMetadata,
                lora: LoRAMetadata | None):
    """The model's DecoderStack for this forward (x [T, H] the embeddings), or None when the Python layers must
    run it (see the module docstring)."""
    if (lora is not None or meta.kv_quant is not None or not model.use_decoder_stack
            or not isinstance(kv_caches, torch.Tensor) or kv_caches.dtype != x.dtype
            or not cpu_layer_ops.supports(x) or use_triton(x)):
        return None
    key = (x.dtype, _registrations, len(model.model.layers))
    cached = model.__dict__.get("_decoder_stack")
    if cached is None or cached[0] != key or (cached[1] is not None and cached[1].stale()):
        cached = (key, build(model, x.dtype))
        model.__dict__["_decoder_stack"] = cached
    return cached[1]


def run(stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: torch.Tensor,
        meta: AttentionMetadata, num_layers: int | None) -> list[torch.Tensor]:
    """The first num_layers layers (None: all) over x [T, H] (the embeddings, overwritten), attention as
    shared/attention.py paged_attention picks it on the CPU. Returns [the last layer's MLP output, the residual
    stream before it], as the Python loop."""
    rows = decode_kernel_rows(meta)
    tables, lens = rows if rows is not None else (meta.block_tables, meta.context_lens_t)
    num_layers = len(range(stack.num_layers)[:num_layers])  # (the Python loop's slice, negative counts included)
    return stack.forward(x, cos, sin, kv_caches, meta.slot_mapping, rows is not None, tables, lens,
                         meta.query_start_loc_t, num_layers)


def build(model: nn.Module, dtype: torch.dtype):
    """A DecoderStack over model.model.layers for activations of dtype, or None when a layer is one it does not
    compute as the Python layers do."""
    config = model.config
    if (not cpu_ext.available() or config.gemma_norms or config.qk_norm or config.rope_local
            or config.head_dim % 16 or config.head_dim > 256):
        return None
    ext = cpu_ext.extension()
    layers = model.model.layers
    first = layers[0].self_attn
    stack = ext.DecoderStack(first.num_heads, first.num_kv_heads, config.rms_norm_eps, config.attention_scale,
                             config.attn_logit_softcapping or 0.0)
    sources = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (layer.sandwich or layer.local_rope or mlp.gelu or hasattr(attn, "q_norm")
                or (attn.num_heads, attn.num_kv_heads) != (first.num_heads, first.num_kv_heads)
                or any(n.unit_offset or n.weight.dtype != dtype or n.eps != config.rms_norm_eps
                       or not n.weight.is_contiguous() for n in norms)):
            return None
        linears = [_stack_linear(ext, m, dtype, sources)
                   for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(linear is None for linear in linears):
            return None
        stack.add_layer(norms[0].weight, norms[1].weight, *linears, attn.window or 0)
    stack.watch(sources)
    return stack


def _stack_linear(ext, module: nn.Module, dtype: torch.dtype, sources: list[torch.Tensor]):
    """module as a StackLinear computing what its forward computes for dtype activations on the CPU, or None."""
    bias = getattr(module, "bias", None)
    if type(module) is cpu_dense.CpuDenseLinear:
        if (module.weight.dtype != dtype or module.in_features % 32 or not module.weight.is_contiguous()
                or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))):
            return None
        max_rows = cpu_dense.max_rows(dtype)
        return ext.StackLinear.dense(module.weight, bias, -1 if max_rows is None else max_rows)
    int4 = type(module) is WeightOnlyInt4Linear
    if not int4 and type(module) is not WeightOnlyInt8Linear:
        return None
    padded_k = module.padded_in_features if int4 else module.in_features
    group_size = module.group_size or module.in_features
    if (dtype != torch.float32 or module.scales.dtype != torch.float32 or not cpu_qgemm.has_vnni()
            or not cpu_qgemm.supports(padded_k, group_size)
            or (not int4 and module.outlier_idx is not None and module.outlier_idx.numel())
            or (bias is not None and bias.dtype != torch.float32)):
        return None
    packed = module._packed_vnni()
    sources += [module.qweight, module.scales] + ([module.zeros] if int4 else []) + ([] if bias is None else [bias])
    return ext.StackLinear.vnni(packed.codes, packed.scales, packed.zero_scales, packed.out_features,
                                packed.group_size, packed.int4, padded_k, bias)
