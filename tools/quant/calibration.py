"""Layer-by-layer calibration plumbing shared by GPTQ and AWQ.

Both methods walk the decoder layers in order: capture the hidden states entering layer 0 once (and the mask
and RoPE arguments the model gives each layer, which differ between sliding and global layers), then for each
layer record its linears' inputs with forward hooks, quantize (GPTQ) or rescale (AWQ) that layer, and run it to
get the next layer's inputs. Only one layer's activations live at a time, as in the GPTQ reference code
(Frantar et al. 2022, section 4 "Step 3") and llm-awq. Works on HF LlamaForCausalLM and the other served
families (and any tree with the same names whose decoder layers take the hidden states as their first argument;
Phi-3's fused projections split first, tools/evaluation.py split_fused_modules).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.shared.quant.modules import LINEAR_SUFFIXES

# Linears that read the same input as another one: their activations are recorded once.
SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                "mlp.up_proj": "mlp.gate_proj"}
INPUT_OWNERS = tuple(s for s in LINEAR_SUFFIXES if s not in SHARED_INPUT)  # q, o, gate, down
MIN_DISTINCT_TOKENS = 32
MAX_TOKEN_SHARE = 0.2  # the shipped calibration and evaluation texts: at most 4% for any one token


class _StopForward(Exception):
    pass


@dataclass
class LayerInputs:
    """What enters a decoder layer: hidden [B, T, hidden] plus the other positional/keyword arguments the model
    passed (attention mask, position embeddings, ...), replayed unchanged. per_layer: each layer's own arguments,
    by id(layer), where the model passes them per layer (a sliding layer's mask, Gemma 3's local RoPE); args and
    kwargs are the first layer's."""

    hidden: torch.Tensor
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    per_layer: dict = field(default_factory=dict)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layer list: the first nn.ModuleList named "layers"."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return module
    raise ValueError("model has no nn.ModuleList named 'layers'")


def calibration_batch(token_ids: list[int] | torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut token ids into as many full rows of seq_len as fit: [B, seq_len] int64.

    Raises ValueError if not even one row fits, if the text has fewer than MIN_DISTINCT_TOKENS distinct tokens,
    or if one token makes up more than MAX_TOKEN_SHARE of it: activations dominated by a repeated token say
    little about the others (GPTQ and AWQ then fit that token, and the models they write answer nonsense)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    rows = ids.numel() // seq_len
    if rows < 1:
        raise ValueError(f"need at least {seq_len} calibration tokens, got {ids.numel()}")
    distinct = ids.unique().numel()
    if distinct < MIN_DISTINCT_TOKENS:
        raise ValueError(f"calibration text has {distinct} distinct tokens; use varied text (at least "
                         f"{MIN_DISTINCT_TOKENS} distinct tokens)")
    share = torch.bincount(ids).max().item() / ids.numel()
    if share > MAX_TOKEN_SHARE:
        raise ValueError(f"one token makes up {share:.0%} of the calibration text; use varied text (at most "
                         f"{MAX_TOKEN_SHARE:.0%} for any token)")
    return ids[: rows * seq_len].view(rows, seq_len)


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, input_ids: torch.Tensor) -> LayerInputs:
    """Run the model up to its last decoder layer and return the first layer's inputs, with every layer's own
    arguments in per_layer (the last layer itself is skipped)."""
    layers, captured, handles = decoder_layers(model), {}, []

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.setdefault("hidden", hidden)
        captured[id(module)] = (args[1:], kwargs)
        if module is layers[-1]:
            raise _StopForward

    for layer in layers:
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        model(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    args, kwargs = captured[id(layers[0])]
    return LayerInputs(captured["hidden"], args, kwargs,
                       {id(layer): captured[id(layer)] for layer in layers})


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> torch.Tensor:
    """One decoder layer's output hidden states [B, T, hidden] (older HF layers return a tuple), with the
    arguments the model gives that layer."""
    args, kwargs = inputs.per_layer.get(id(layer), (inputs.args, inputs.kwargs))
    out = layer(inputs.hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Suffix ("self_attn.q_proj", ...) -> nn.Linear of one decoder layer."""
    return {suffix: layer.get_submodule(suffix) for suffix in LINEAR_SUFFIXES}


@contextmanager
def record_inputs(layer: nn.Module, on_input):
    """While active, every forward of q/o/gate/down_proj calls on_input(suffix, x) with x [tokens, K] float32."""
    handles = []
    for suffix in INPUT_OWNERS:
        def hook(_module, args, suffix=suffix):
            on_input(suffix, args[0].detach().reshape(-1, args[0].shape[-1]).float())
        handles.append(layer.get_submodule(suffix).register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def input_owner(suffix: str) -> str:
    """The linear whose recorded input a linear reads ("self_attn.v_proj" -> "self_attn.q_proj")."""
    return SHARED_INPUT.get(suffix, suffix)
