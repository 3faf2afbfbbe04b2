"""Native GGUF loading: Q4_0 / Q4_1 / Q8_0 blocks repacked into the canonical layout, q/k rows un-permuted as
transformers does, tensor names mapped to HF names. The file is written here with the gguf package."""
import numpy as np
import pytest
import torch

from tandem.shared.quant import apply_quantization, detect_quant_config
from tandem.shared.quant.gguf_loader import load_gguf_state
from tandem.shared.quant.modules import quantizable_linears

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
LINEAR_TYPES = {"attn_q": T.Q4_1, "attn_k": T.Q4_0, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
                "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (rope layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' GGUF loader inverse of the above."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def write_tiny_gguf(path, model) -> dict[str, np.ndarray]:
    """Write model as a llama GGUF with mixed Q4_0/Q4_1/Q8_0 linears; return the float weights a reader should
    get (HF names, gguf's own dequantization, permutation undone)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(model.config.num_hidden_layers)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    expected = {}
    embed = model.model.embed_tokens.weight.detach().numpy()
    data = gguf.quantize(embed, T.Q8_0)
    writer.add_tensor("token_embd.weight", data, raw_dtype=T.Q8_0)
    expected["model.embed_tokens.weight"] = gguf.dequantize(data, T.Q8_0).reshape(embed.shape)
    writer.add_tensor("output_norm.weight", model.model.norm.weight.detach().numpy())
    expected["model.norm.weight"] = model.model.norm.weight.detach().numpy()
    for i, layer in enumerate(model.model.layers):
        for gname, hname in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            weight = layer.get_submodule(hname).weight.detach().numpy()
            writer.add_tensor(f"blk.{i}.{gname}.weight", weight)
            expected[f"model.layers.{i}.{hname}.weight"] = weight
        for gname, qtype in LINEAR_TYPES.items():
            weight = layer.get_submodule(HF_NAMES[gname]).weight.detach().numpy().copy()
            if gname == "ffn_up":
                weight[0, :32] = 0.3  # a constant Q4_1 block: d = 0, w = m
            n_head = {"attn_q": 4, "attn_k": 2}.get(gname)
            stored = llama_cpp_permute(weight, n_head) if n_head else weight
            data = gguf.quantize(stored, qtype)
            writer.add_tensor(f"blk.{i}.{gname}.weight", data, raw_dtype=qtype)
            deq = gguf.dequantize(data, qtype).reshape(weight.shape)
            expected[f"model.layers.{i}.{HF_NAMES[gname]}"] = hf_unpermute(deq, n_head) if n_head else deq
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_permutations_are_inverse():
    w = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(hf_unpermute(llama_cpp_permute(w, 4), 4), w)


def test_gguf_blocks_load_into_canonical_layers(tmp_path, make_tiny_llama):
    model = make_tiny_llama()
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    state, config = load_gguf_state(tmp_path / "tiny.gguf")
    assert state["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.uint8
    assert state["model.layers.0.self_attn.v_proj.qweight"].dtype == torch.int8
    assert config.method == "gguf" and detect_quant_config(tmp_path / "tiny.gguf") == config
    loaded = make_tiny_llama(seed=1)
    apply_quantization(loaded, tmp_path / "tiny.gguf")
    for name, layer in quantizable_linears(loaded).items():
        want = torch.from_numpy(expected[name])
        if "q_proj" in name or "o_proj" in name or "up_proj" in name:  # Q4_1: (q + m/d) d vs q d + m rounding
            assert torch.allclose(layer.dequantize(), want, rtol=0, atol=1e-6), name
        else:  # Q4_0, Q8_0: bit-exact
            assert torch.equal(layer.dequantize(), want), name
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(loaded.get_parameter(name).detach(), torch.from_numpy(expected[name]))


def test_gguf_unsupported_type_is_refused(tmp_path, make_tiny_llama):
    model = make_tiny_llama(layers=1)
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    weight = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    writer.add_tensor("blk.0.attn_q.weight", weight.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="F16"):
        load_gguf_state(tmp_path / "bad.gguf")


def test_truncated_or_foreign_gguf_files_are_refused_by_name(tmp_path, make_tiny_llama):
    write_tiny_gguf(tmp_path / "tiny.gguf", make_tiny_llama())
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"cut.gguf cannot be read as GGUF \(truncated or corrupt\?\): tensor "
                                         r"blk\.1\.ffn_down\.weight's data ends at byte \d+, past the file's end"):
        apply_quantization(make_tiny_llama(), tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(96))
    with pytest.raises(ValueError, match="junk.gguf"):
        detect_quant_config(tmp_path / "junk.gguf")
