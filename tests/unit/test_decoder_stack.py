"""The decoder layers as one C++ call (shared/decoder_stack.py, kernels/cpu/decoder_stack.cpp) against the Python
layers it replaces, bit for bit: the logits and every KV row written, over prefill chunks, decode steps, short
queries (verified drafts), mixed batches and an early exit, on tiny checkpoints of the families it runs (Llama,
Qwen2's biases, Mistral's window) in fp32 and bf16, dense and quantized (RTN INT8 / INT4 on gemm_vnni, where the
CPU has AVX-512 VNNI); and the rules that rebuild it, and those that keep the Python layers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.kernels import cpu_ext, cpu_qgemm
from tandem.kernels.cpu_dense import CpuDenseLinear
from tandem.shared import decoder_stack
from tandem.shared.config import ModelConfig
from tandem.shared.lora.layers import LoRAMetadata
from tandem.shared.model import load_model
from tandem.shared.model_runner import run_model
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from tests.tiny_models import save_tiny

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels are not built here")

BLOCK_SIZE = 16
G = torch.Generator().manual_seed(0)


def ids(n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=G).tolist()


# Each step: per sequence (its new tokens, how many of them want logits); sequences keep their blocks across steps.
STEPS = [
    [(ids(37), 1), (ids(70), 1)],  # prefill chunks (the prefill attention kernel)
    [(ids(1), 1), (ids(1), 1)],  # decode
    [(ids(4), 4), (ids(3), 3)],  # short queries: verified drafts (the decode kernel, a row each)
    [(ids(1), 1), (ids(20), 1)],  # mixed: a decode row beside a chunk
    [(ids(1), 1), (ids(1), 1)],
]


def forward_steps(model, kv_caches: torch.Tensor, num_layers: int | None = None) -> list[torch.Tensor]:
    """STEPS through run_model on kv_caches (written in place); the logits of each step."""
    tables, lens, logits = [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16]], [0, 0], []
    for step in STEPS:
        seqs = [(tokens, lens[i], tables[i], n) for i, (tokens, n) in enumerate(step)]
        logits.append(run_model(model, kv_caches, seqs, BLOCK_SIZE, torch.device("cpu"), num_layers))
        lens = [length + len(tokens) for length, (tokens, _) in zip(lens, step)]
    return logits


def compare(model, num_layers: int | None = None) -> None:
    """The stack's logits and KV equal the Python layers' bit for bit, and the stack ran."""
    dtype = model.model.embed_tokens.weight.dtype
    config = model.config
    pool = torch.zeros(config.num_hidden_layers, 2, 20, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                       dtype=dtype)
    runs = {}
    for use_stack in (False, True):
        model.use_decoder_stack = use_stack
        kv = pool.clone()
        runs[use_stack] = (forward_steps(model, kv, num_layers), kv)
    assert model.__dict__["_decoder_stack"][1] is not None, "the stack did not run"
    (python_logits, python_kv), (stack_logits, stack_kv) = runs[False], runs[True]
    for step, (a, b) in enumerate(zip(python_logits, stack_logits)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item()}"
    assert torch.equal(python_kv, stack_kv)


def quantize(model, kinds: str) -> None:
    """Each layer's linears as kinds[i % len(kinds)]: "8" RTN INT8 per channel, "4" RTN INT4 in groups of 64."""
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for j, name in enumerate(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            parent = attn if name in ("qkv_proj", "o_proj") else mlp
            linear = getattr(parent, name)
            kind = kinds[(i + j) % len(kinds)]
            q = WeightOnlyInt8Linear.from_float(linear) if kind == "8" else WeightOnlyInt4Linear.from_float(linear, 64)
            setattr(parent, name, q)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    return {name: save_tiny(name, root / name) for name in ("llama3", "qwen2", "mistral", "gemma2")}


@pytest.mark.parametrize("name,dtype", [("llama3", "float32"), ("llama3", "bfloat16"), ("qwen2", "float32"),
                                        ("qwen2", "bfloat16"), ("mistral", "float32")])
def test_dense_layers_match_python(checkpoints, name, dtype):
    compare(load_model(ModelConfig.from_dir(checkpoints[name], dtype=dtype)))


def test_early_exit_runs_the_first_layers(checkpoints):
    compare(load_model(ModelConfig.from_dir(checkpoints["llama3"])), num_layers=1)


@pytest.mark.skipif(not cpu_qgemm.has_vnni(), reason="gemm_vnni needs AVX-512 VNNI")
@pytest.mark.parametrize("name", ["llama3", "qwen2"])  # (qwen2: the integer path's bias add)
def test_quantized_layers_match_python(checkpoints, name):
    model = load_model(ModelConfig.from_dir(checkpoints[name]))
    quantize(model, "48")
    compare(model)


def test_forwards_register_nothing(checkpoints):
    """A forward, on either path, registers no module, parameter or buffer: the counter that rebuilds the stack
    stays where it was, and so does the stack."""
    model = load_model(ModelConfig.from_dir(checkpoints["llama3"]))
    compare(model)
    registrations, stack = decoder_stack._registrations, model.__dict__["_decoder_stack"][1]
    compare(model)
    compare(model, num_layers=1)
    assert decoder_stack._registrations == registrations
    assert model.__dict__["_decoder_stack"][1] is stack


def test_float_weights_changed_in_place_or_replaced(checkpoints):
    model = load_model(ModelConfig.from_dir(checkpoints["llama3"]))
    compare(model)
    first = model.__dict__["_decoder_stack"][1]
    with torch.no_grad():  # in place: the stack holds these very tensors
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        model.model.layers[0].post_attention_layernorm.weight.mul_(0.5)
    compare(model)
    assert model.__dict__["_decoder_stack"][1] is first
    state = {k: v.clone() * 0.5 if k.endswith("o_proj.weight") else v for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new tensors
    compare(model)
    assert model.__dict__["_decoder_stack"][1] is not first
    second = model.__dict__["_decoder_stack"][1]
    with torch.no_grad():  # a new parameter (the registration hooks) and new storage (.data): both seen
        model.model.layers[0].mlp.down_proj.weight = nn.Parameter(model.model.layers[0].mlp.down_proj.weight * 0.5)
        model.model.layers[1].self_attn.qkv_proj.weight.data = model.model.layers[1].self_attn.qkv_proj.weight * 2
    compare(model)
    assert model.__dict__["_decoder_stack"][1] is not second
    third = model.__dict__["_decoder_stack"][1]
    old = model.model.layers[1].self_attn.o_proj  # a module swapped
    new = CpuDenseLinear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 0.7)
    model.model.layers[1].self_attn.o_proj = new
    compare(model)
    assert model.__dict__["_decoder_stack"][1] is not third
    model.to(torch.bfloat16).to(torch.float32)  # rounded in place, no forward between
    compare(model)


def test_early_exit_counts_layers_as_the_python_slice(checkpoints):
    compare(load_model(ModelConfig.from_dir(checkpoints["llama3"])), num_layers=-1)


@pytest.mark.skipif(not cpu_qgemm.has_vnni(), reason="gemm_vnni needs AVX-512 VNNI")
def test_rebuilt_when_quantized_codes_change(checkpoints):
    model = load_model(ModelConfig.from_dir(checkpoints["llama3"]))
    quantize(model, "4")
    compare(model)
    first = model.__dict__["_decoder_stack"][1]
    with torch.no_grad():  # the packed layout derived from them is stale
        model.model.layers[0].self_attn.qkv_proj.qweight.copy_(model.model.layers[1].self_attn.qkv_proj.qweight)
    compare(model)
    assert model.__dict__["_decoder_stack"][1] is not first


def test_python_layers_where_the_stack_does_not_apply(checkpoints):
    gemma = load_model(ModelConfig.from_dir(checkpoints["gemma2"]))  # Gemma's norms
    x = torch.zeros(3, gemma.config.hidden_size)
    pool = torch.zeros(2, 2, 4, BLOCK_SIZE, 2, 64)
    meta = _meta()
    assert decoder_stack.for_forward(gemma, x, pool, meta, None) is None
    model = load_model(ModelConfig.from_dir(checkpoints["llama3"]))
    assert decoder_stack.for_forward(model, x, pool, meta, None) is not None
    lora = LoRAMetadata.build([0, 3], [0])
    assert decoder_stack.for_forward(model, x, pool, meta, lora) is None  # an adapter in the batch
    assert decoder_stack.for_forward(model, x, pool.to(torch.bfloat16), meta, None) is None  # KV of another dtype
    meta.kv_quant = "int8"
    assert decoder_stack.for_forward(model, x, pool, meta, None) is None  # quantized KV
    model.use_decoder_stack = False
    assert decoder_stack.for_forward(model, x, pool, _meta(), None) is None


def _meta():
    from tandem.shared.attention import AttentionMetadata

    i32 = dict(dtype=torch.int32)
    return AttentionMetadata(torch.arange(3), [0, 3], [3], torch.ones(1, 1, **i32), torch.tensor([0, 3], **i32),
                             torch.tensor([3], **i32))
