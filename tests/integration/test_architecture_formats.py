"""Weight quantization and quantized checkpoint formats of the served families beyond SmolLM (Llama 3.x, Mistral,
Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused qkv_proj / gate_up_proj), on the tiny checkpoints
transformers writes in the test (tests/tiny_models.py): `tandem quantize` (RTN INT8 / INT4), GPTQ and AWQ
calibration, HF AWQ / GPTQ directories and GGUF files (written here, with gguf-py's writer and its llama.cpp tensor
names). Each quantized model served by the engine gives HF transformers' greedy tokens, token for token, where HF's
own modeling code runs the same quantized linears (apply_quantization swaps them in by name: the engine's int8 /
int4 kernels round differently from a float matmul over the dequantized weights, so that is the exact reference);
the weights themselves are checked against an independent reading (the RTN of the original weights, or
transformers' own GGUF loader)."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.quant import QuantConfig, apply_quantization, save_quantized
from tandem.shared.quant.modules import FUSED_LINEARS, quantizable_linears
from tandem.shared.quant.rtn import fake_quantize, quantize_int4, quantize_with_params
from tandem.tools.evaluation import load_hf_model
from tandem.tools.quant import quantize_model
from tests.tiny_models import assert_greedy_equal, prompts_for, run, save_tiny

gguf = pytest.importorskip("gguf")
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "phi3"]


def original_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_engine_equals_hf(config: ModelConfig, hf, seed: int = 3) -> None:
    """Greedy tokens of four prompts (5 to 70 tokens, across blocks and windows) in one batch, engine vs HF (up to
    a tie: assert_greedy_equal)."""
    prompts = prompts_for(seed, config.vocab_size)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))
    assert_greedy_equal(run(engine, prompts), hf, prompts)


def quantized_hf(float_dir, source):
    """HF's modeling code over float_dir with the quantized linears (and float tensors) of source swapped in."""
    hf = load_hf_model(float_dir)
    apply_quantization(hf, source)
    return hf


def calibration_ids(vocab: int, n: int = 2048) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(11))


def test_phi3_fused_projections_are_split_for_quantization_as_hf_slices_them(tmp_path):
    """load_hf_model gives Phi-3 the engine's q/k/v_proj and gate/up_proj (split_fused_linears); HF's forward
    over them is the original model's, bit for bit, so the split rows are the ones HF's Phi3Attention slices."""
    path = save_tiny("phi3", tmp_path / "phi3")
    split, original = load_hf_model(path), original_hf(path)
    names = set(quantizable_linears(split))
    assert "model.layers.1.self_attn.k_proj" in names and "model.layers.1.mlp.up_proj" in names and len(names) == 14
    ids = torch.tensor([prompts_for(0, 512)["p70"]])
    with torch.inference_mode():
        assert torch.equal(split(ids).logits, original(ids).logits)
    layer = original.model.layers[0]
    assert torch.equal(torch.cat([split.model.layers[0].self_attn.get_submodule(p).weight for p in ("q_proj", "k_proj",
                                                                                                     "v_proj")]),
                       layer.self_attn.qkv_proj.weight)


@pytest.mark.parametrize("name", ["phi3", "mistral", "llama3"])
@pytest.mark.parametrize("bits", [["--bits", "8"], ["--bits", "4", "--group-size", "64"]], ids=["int8", "int4-g64"])
def test_rtn_checkpoints_equal_hf_over_the_same_quantized_layers(name, bits, tmp_path):
    """`tandem quantize --method rtn` of Phi-3 (its fused weights split), Mistral and Llama 3 (qwen2, qwen3 and
    gemma3: test_architectures.py); each linear holds the RTN of the original weight's rows."""
    from tandem.tools.quantize import main

    path, out = save_tiny(name, tmp_path / name), tmp_path / "quantized"
    assert main(["--method", "rtn", *bits, "--model", str(path), "--out", str(out)]) == 0
    hf = quantized_hf(path, out)
    original = original_hf(path)
    group = None if bits[1] == "8" else 64
    for layer, hf_layer in zip(hf.model.layers, original.model.layers):
        for fused, parts in FUSED_LINEARS.items():
            got = torch.cat([layer.get_submodule(part).dequantize() for part in parts])
            want = (hf_layer.get_submodule(fused).weight if name == "phi3"
                    else torch.cat([hf_layer.get_submodule(part).weight for part in parts]))
            torch.testing.assert_close(got, fake_quantize(want.detach(), int(bits[1]), group), atol=1e-6, rtol=0)
    config = ModelConfig.from_dir(out)
    assert config.weight_format.startswith("int8" if bits[1] == "8" else "int4-g64")
    assert config.model_type == original.config.model_type
    assert_engine_equals_hf(config, hf)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("name", FAMILIES + ["gemma2", "gemma3"])
def test_calibrated_checkpoints_equal_hf_over_the_same_quantized_layers(name, method, tmp_path):
    """GPTQ and AWQ (INT4 g64) calibrate on each family in HF's own modeling code (sliding windows, q/k norms,
    biases, Phi-3 split, Gemma's norms), write a checkpoint the engine serves as HF does, and lose about what RTN
    loses: KL of the next-token distributions over a held-out prompt at most RTN's for GPTQ (measured 0.7-0.8x),
    1.25x for AWQ (measured 0.95-1.16x: random weights have no salient channels for it to protect, and its search
    scores each linear's output, not the model's)."""
    from tandem.shared.quant import apply_quantized_state

    path, out = save_tiny(name, tmp_path / name), tmp_path / "quantized"
    model = load_hf_model(path)
    state = quantize_model(model, method, 4, 64, calibration_ids(model.config.vocab_size), seq_len=64)
    save_quantized(out, state, QuantConfig(bits=4, group_size=64, method=method), path)
    hf = quantized_hf(path, out)
    rtn = load_hf_model(path)
    apply_quantized_state(rtn, quantize_model(load_hf_model(path), "rtn", 4, 64))
    ids = torch.tensor([prompts_for(5, model.config.vocab_size)["p70"]])
    with torch.inference_mode():
        p, q, q_rtn = (m(ids).logits[0].log_softmax(-1) for m in (original_hf(path), hf, rtn))
    kl, kl_rtn = ((p.exp() * (p - logq)).sum(-1).mean().item() for logq in (q, q_rtn))
    assert kl <= (1.0 if method == "gptq" else 1.25) * kl_rtn, (name, method, kl, kl_rtn)
    config = ModelConfig.from_dir(out)
    assert config.weight_format == f"int4-g64-{method}"
    assert_engine_equals_hf(config, hf)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_awq_scale_folding_keeps_the_float_function(name, tmp_path):
    """AWQ's scales folded into norms and producer rows leave every family's logits unchanged: Qwen2's v_proj
    bias is divided with its rows, Gemma's (1 + weight) norms and its pre_feedforward_layernorm take the MLP's."""
    from tandem.tools.quant.awq import apply_layer_scales
    from tandem.tools.quant.calibration import capture_first_layer_inputs, decoder_layers, record_inputs, run_layer

    model = load_hf_model(save_tiny(name, tmp_path / name))
    ids = torch.tensor([prompts_for(8, model.config.vocab_size)["p37"]])
    before = model(ids).logits
    inputs = capture_first_layer_inputs(model, ids)
    for layer in decoder_layers(model):
        recorded = {}
        with record_inputs(layer, lambda suffix, x: recorded.setdefault(suffix, x)):
            run_layer(layer, inputs)
        apply_layer_scales(layer, recorded, 4, 64, layer.self_attn.head_dim, n_grid=4,
                           unit_offset=name.startswith("gemma"))
        inputs.hidden = run_layer(layer, inputs)
    torch.testing.assert_close(model(ids).logits, before, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-window", "gemma3"])
def test_calibration_replays_each_layer_with_its_own_mask_and_rope(name, tmp_path):
    """Replaying the decoder layers on the captured inputs (GPTQ, AWQ and the sensitivity analysis do) gives the
    model's own logits where layers differ: a sliding layer after a global one (window 24, a 37-token prompt),
    Gemma 3's local RoPE."""
    from tandem.tools.quant.calibration import capture_first_layer_inputs, decoder_layers, run_layer

    model = load_hf_model(save_tiny(name, tmp_path / name))
    ids = torch.tensor([prompts_for(8, model.config.vocab_size)["p37"]])
    with torch.inference_mode():
        inputs = capture_first_layer_inputs(model, ids)
        for layer in decoder_layers(model):
            inputs.hidden = run_layer(layer, inputs)
        torch.testing.assert_close(model.lm_head(model.model.norm(inputs.hidden)), model(ids).logits, atol=1e-5,
                                   rtol=0)


# -- HF AWQ / GPTQ directories --------------------------------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM: nibble i holds column 8c + order[i]


def pack_columns(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C // 8]; nibble i holds column 8c + order[i]."""
    groups = codes.long().view(codes.shape[0], -1, 8)
    words = sum(groups[:, :, order[i]] << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_hf_quantized(out, path, method: str, group_size: int = 64) -> dict[str, torch.Tensor]:
    """An AutoAWQ (GEMM) or GPTQ (v1) directory of the checkpoint at path, packed from the RTN INT4 of its
    linears as HF names them (Phi-3: the fused qkv_proj and gate_up_proj, as AutoAWQ and GPTQModel store them);
    biases stay float. Returns {HF linear name: the dequantized weight a reader must get}."""
    model = original_hf(path)
    state, expected = {}, {}
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and ".layers." in name):
            continue
        w = module.weight.detach()
        scales, zeros = quantize_int4(w, group_size)[1:]
        scales, zeros = scales.half().float(), zeros.round().clamp(1, 15)  # fp16 scales, integer zeros
        codes = quantize_with_params(w, scales, zeros, group_size)  # [N, K]
        expected[name] = (codes.view(*w.shape[:1], -1, group_size).float() - zeros[..., None]).mul(
            scales[..., None]).view_as(w)
        if method == "awq":
            state[f"{name}.qweight"], state[f"{name}.qzeros"] = (pack_columns(codes.T, AWQ_ORDER),
                                                                 pack_columns(zeros.T.long(), AWQ_ORDER))
        else:
            rows = codes.T.long().view(-1, 8, codes.shape[0])  # [K // 8, 8, N]: nibble i holds channel 8r + i
            words = sum(rows[:, i] << (4 * i) for i in range(8))
            state[f"{name}.qweight"] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
            state[f"{name}.qzeros"] = pack_columns(zeros.T.long() - 1)  # (v1 stores zero - 1)
            state[f"{name}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // group_size
        state[f"{name}.scales"] = scales.T.half().contiguous()
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().half()  # (fp16, as AutoAWQ and GPTQModel store it)
    linears = {f"{name}.weight" for name in expected} | {f"{name}.bias" for name in expected}
    state |= {k: v for k, v in model.state_dict().items() if k not in linears and k != "lm_head.weight"
              or k == "lm_head.weight" and not model.config.tie_word_embeddings}
    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group_size,
                                     **({"version": "gemm", "zero_point": True} if method == "awq" else {})}
    (out / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3"])
def test_hf_awq_and_gptq_directories_equal_hf_over_the_same_quantized_layers(name, method, tmp_path):
    """An HF AWQ / GPTQ directory of each family serves on its own (its config.json names the architecture):
    Qwen2's q/k/v biases kept in float beside the codes, Phi-3's fused linears split into the engine's
    projections; every linear dequantizes to the values packed in, and the tokens are HF's over those layers."""
    path, out = save_tiny(name, tmp_path / name), tmp_path / method
    expected = write_hf_quantized(out, path, method)
    hf = quantized_hf(path, out)
    linears = quantizable_linears(hf)
    for hf_name, want in expected.items():
        layer_prefix, _, proj = hf_name.rpartition(".")
        parts = FUSED_LINEARS.get(f"{layer_prefix.rpartition('.')[2]}.{proj}")
        layer = layer_prefix.rpartition(".")[0]
        got = (torch.cat([linears[f"{layer}.{p}"].dequantize() for p in parts]) if parts
               else linears[hf_name].dequantize())
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if name == "qwen2":
        torch.testing.assert_close(hf.model.layers[1].self_attn.v_proj.bias,
                                   original_hf(path).model.layers[1].self_attn.v_proj.bias.half().float())
    config = ModelConfig.from_dir(out)
    assert config.weight_format == f"int4-g64-{method}" and config.model_type == hf.config.model_type
    assert_engine_equals_hf(config, hf)


# -- GGUF files -----------------------------------------------------------------------------------------------

T = gguf.GGMLQuantizationType
GGUF_ARCH = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
LINEAR_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1)  # cycled over the linears: every family sees each type


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (LlamaModel.permute), for weights and biases."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(out, name: str, model) -> None:
    """model (HF, as transformers loads it: Phi-3 fused) as llama.cpp's converter writes it: gguf-py's tensor
    names for the architecture, q/k rows permuted for llama (which Mistral is written as), linears in
    LINEAR_TYPES, token_embd Q8_0, norms and biases F32, and the hyperparameters llama.cpp reads."""
    arch, cfg = GGUF_ARCH[name], model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for index, (hf_name, tensor) in enumerate(model.state_dict().items()):
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = tensor.detach().numpy().copy()
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
        if arch == "llama" and part in ("attn_q", "attn_k"):
            data = llama_cpp_permute(data, cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads)
        if data.ndim == 2 and (part is not None or gguf_name == "output.weight"):
            qtype = LINEAR_TYPES[index % len(LINEAR_TYPES)] if part is not None else T.Q8_0
            writer.add_tensor(gguf_name, gguf.quantize(data, qtype), raw_dtype=qtype)
        elif gguf_name == "token_embd.weight":
            writer.add_tensor(gguf_name, gguf.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            writer.add_tensor(gguf_name, data.astype(np.float32))
    if name == "llama3":  # (llama.cpp writes llama3's frequency factors; the engine computes them from config.json)
        writer.add_tensor("rope_freqs.weight", np.ones(head_dim // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_files_equal_hf_over_the_same_quantized_layers(name, tmp_path):
    """A GGUF of each family (general.architecture llama for Llama 3 and Mistral, qwen2 with its q/k/v biases,
    qwen3 with its q/k norms, phi3 with attn_qkv and ffn_up holding gate and up) served with the float
    directory's config.json: every tensor equals what transformers' own GGUF loader reads from the file
    (un-permuted, dequantized), and the tokens are HF's over the same quantized layers."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, file = save_tiny(name, tmp_path / name), tmp_path / f"{name}.gguf"
    original = original_hf(path)
    write_gguf(file, name, original)
    if name == "mistral":  # (transformers maps names through gguf-py's architecture, llama for Mistral)
        original.config.model_type = "llama"
    reference = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=original)["tensors"]
    hf = quantized_hf(path, file)
    got = {k: v for k, v in hf.state_dict().items() if not k.endswith(("qweight", "scales", "zeros"))}
    got |= {f"{n}.weight": layer.dequantize() for n, layer in quantizable_linears(hf).items()}
    if hasattr(hf.lm_head, "qweight"):  # (a Q8_0 output projection stays int8, as llama.cpp runs it)
        got["lm_head.weight"] = hf.lm_head.dequantize()
    if name == "phi3":  # (transformers reads Phi-3's fused tensors under its fused names)
        for i in range(original.config.num_hidden_layers):
            for fused, parts in FUSED_LINEARS.items():
                got[f"model.layers.{i}.{fused}.weight"] = torch.cat([got[f"model.layers.{i}.{p}.weight"]
                                                                     for p in parts])
    tied = {"lm_head.weight"} if original.config.tie_word_embeddings else set()
    assert set(reference) == set(original.state_dict()) - tied
    for key, want in reference.items():
        torch.testing.assert_close(got[key], want.float(), atol=1e-6, rtol=0, msg=key)
    config = ModelConfig.from_dir(path, quantization=str(file))
    assert config.weight_format.startswith("gguf-")
    assert_engine_equals_hf(config, hf)


def write_bare_gguf(out, arch: str, tensors: dict[str, np.ndarray], heads=(4, 2)) -> None:
    """A GGUF of arch holding one Q8_0 linear, then tensors, with the given (query, key/value) head counts."""
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(1)
    writer.add_head_count(heads[0])
    writer.add_head_count_kv(heads[1])
    writer.add_tensor("blk.0.attn_q.weight", gguf.quantize(np.ones((256, 256), dtype=np.float32), T.Q8_0),
                      raw_dtype=T.Q8_0)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, tensors, model, words", [
    ("gemma2", {}, "llama3", "GGUF architecture 'gemma2' is not supported (llama.cpp stores Gemma's norms as 1 + "
                             "weight); supported: llama (llama/mistral), qwen2 (qwen2), qwen3 (qwen3), phi3 (phi3)"),
    ("phi3", {"rope_factors_long.weight": np.ones(32, dtype=np.float32)}, "phi3",
     "rope_factors_long.weight holds longrope factors (Phi-3 128k); rope_type 'longrope' is not supported"),
    ("qwen2", {}, "llama3", "is a GGUF of architecture 'qwen2', for model_type qwen2; the model is 'llama'"),
    ("llama", {}, "qwen2", "is a GGUF of architecture 'llama', for model_type llama/mistral; the model is 'qwen2'"),
])  # fmt: skip
def test_gguf_files_the_engine_cannot_serve_are_refused_by_name(tmp_path, arch, tensors, model, words):

    path = save_tiny(model, tmp_path / model)
    write_bare_gguf(tmp_path / "m.gguf", arch, tensors)
    with pytest.raises(ValueError, match=re.escape(words)):
        LLMEngine(ModelConfig.from_dir(path, quantization=str(tmp_path / "m.gguf")), CacheConfig(16, 8),
                  SchedulerConfig(32, 8))


def test_a_gguf_with_other_head_counts_is_refused(tmp_path):
    """Same shapes, other heads: llama's q/k rows would be un-permuted wrongly, so the file is refused."""
    path = save_tiny("mistral", tmp_path / "m")
    write_bare_gguf(tmp_path / "m.gguf", "llama", {}, heads=(8, 2))
    with pytest.raises(ValueError, match="has 8 query and 2 key/value heads; the model has 4 and 2"):
        apply_quantization(load_hf_model(path), tmp_path / "m.gguf")
