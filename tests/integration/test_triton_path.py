"""The GPU code path without a GPU: with TANDEM_TRITON_ON_CPU=1 and TRITON_INTERPRET=1 the engine sends its KV
writes, paged attention (extend and decode) and quantized GEMMs through the Triton kernels, run on the CPU by the
interpreter. It must give the same greedy tokens as the torch path for fp32, INT8 per channel, INT4 with a
padded group (576 / 128), a mixed-precision checkpoint and outlier-aware INT8. The interpreter is slow (INT4 runs at about 1 s per linear), so the model is the default
one cut to its first decoder layer (real weights and shapes) and the run is three steps: a 24-token chunk, a mixed
step (the rest of that prompt over its cached prefix, plus a whole 3-token prompt), then a decode step of both.
Each path runs in its own subprocess: TRITON_INTERPRET is read when triton is first imported, and
TANDEM_TRITON_ON_CPU when shared.device is."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

# NOTE: never import triton here: this process must not import it before tests/unit/kernels sets
# TRITON_INTERPRET=1 (triton reads it once, at import).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
REPO = Path(__file__).resolve().parents[2]
NUM_LAYERS = 1

SCRIPT = r"""
import collections, json, sys, torch
torch.set_num_threads(1)
import tandem.kernels.kv_cache_write, tandem.kernels.paged_attention, tandem.kernels.prefill_attention, tandem.kernels.quant_gemm
from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams

model_dir, quantization = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "none" else None
kv_dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
config = ModelConfig.from_dir(model_dir, quantization)
prompts = [list(range(100, 140)), list(range(300, 303))]  # 40 tokens: two chunks of 24 (extend over a prefix)
calls = collections.Counter()


def count_calls(module, name):  # the engine imports kernels lazily, by module attribute, so this sees each launch
    kernel = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)

    setattr(module, name, counted)


count_calls(tandem.kernels.kv_cache_write, "write_kv_cache")
count_calls(tandem.kernels.paged_attention, "paged_decode_attention")
count_calls(tandem.kernels.prefill_attention, "paged_prefill_attention")
count_calls(tandem.kernels.quant_gemm, "w8a16_gemm")
count_calls(tandem.kernels.quant_gemm, "w4a16_gemm")

engine = LLMEngine(config, CacheConfig(16, 64, kv_dtype), SchedulerConfig(24, 4))
tokens = {}
for i, ids in enumerate(prompts):
    engine.add_request(Request(str(i), ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    tokens[str(i)] = []
while engine.has_unfinished_requests():
    for o in engine.step():
        assert o.error is None, o.error
        tokens[o.request_id] += o.new_token_ids
print(json.dumps({"weight_format": config.weight_format, "tokens": tokens, "calls": dict(calls),
                  "num_free_blocks": engine.num_free_blocks}))
"""


@pytest.fixture(scope="module")
def cut_model_dir(model_dir, tmp_path_factory):
    """The default model's first NUM_LAYERS decoder layer(s), embeddings, final norm and tokenizer files."""
    out = tmp_path_factory.mktemp("cut_model")
    for f in Path(model_dir).iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["num_hidden_layers"] = NUM_LAYERS
    (out / "config.json").write_text(json.dumps(config))
    state = {}
    for path in Path(model_dir).glob("*.safetensors"):
        state.update(load_file(str(path)))
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < NUM_LAYERS}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run_engine(triton_on_cpu: str, *args) -> dict:
    """Greedy tokens, kernel calls and free blocks of one engine run in a fresh process with
    TANDEM_TRITON_ON_CPU=triton_on_cpu (shared.device reads it once, at import)."""
    env = dict(os.environ, TRITON_INTERPRET="1", TANDEM_TRITON_ON_CPU=triton_on_cpu, PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare_paths(*args):
    """The torch path and the Triton path (interpreted) of the same run must give the same greedy tokens."""
    torch_path = run_engine("0", *args)
    assert not torch_path["calls"], torch_path["calls"]
    assert torch_path["num_free_blocks"] == 64
    triton_path = run_engine("1", *args)
    calls = triton_path["calls"]
    print(triton_path["weight_format"], torch_path["tokens"], triton_path["tokens"], calls)
    assert triton_path["num_free_blocks"] == 64
    assert torch_path["tokens"] == triton_path["tokens"]
    weight_format = triton_path["weight_format"]
    gemms = ({"w4a16_gemm", "w8a16_gemm"} if "-mix" in weight_format else
             {"fp32": set(), "int8": {"w8a16_gemm"}, "int8-llmint8": {"w8a16_gemm"},
              "int4-g128-rtn": {"w4a16_gemm"}}[weight_format])
    assert set(calls) == {"write_kv_cache", "paged_decode_attention", "paged_prefill_attention"} | gemms, calls


# (INT8 and INT4: .ci/run's heavy pass, as are the mixed and llmint8 checkpoints below; make test runs the quantized
# GEMM kernels in their own tests, tests/unit/kernels/test_quant_gemm.py)
@pytest.mark.parametrize("fmt", ["fp32", pytest.param("int8", marks=pytest.mark.heavy),
                                 pytest.param("int4-g128", marks=pytest.mark.heavy)])
def test_triton_path_gives_the_torch_path_tokens(cut_model_dir, tmp_path, fmt):
    if fmt == "fp32":
        return compare_paths(cut_model_dir)
    quantized = tmp_path / fmt
    bits = ["--bits", "8"] if fmt == "int8" else ["--bits", "4", "--group-size", "128"]
    subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", *bits,
                    "--model", str(cut_model_dir), "--out", str(quantized)], check=True, timeout=300)
    compare_paths(cut_model_dir, quantized)


def test_triton_path_reads_and_writes_a_quantized_kv_cache(cut_model_dir):
    """fp8_e4m3 KV (kernels/kv_quant.py): the Triton write kernel quantizes (byte-exact to the torch path's), the
    decode and prefill kernels read the codes in place; the same greedy tokens as the torch path."""
    compare_paths(cut_model_dir, "none", "fp8_e4m3")


@pytest.mark.heavy
def test_triton_path_runs_mixed_precision_and_outlier_int8(cut_model_dir, tmp_path):
    """A mixed checkpoint (k_proj float inside an INT4 qkv: the unfused ConcatLinear; down_proj INT8) and an
    outlier-aware INT8 one (the INT8 GEMM plus the float outlier columns) on the GPU code path. (.ci/run's heavy
    pass: 20 s of the interpreter, for layer formats the CPU path's tests cover.)"""
    from tandem.shared.quant import QuantConfig, save_quantized
    from tandem.tools.quant import quantize_model
    from tandem.tools.evaluation import load_hf_model

    layer_formats = {"model.layers.0.self_attn.k_proj": "float", "model.layers.0.mlp.down_proj": "int8"}
    model = load_hf_model(cut_model_dir)
    config = QuantConfig(bits=4, group_size=128, method="rtn", layer_formats=tuple(sorted(layer_formats.items())))
    save_quantized(tmp_path / "mixed", quantize_model(model, "rtn", 4, 128, layer_formats=layer_formats), config,
                   cut_model_dir)
    compare_paths(cut_model_dir, tmp_path / "mixed")
    subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "llmint8", "--bits", "8",
                    "--outlier-threshold", "1.0", "--model", str(cut_model_dir), "--out", str(tmp_path / "llmint8")],
                   check=True, timeout=300)  # fmt: skip
    compare_paths(cut_model_dir, tmp_path / "llmint8")


@pytest.mark.parametrize("name", ["gemma2", pytest.param("mistral", marks=pytest.mark.heavy)])
def test_triton_path_runs_sliding_windows_and_soft_capping(tmp_path, name):
    """Gemma 2 (a windowed and a global layer, attention-logit soft-capping) and Mistral (every layer windowed, so
    blocks before the window are freed mid-request) on the GPU code path: the 40-token prompt is past the 24-token
    window of tests/tiny_models.py. (Mistral: .ci/run's heavy pass.)"""
    from tests.tiny_models import save_tiny

    compare_paths(save_tiny(name, tmp_path / name))
