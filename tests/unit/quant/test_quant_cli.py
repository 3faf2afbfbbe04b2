"""QuantConfig naming/validation and the CLI functions the tandem CLI wires (quantize, eval-quant)."""
import argparse

import pytest
import torch

from shared.quant import QuantConfig, apply_quantization, apply_quantized_state, detect_quant_config, quantize_model
from shared.quant.cli import _parse_method, add_eval_args, add_quantize_args, run_eval, run_quantize


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
