"""QuantConfig naming/validation and the CLI functions the tandem CLI wires (quantize, eval-quant)."""
import argparse

import pytest
import torch

from tandem.shared.quant import QuantConfig, apply_quantization, apply_quantized_state, detect_quant_config

from tandem.tools.quant import quantize_model
from tandem.tools.eval_quant import _parse_method, add_eval_args, run_eval
from tandem.tools.quantize import add_quantize_args, run_quantize


@pytest.mark.parametrize("config,name", [
    (QuantConfig(), "fp32"),
    (QuantConfig(bits=8, method="rtn"), "int8"),
    (QuantConfig(bits=8, method="gptq"), "int8-gptq"),
    (QuantConfig(bits=4, group_size=128, method="gptq"), "int4-g128-gptq"),
    (QuantConfig(bits=4, group_size=32, method="rtn"), "int4-g32-rtn"),
    (QuantConfig(bits=4, group_size=32, method="gguf", gguf_type="q4_1"), "gguf-q4_1"),
    (QuantConfig(bits=8, group_size=32, method="gguf", gguf_type="q8_0"), "gguf-q8_0"),
])
def test_weight_format_names(config, name):
    assert config.weight_format == name
    if config.bits is not None:
        assert QuantConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("kwargs", [dict(bits=3, method="rtn"), dict(bits=4, group_size=100, method="rtn"),
                                    dict(bits=8, group_size=128, method="rtn"), dict(bits=4, group_size=128),
                                    dict(group_size=128), dict(bits=4, group_size=32, method="gguf")])
def test_invalid_configs_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        QuantConfig(**kwargs)


def test_quantize_command_writes_a_loadable_checkpoint(tmp_path, make_tiny_llama):
    make_tiny_llama().save_pretrained(tmp_path / "src")
    parser = argparse.ArgumentParser()
    add_quantize_args(parser)
    args = parser.parse_args(["--method", "rtn", "--bits", "4", "--group-size", "32",
                              "--model", str(tmp_path / "src"), "--out", str(tmp_path / "q")])
    assert run_quantize(args) == 0
    assert detect_quant_config(tmp_path / "q").weight_format == "int4-g32-rtn"
    loaded, expected = make_tiny_llama(seed=1), make_tiny_llama()
    apply_quantization(loaded, tmp_path / "q")
    apply_quantized_state(expected, quantize_model(expected, "rtn", 4, 32))
    ids = torch.randint(0, 128, (1, 16))
    assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_eval_method_names():
    assert _parse_method("gptq4", 64) == ("gptq", 4, 64)
    assert _parse_method(" rtn8", 128) == ("rtn", 8, None)
    assert _parse_method("gguf", 128) == ("gguf", None, None)
    with pytest.raises(ValueError):
        _parse_method("rtn3", 128)
    with pytest.raises(ValueError):
        _parse_method("awq4", 100)


def test_eval_refuses_fewer_than_2000_positions():
    parser = argparse.ArgumentParser()
    add_eval_args(parser)
    with pytest.raises(ValueError, match="2000"):
        run_eval(parser.parse_args(["--max-positions", "512"]))


def quantize_args(*argv):
    parser = argparse.ArgumentParser()
    add_quantize_args(parser)
    return parser.parse_args(["--method", "rtn", "--bits", "8", *argv])


def eval_args(*argv):
    parser = argparse.ArgumentParser()
    add_eval_args(parser)
    return parser.parse_args(list(argv))


def test_quantize_never_writes_into_an_existing_model(tmp_path, make_tiny_llama):
    make_tiny_llama().save_pretrained(tmp_path / "src")
    before = {f.name: f.read_bytes() for f in (tmp_path / "src").iterdir()}
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        run_quantize(quantize_args("--model", str(tmp_path / "src"), "--out", str(tmp_path / "src")))
    assert {f.name: f.read_bytes() for f in (tmp_path / "src").iterdir()} == before
    assert run_quantize(quantize_args("--model", str(tmp_path / "src"), "--out", str(tmp_path / "q"))) == 0
    with pytest.raises(ValueError, match="is a quantized checkpoint; --model needs the float model"):
        run_quantize(quantize_args("--model", str(tmp_path / "q"), "--out", str(tmp_path / "q2")))
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "src" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if k != "model.norm.weight"}, str(weights))
    with pytest.raises(ValueError, match="lacks 1 weights, e.g. model.norm.weight"):
        run_quantize(quantize_args("--model", str(tmp_path / "src"), "--out", str(tmp_path / "q3")))


def test_eval_checks_its_arguments_before_any_work(tmp_path, make_tiny_llama):
    with pytest.raises(ValueError, match="--seq-len must be at least 1"):
        run_eval(eval_args("--seq-len", "0"))
    with pytest.raises(ValueError, match="nothing to evaluate"):
        run_eval(eval_args("--methods", ","))
    make_tiny_llama().save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="is a float checkpoint"):
        run_eval(eval_args("--methods", "rtn8", "--checkpoint", str(tmp_path / "float"), "--model", "/nonexistent"))


def test_calibration_text_must_be_varied():
    from tandem.tools.quant.calibration import MIN_DISTINCT_TOKENS, calibration_batch

    assert calibration_batch(torch.arange(64), 32).shape == (2, 32)
    with pytest.raises(ValueError, match="distinct tokens"):
        calibration_batch(torch.arange(MIN_DISTINCT_TOKENS - 1).repeat(4), 32)
    with pytest.raises(ValueError, match="one token makes up 62% of the calibration text"):
        calibration_batch(torch.cat([torch.zeros(100, dtype=torch.long), torch.arange(1, 61)]), 32)


def test_quantize_refuses_nan_weights_and_leaves_no_output_behind(tmp_path, make_tiny_llama):
    model = make_tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match="weight model.layers.1.mlp.up_proj.weight holds NaN or inf"):
        run_quantize(quantize_args("--model", str(tmp_path / "src"), "--out", str(tmp_path / "q")))
    assert not (tmp_path / "q").exists()
    with pytest.raises(ValueError, match="--model must name a model directory"):
        run_quantize(quantize_args("--model", " ", "--out", str(tmp_path / "q")))
    with pytest.raises(ValueError, match="--gguf must be a .gguf file"):
        run_eval(eval_args("--methods", "gguf", "--gguf", str(tmp_path / "src")))


def test_tandem_commands_end_bad_input_with_one_error_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", "--bits", "8",
                             "--group-size", "128", "--out", str(tmp_path / "q")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: int8 is per output channel")
    result = subprocess.run([sys.executable, "-m", "tandem.services", "up", "--quantization", " ", "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "--quantization: must name a checkpoint" in result.stderr, result.stderr


@pytest.mark.parametrize("argv,error", [
    (["--bits", "4", "--analyze", "--out", "x"], "--analyze prints the ranking only"),
    (["--bits", "4", "--method", "awq", "--budget-bytes", "1"], "take --method rtn or gptq"),
    (["--bits", "8", "--method", "llmint8", "--analyze"], "take --method rtn or gptq"),
    (["--bits", "8", "--max-kl", "0.1", "--high-precision", "int8"], "is the --bits format itself"),
    (["--bits", "4", "--method", "llmint8", "--out", "x"], "llmint8 is INT8 per output channel"),
    (["--bits", "4"], "--out is required"),
    (["--bits", "8", "--json", "--out", "x"], "--json has no effect here"),
    (["--bits", "4", "--sensitivity", "s.json", "--out", "x"], "--sensitivity has no effect here"),
    (["--bits", "8", "--outlier-threshold", "3", "--out", "x"], "--outlier-threshold has no effect here"),
    (["--bits", "8", "--calib-windows", "2", "--out", "x"], "--calib-windows has no effect here"),
    (["--bits", "4", "--max-kl", "nan", "--out", "x"], "--max-kl nan is out of range"),
    (["--bits", "4", "--budget-bytes", "0", "--out", "x"], "--budget-bytes 0 is out of range"),
    (["--bits", "8", "--method", "llmint8", "--outlier-threshold", "nan", "--out", "x"], "--outlier-threshold nan"),
    (["--bits", "8", "--method", "llmint8", "--outlier-max-fraction", "2", "--out", "x"], "--outlier-max-fraction 2"),
    (["--bits", "4", "--analyze", "--calib-windows", "0"], "--calib-windows 0 is out of range"),
])
def test_quantize_refuses_contradictory_flags_before_loading(argv, error):
    parser = argparse.ArgumentParser()
    add_quantize_args(parser)
    with pytest.raises(ValueError, match=error):
        run_quantize(parser.parse_args(argv + ["--model", "/nonexistent"]))


@pytest.mark.heavy  # minutes of GPTQ/AWQ/sensitivity on the whole model: .ci/run's heavy pass
def test_analysis_json_feeds_a_kl_budgeted_checkpoint(tmp_path, model_dir, capsys):
    """--analyze --json on the real model (a short analysis: one window of 32 tokens), then --sensitivity reuses
    it for --max-kl: the checkpoint's layer map names the most sensitive linears first."""
    import json

    short = ["--calib-windows", "1", "--calib-seq-len", "32", "--model", str(model_dir)]
    parser = argparse.ArgumentParser()
    add_quantize_args(parser)
    assert run_quantize(parser.parse_args(["--bits", "4", "--analyze", "--json", *short])) == 0
    analysis = json.loads(capsys.readouterr().out)
    assert analysis["format"] == "int4-g128" and len(analysis["linears"]) == 210
    kls = [s["kl"] for s in analysis["linears"]]
    assert kls == sorted(kls, reverse=True) and kls[0] > 0
    assert {row["kind"] for row in analysis["by_kind"]} == {"self_attn.q_proj", "self_attn.k_proj",
                                                            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                                                            "mlp.up_proj", "mlp.down_proj"}
    (tmp_path / "analysis.json").write_text(json.dumps(analysis))
    argv = ["--bits", "4", "--max-kl", "0.5", "--sensitivity", str(tmp_path / "analysis.json"),
            "--out", str(tmp_path / "q"), *short]
    assert run_quantize(parser.parse_args(argv)) == 0
    config = detect_quant_config(tmp_path / "q")
    assert config.weight_format.startswith("int4-g128-rtn-mix") and set(dict(config.layer_formats).values()) == {"int8"}
    assert "calibration KL" in capsys.readouterr().err
    with pytest.raises(ValueError, match="analysed int4-g128, not int4-g64"):
        run_quantize(parser.parse_args(["--bits", "4", "--group-size", "64", "--max-kl", "0.5", "--sensitivity",
                                        str(tmp_path / "analysis.json"), "--out", str(tmp_path / "q2"), *short]))


def test_a_sensitivity_file_is_checked_against_the_model(tmp_path):
    import json

    from tandem.tools.quantize import _read_sensitivities

    linears = {"model.layers.0.mlp.up_proj": torch.nn.Linear(64, 96), "model.layers.0.mlp.down_proj":
               torch.nn.Linear(96, 64)}
    good = {"format": "int4-g32", "linears": [{"name": name, "kl": 0.1, "num_bytes": -10**12, "shape": [1]}
                                              for name in linears]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(good))
    sensitivities, recorded = _read_sensitivities(str(path), "int4-g32", linears)
    assert recorded == {"calib_windows": None, "calib_seq_len": None, "calib_seed": None}
    read = {s.name: s for s in sensitivities}
    assert read["model.layers.0.mlp.up_proj"].shape == (96, 64)  # shapes and bytes come from the model
    assert read["model.layers.0.mlp.up_proj"].num_bytes == 96 * 32 + 2 * 96 * 2 * 4
    for bad, error in [({"kl": "abc"}, "is not a `tandem quantize --analyze --json` output"),
                       ({"kl": float("nan")}, "negative, NaN or infinite"), ({"kl": -1.0}, "negative, NaN"),
                       ({"name": "model.layers.9.mlp.up_proj"}, "does not list this model's 2 linears")]:
        data = json.loads(json.dumps(good))
        data["linears"][0] |= bad
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=error):
            _read_sensitivities(str(path), "int4-g32", linears)
    path.write_text(json.dumps(good | {"linears": good["linears"] * 2}))
    with pytest.raises(ValueError, match="once each"):
        _read_sensitivities(str(path), "int4-g32", linears)
