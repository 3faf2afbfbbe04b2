"""Quantized weights through the cluster: the same greedy tokens as the same quantized model in one process
(INT8, and a mixed-precision checkpoint made under a byte budget); finite logits on a 2,000-token prompt in every
format."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tests.integration.helpers import generate_all, greedy_request
from tests.prompts import LONG_TEXT, PROMPTS, prompt_token_ids

NUM_TOKENS = 24


def in_process_greedy(model_config, prompts):
    engine = LLMEngine(model_config, CacheConfig(16, 256), SchedulerConfig(256, 8))
    outs = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Request(str(i), ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0)))
        outs[str(i)] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return [outs[str(i)] for i in range(len(prompts))]


def test_int8_cluster_matches_int8_in_process(model_dir, int8_dir, tokenizer):
    from tandem.services.launcher import LocalCluster

    cases = [p for p in PROMPTS if p[0] in ("capital", "raw_story", "chinese_chat")]
    config = ModelConfig.from_dir(model_dir, str(int8_dir))
    assert config.weight_format == "int8"
    expected = in_process_greedy(config, [prompt_token_ids(tokenizer, kind, text) for _, kind, text in cases])
    quant = ["--quantization", str(int8_dir)]
    engine = ["--num-blocks", "256", "--threads", "1", *quant]
    with LocalCluster(str(model_dir), prefill_args=engine + ["--max-num-batched-tokens", "32"], decode_args=engine,
                      gateway_args=quant) as c:  # fmt: skip
        outs = generate_all(c.gateway_address, [greedy_request(kind, text, NUM_TOKENS) for _, kind, text in cases])
    assert [o.token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def mixed_dir(model_dir, tmp_path_factory):
    """INT4 g128 with 3 MiB of budget to keep the most sensitive linears in float; returns (checkpoint dir, byte
    budget). The sensitivities come from a file (the analysis itself is tested in tests/unit/quant): every v_proj
    ranks first, so float v_proj sit beside INT4 q/k_proj and the fused qkv_proj cannot be one matmul."""
    from tandem.shared.quant import float_tensors
    from tandem.shared.quant.modules import quantizable_linears
    from tandem.tools.quant.sensitivity import format_bytes
    from tandem.tools.evaluation import load_hf_model

    model = load_hf_model(model_dir)
    linears = quantizable_linears(model)
    base = sum(t.numel() * t.element_size() for t in float_tensors(model).values())
    base += sum(format_bytes("int4-g128", m.out_features, m.in_features) for m in linears.values())
    budget = base + 3 * 2**20
    tmp = tmp_path_factory.mktemp("mixed")
    analysis = {"format": "int4-g128", "linears": [{"name": name, "kl": 1.0 if "v_proj" in name else 0.001}
                                                   for name in linears]}
    (tmp / "sensitivity.json").write_text(json.dumps(analysis))
    out = tmp / "SmolLM2-mixed"
    subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", "--bits", "4", "--budget-bytes",
                    str(budget), "--high-precision", "float", "--sensitivity", str(tmp / "sensitivity.json"),
                    "--calib-windows", "1", "--calib-seq-len", "64", "--out", str(out), "--model", str(model_dir)],
                   check=True, timeout=900)  # fmt: skip
    return out, budget


@pytest.mark.heavy  # (.ci/run's heavy pass: a cluster of its own, 17 s; mixed checkpoints: tests/unit/quant/)
def test_mixed_checkpoint_serves_token_exact_within_its_budget(model_dir, mixed_dir, tokenizer):
    from tandem.services.launcher import LocalCluster
    from tandem.shared.model_files import read_safetensors
    from tandem.shared.quant.layers import ConcatLinear
    from tandem.tools.quant.sensitivity import format_bytes

    path, budget = mixed_dir
    config = ModelConfig.from_dir(model_dir, str(path))
    layer_formats = json.loads((path / "config.json").read_text())["quantization_config"]["layer_formats"]
    assert set(layer_formats.values()) == {"float"} and all("v_proj" in name for name in layer_formats)
    assert len(layer_formats) == 3 * 2**20 // (192 * 576 * 4 - format_bytes("int4-g128", 192, 576))
    assert config.weight_format.startswith("int4-g128-rtn-mix")
    assert sum(t.numel() * t.element_size() for t in read_safetensors(path).values()) <= budget
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(256, 8))
    kinds = {type(m) for m in engine.model_runner.model.modules()}
    print(f"{len(layer_formats)} linears in float: {sorted(layer_formats)}")
    # a float v_proj beside INT4 q/k: unfused (the float one an nn.Linear, CpuDenseLinear on the CPU)
    assert ConcatLinear in kinds and any(issubclass(kind, torch.nn.Linear) for kind in kinds)
    del engine
    cases = [p for p in PROMPTS if p[0] in ("capital", "raw_story", "long_summary")]
    expected = in_process_greedy(config, [prompt_token_ids(tokenizer, kind, text) for _, kind, text in cases])
    engine = ["--num-blocks", "256", "--threads", "1", "--quantization", str(path)]
    with LocalCluster(str(model_dir), prefill_args=engine + ["--max-num-batched-tokens", "32"], decode_args=engine,
                      gateway_args=["--quantization", str(path)]) as c:  # fmt: skip
        outs = generate_all(c.gateway_address, [greedy_request(kind, text, NUM_TOKENS) for _, kind, text in cases])
    assert [o.token_ids for o in outs] == expected


def test_model_id_names_the_weights_whichever_flag_brings_them(model_dir, int8_dir, tmp_path):
    over_base, alone = ModelConfig.from_dir(model_dir, str(int8_dir)), ModelConfig.from_dir(int8_dir)
    assert over_base.model_id == alone.model_id and alone.model_id.endswith(":int8")
    assert over_base.model_id != ModelConfig.from_dir(model_dir).model_id
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.1}))  # same weights, other model
    assert ModelConfig.from_dir(tmp_path, str(int8_dir)).model_id != alone.model_id


@pytest.mark.parametrize("fmt", [pytest.param("fp32", marks=pytest.mark.heavy),
                                 pytest.param("int8", marks=pytest.mark.heavy), "gguf"])  # (gguf: the default)
def test_long_prompt_gives_finite_logits(model_dir, int8_dir, tokenizer, fmt):
    config = ModelConfig.from_dir(model_dir, {"fp32": None, "int8": str(int8_dir), "gguf": "gguf"}[fmt])
    ids = tokenizer((LONG_TEXT + "\n") * 8, add_special_tokens=False).input_ids[:2000]
    assert len(ids) == 2000
    engine = LLMEngine(config, CacheConfig(16, 200), SchedulerConfig(512, 8))
    engine.add_request(Request("long", ids, SamplingParams(max_tokens=1, temperature=0.0)))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].error is None and len(outs[-1].new_token_ids) == 1


def test_non_finite_logits_fail_the_request_not_the_batch(model_config):
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(256, 8))
    with torch.no_grad():
        engine.model_runner.model.model.norm.weight[0] = float("nan")
    engine.add_request(Request("bad", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0)))
    outs = engine.step()
    assert outs[0].finish_reason.value == "abort" and "non-finite" in outs[0].error
    assert engine.num_free_blocks == 64 and not engine.has_unfinished_requests()


def test_up_with_an_unreadable_quantization_says_why_in_one_line(model_dir, tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(96))
    result = subprocess.run([sys.executable, "-m", "tandem.services", "up", "--model", str(model_dir), "--threads", "1",
                             "--quantization", str(tmp_path / "junk.gguf"), "--prompt", "hi"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "junk.gguf cannot be read as GGUF" in last, last
