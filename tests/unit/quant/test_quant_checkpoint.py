"""Checkpoint formats: tandem save/load round trip, HF AWQ / HF GPTQ layouts packed here by hand from known
integers, and GGUF Q4_0 / Q4_1 / Q8_0 files written with the gguf package (including llama.cpp's q/k row
permutation). Every check is exact against the integers and scales that went in."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.kernels.int4_format import unpack_int4
from tandem.shared.quant import apply_quantization, apply_quantized_state, detect_quant_config
from tandem.tools.quant import quantize_model
from tandem.shared.quant.checkpoint import load_quantized_state, save_quantized
from tandem.shared.quant.config import QuantConfig
from tandem.shared.quant.hf_formats import convert_hf_awq, convert_hf_gptq
from tandem.shared.quant.modules import quantizable_linears


AUTOAWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ WQLinear_GEMM: nibble i holds channel 8c + order[i]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C // 8]; nibble i holds column 8c + AUTOAWQ_ORDER[i] (AutoAWQ's GEMM packer)."""
    groups = codes.long().view(codes.shape[0], -1, 8)
    words = sum(groups[:, :, AUTOAWQ_ORDER[i]] << (4 * i) for i in range(8))
    return to_int32(words)


def pack_gptq_rows(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] ints -> int32 [K // 8, N]; nibble i of row r holds input channel 8r + i."""
    groups = codes.long().view(-1, 8, codes.shape[1])
    return to_int32(sum(groups[:, i] << (4 * i) for i in range(8)))


def pack_gptq_cols(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] ints -> int32 [R, N // 8]; nibble i holds column 8c + i."""
    groups = codes.long().view(codes.shape[0], -1, 8)
    return to_int32(sum(groups[:, :, i] << (4 * i) for i in range(8)))


def known_int4(n=16, k=96, group_size=32, seed=0):
    """codes [N, K] in [0, 15], fp16-exact scales and integer zeros [N, ceil(K / G)] in [1, 15]."""
    torch.manual_seed(seed)
    groups = -(-k // group_size)
    codes = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, groups) + 0.01).half().float()
    zeros = torch.randint(1, 16, (n, groups)).float()
    return codes, scales, zeros


def test_awq_packer_matches_a_hand_computed_word():
    # channels 0..7 hold 1..8; nibbles low to high hold channels 0, 2, 4, 6, 1, 3, 5, 7 -> 0x86427531
    assert pack_awq(torch.arange(1, 9)[None]).item() == 0x86427531 - 2**32


@pytest.mark.parametrize("k,group_size", [(96, 32), (96, 64)])  # 96 / 64: a partial last group
def test_hf_awq_layout_converts_exactly(k, group_size):
    codes, scales, zeros = known_int4(k=k, group_size=group_size)
    prefix = "model.layers.0.mlp.down_proj"
    state = {f"{prefix}.qweight": pack_awq(codes.T), f"{prefix}.qzeros": pack_awq(zeros.T.long()),
             f"{prefix}.scales": scales.T.half(), "model.norm.weight": torch.ones(4)}
    out, config = convert_hf_awq(state, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "version": "gemm", "zero_point": True})
    assert config.weight_format == f"int4-g{group_size}-awq"
    assert torch.equal(unpack_int4(out[f"{prefix}.qweight"])[:, :k], codes.to(torch.uint8))
    assert torch.equal(out[f"{prefix}.scales"], scales) and torch.equal(out[f"{prefix}.zeros"], zeros)
    assert torch.equal(out["model.norm.weight"], torch.ones(4))


@pytest.mark.parametrize("checkpoint_format,offset", [(None, 1), ("gptq_v2", 0)])
def test_hf_gptq_layout_converts_exactly(checkpoint_format, offset):
    codes, scales, zeros = known_int4(k=96, group_size=32)
    prefix = "model.layers.1.self_attn.o_proj"
    state = {f"{prefix}.qweight": pack_gptq_rows(codes.T), f"{prefix}.qzeros": pack_gptq_cols(zeros.T.long() - offset),
             f"{prefix}.scales": scales.T.half(), f"{prefix}.g_idx": torch.arange(96, dtype=torch.int32) // 32}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": checkpoint_format}
    out, config = convert_hf_gptq(state, qc)
    assert config.weight_format == "int4-g32-gptq"
    assert torch.equal(unpack_int4(out[f"{prefix}.qweight"]), codes.to(torch.uint8))
    assert torch.equal(out[f"{prefix}.scales"], scales) and torch.equal(out[f"{prefix}.zeros"], zeros)


def test_hf_gptq_refuses_act_order_and_other_bits():
    codes, scales, zeros = known_int4(k=64, group_size=32)
    prefix = "model.layers.0.mlp.up_proj"
    state = {f"{prefix}.qweight": pack_gptq_rows(codes.T), f"{prefix}.qzeros": pack_gptq_cols(zeros.T.long() - 1),
             f"{prefix}.scales": scales.T.half(), f"{prefix}.g_idx": (torch.arange(64) % 2).int()}
    with pytest.raises(ValueError, match="g_idx"):
        convert_hf_gptq(state, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="4-bit"):
        convert_hf_gptq(state, {"quant_method": "gptq", "bits": 8, "group_size": 32})


def write_hf_checkpoint(path, model, method: str) -> None:
    """An HF AWQ or GPTQ directory for the tiny model, packed from its RTN g32 canonical tensors."""
    path.mkdir()
    canonical = quantize_model(model, "rtn", 4, 32)
    state = {}
    for name in quantizable_linears(model):
        codes = unpack_int4(canonical[f"{name}.qweight"])  # [N, K]
        zeros = canonical[f"{name}.zeros"].round().clamp(1, 15)  # integer zeros; GPTQ v1 stores zero - 1 >= 0
        canonical[f"{name}.zeros"] = zeros
        if method == "awq":
            state[f"{name}.qweight"], state[f"{name}.qzeros"] = pack_awq(codes.T), pack_awq(zeros.T.long())
        else:
            state[f"{name}.qweight"] = pack_gptq_rows(codes.T)
            state[f"{name}.qzeros"] = pack_gptq_cols(zeros.T.long() - 1).contiguous()
            state[f"{name}.g_idx"] = torch.arange(codes.shape[1], dtype=torch.int32) // 32
        state[f"{name}.scales"] = canonical[f"{name}.scales"].T.half().contiguous()
        canonical[f"{name}.scales"] = canonical[f"{name}.scales"].half().float()
    state |= {k: v for k, v in canonical.items() if not k.endswith((".qweight", ".scales", ".zeros"))}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": {"quant_method": method, "bits": 4, "group_size": 32}}
    (path / "config.json").write_text(json.dumps(config))
    return canonical


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_hf_checkpoint_dir_applies_to_a_model(tmp_path, make_tiny_llama, method):
    canonical = write_hf_checkpoint(tmp_path / "ckpt", make_tiny_llama(), method)
    expected = apply_quantized_state(make_tiny_llama(), canonical)
    loaded = make_tiny_llama(seed=1)  # different weights: everything must come from the checkpoint
    assert apply_quantization(loaded, tmp_path / "ckpt").weight_format == f"int4-g32-{method}"
    ids = torch.randint(0, 128, (1, 20))
    assert torch.equal(loaded(ids).logits, expected(ids).logits)


@pytest.mark.parametrize("method,bits,group_size", [("awq", 4, 32), ("rtn", 8, None), ("gptq", 4, 64)])
def test_tandem_checkpoint_round_trip(tmp_path, make_tiny_llama, method, bits, group_size):
    model = make_tiny_llama()
    (tmp_path / "src").mkdir()
    model.config.save_pretrained(tmp_path / "src")
    state = quantize_model(model, method, bits, group_size, torch.randint(0, 128, (64,)), seq_len=32)
    config = QuantConfig(bits=bits, group_size=group_size, method=method)
    save_quantized(tmp_path / "q", state, config, tmp_path / "src")
    assert detect_quant_config(tmp_path / "q") == config
    loaded_state, loaded_config = load_quantized_state(tmp_path / "q")
    assert loaded_config == config and loaded_state.keys() == state.keys()
    assert all(torch.equal(loaded_state[k], v) for k, v in state.items())
    expected = apply_quantized_state(model, state)
    loaded = make_tiny_llama(seed=1)
    apply_quantization(loaded, tmp_path / "q")
    ids = torch.randint(0, 128, (1, 20))
    assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_float_checkpoint_is_refused(tmp_path, make_tiny_llama):
    make_tiny_llama().save_pretrained(tmp_path)
    assert detect_quant_config(tmp_path).weight_format == "fp32"
    with pytest.raises(ValueError, match="float checkpoint"):
        apply_quantization(make_tiny_llama(), tmp_path)


@pytest.fixture
def rtn4_checkpoint(tmp_path, make_tiny_llama):
    """A tandem INT4 g32 checkpoint of the tiny model at tmp_path / "q"; returns (dir, its state dict)."""
    model = make_tiny_llama()
    (tmp_path / "src").mkdir()
    model.config.save_pretrained(tmp_path / "src")
    state = quantize_model(model, "rtn", 4, 32)
    save_quantized(tmp_path / "q", state, QuantConfig(bits=4, group_size=32, method="rtn"), tmp_path / "src")
    return tmp_path / "q", state


def rewrite(path, state=None, **quant_config):
    """Overwrite a tandem checkpoint's tensors and/or fields of its quantization_config."""
    if state is not None:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quant_config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage,error", [
    ("drop model.norm.weight", "lacks 1 float tensors, e.g. model.norm.weight"),
    ("drop a linear", "lacks 1 linear layers"),
    ("nan scale", "'model.layers.1.self_attn.o_proj.scales' holds NaN or inf"),
    ("config says int8", "says model.layers.0.self_attn.q_proj is int8, but it holds int4-g32 weights"),
    ("config says g128", "says model.layers.0.self_attn.q_proj is int4-g128, but it holds int4-g32 weights"),
    ("config says awq layout", "quant_method 'awq' but lacks the tensor"),
    ("truncated file", "model.safetensors cannot be read"),
    ("config says gguf", "method is rtn, gptq or awq, not 'gguf'"),
    ("stale second shard", "zz-old.safetensors repeats .* tensors of another shard"),
    ("int4 without zeros", "model.layers.0.mlp.down_proj: int4 tensors lack zeros"),
])
def test_damaged_or_mislabelled_checkpoints_are_refused(make_tiny_llama, rtn4_checkpoint, damage, error):
    path, state = rtn4_checkpoint
    if damage == "drop model.norm.weight":
        rewrite(path, {k: v for k, v in state.items() if k != "model.norm.weight"})
    elif damage == "drop a linear":
        rewrite(path, {k: v for k, v in state.items() if not k.startswith("model.layers.1.mlp.up_proj.")})
    elif damage == "nan scale":
        scales = state["model.layers.1.self_attn.o_proj.scales"].clone()
        scales[0, 0] = float("nan")
        rewrite(path, state | {"model.layers.1.self_attn.o_proj.scales": scales})
    elif damage == "config says int8":
        rewrite(path, bits=8, group_size=None)
    elif damage == "config says g128":
        rewrite(path, group_size=128)
    elif damage == "config says awq layout":
        rewrite(path, quant_method="awq")
    elif damage == "config says gguf":
        rewrite(path, method="gguf", gguf_type="q4_0")
    elif damage == "stale second shard":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "zz-old.safetensors"))
    elif damage == "int4 without zeros":
        rewrite(path, {k: v for k, v in state.items() if k != "model.layers.0.mlp.down_proj.zeros"})
    else:
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=error):
        apply_quantization(make_tiny_llama(seed=1), path)
