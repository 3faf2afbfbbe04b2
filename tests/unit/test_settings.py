"""One source of truth for settings: the defaults the README and the public proto document equal the code's,
the flags every service parses come from EngineArgs, an engine without a registry refuses to start, and the
client CLI starts without torch."""
import argparse
import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tandem.services.flags import add_engine_service_args, add_gateway_args, apply_env, settings_table
from tandem.shared.engine_args import TIER_DEFAULTS, EngineArgs
from tandem.shared.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def test_readme_settings_table_is_the_one_the_parsers_make():
    readme = (REPO / "docs" / "configuration.md").read_text()  # the table README.md links to
    table = readme.split("<!-- settings table: python -m tandem.services.flags -->\n", 1)[1].split("\n<!-- end", 1)[0]
    assert table == settings_table()


def test_settings_table_lists_every_engine_setting_with_the_code_default():
    rows = {row.split(" | ")[0].strip("| `-").replace("-", "_"): row.split(" | ")
            for row in settings_table().splitlines()[2:]}  # fmt: skip
    assert {f.name for f in fields(EngineArgs)} <= set(rows)
    for f in fields(EngineArgs):
        for column, tier in ((2, "prefill"), (3, "decode")):
            default = TIER_DEFAULTS[tier].get(f.name, f.default)
            expected = "none" if default is None else ("on" if default else "off") if isinstance(default, bool) \
                else str(default)
            assert rows[f.name][column] == expected, (f.name, tier)
    assert rows["default_max_tokens"][4] == str(SamplingParams.max_tokens)


def make_parser(build, *args) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    build(parser, *args)
    apply_env(parser, [])
    return parser


def test_every_flag_reads_its_environment_variable_and_a_flag_given_wins(monkeypatch):
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "32")
    monkeypatch.setenv("TANDEM_DRAIN_TIMEOUT", "2.5")
    monkeypatch.setenv("TANDEM_STANDALONE", "true")
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "0")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("TANDEM_ROUTING", "round-robin")
    args = make_parser(add_engine_service_args, "decode").parse_args([])
    assert (args.block_size, args.drain_timeout, args.standalone, args.enable_prefix_caching, args.redis_url) == (
        32, 2.5, True, False, "redis://127.0.0.1:1/0")
    assert make_parser(add_engine_service_args, "decode").parse_args(["--block-size", "8"]).block_size == 8
    assert make_parser(add_gateway_args).parse_args([]).routing == "round-robin"


@pytest.mark.parametrize("variables, argv, expected", [
    ({}, ["--memory-utilization", "0.1"], (None, 0.1)),  # (the tier's default pool size gives way)
    ({"TANDEM_NUM_BLOCKS": "256"}, ["--memory-utilization", "0.1"], (None, 0.1)),  # the flag wins
    ({"TANDEM_MEMORY_UTILIZATION": "0.1"}, ["--num-blocks", "64"], (64, None)),
    ({"TANDEM_MEMORY_UTILIZATION": "0.1"}, [], (None, 0.1)),
    ({"TANDEM_MEMORY_UTILIZATION": "0.1", "TANDEM_NUM_BLOCKS": "5"}, [], (5, 0.1)),  # both: EngineArgs refuses
    ({}, [], (2048, None)),
])  # fmt: skip
def test_the_kv_pool_is_sized_by_what_was_chosen_last(variables, argv, expected, monkeypatch):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, "decode")
    apply_env(parser, argv)
    args = parser.parse_args(argv)
    assert (args.num_blocks, args.memory_utilization) == expected


@pytest.mark.parametrize("variable, value, message", [
    ("TANDEM_BLOCK_SIZE", "x", "$TANDEM_BLOCK_SIZE='x': invalid positive_int value"),
    ("TANDEM_NUM_BLOCKS", "0", "$TANDEM_NUM_BLOCKS='0': must be a positive integer"),
    ("TANDEM_PORT", "70000", "$TANDEM_PORT='70000': must be a port"),
    ("TANDEM_DRAIN_TIMEOUT", "-1", "$TANDEM_DRAIN_TIMEOUT='-1': expected a number of seconds > 0"),
    ("TANDEM_LOG_FORMAT", "xml", "$TANDEM_LOG_FORMAT='xml': choose from text, json"),
    ("TANDEM_STANDALONE", "maybe", "$TANDEM_STANDALONE='maybe': expected one of"),
    ("TANDEM_THREADS", "abc", "$TANDEM_THREADS='abc': invalid positive_int value"),
])  # fmt: skip
def test_a_bad_environment_value_refuses_to_start_naming_the_variable(variable, value, message, monkeypatch, capsys):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        make_parser(add_engine_service_args, "prefill")
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_public_proto_defaults_are_the_sampling_defaults():
    proto = (REPO / "proto/tandem/v1/common.proto").read_text()
    message = proto[proto.index("message SamplingParams {"):]
    message = message[: message.index("\n}")]
    # each field with the comment lines above it
    fields = re.findall(r"((?:\s*//[^\n]*\n)+)\s*(?:optional |repeated )?\w+ (\w+) = \d+;", message)
    documented = {}
    for comment, name in fields:
        assert "Default" in comment or "Absent" in comment or "absent" in comment, f"{name} documents no default"
        if m := re.search(r"Default (-?\d+(?:\.\d+)?|true|false|none)", comment):
            documented[name] = m.group(1)
    assert {"max_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_tokens"} <= set(documented)
    gateway_only = {"stop": "none", "include_stop_str_in_output": "false", "n": "1",
                    "length_penalty": "1.0"}  # (the engine never sees them)
    for name, value in documented.items():
        if name in gateway_only:
            assert value == gateway_only[name], name
            continue
        code = getattr(SamplingParams, name)
        if value in ("true", "false"):
            assert code is (value == "true"), name
        elif value == "none":
            assert code == (), name
        else:
            assert float(value) == float(code), name


@pytest.mark.parametrize("tier", ["prefill", "decode"])
def test_engine_flags_default_to_engine_args_and_the_tier(tier, monkeypatch):
    for variable in ("TANDEM_MODEL", "TANDEM_QUANTIZATION", "TANDEM_THREADS"):
        monkeypatch.delenv(variable, raising=False)  # (the parsers without apply_env still read these three)
    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, tier)
    args = EngineArgs.from_namespace(parser.parse_args([]))
    assert args == EngineArgs(**TIER_DEFAULTS[tier])
    gateway = argparse.ArgumentParser()
    add_gateway_args(gateway)
    assert gateway.parse_args([]).default_max_tokens == SamplingParams.max_tokens


def test_an_engine_without_a_registry_refuses_to_start(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no REDIS_URL
    result = subprocess.run([sys.executable, "-m", "tandem.services.decode", "--port", "0"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "no registry" in result.stderr and "--standalone" in result.stderr


def test_the_client_cli_imports_neither_torch_nor_redis_nor_the_engine():
    code = ("import sys, tandem.services.cli; "
            "print(sorted(m for m in ('torch', 'redis', 'transformers', 'tandem.shared.engine') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("flag, value", [("--http-port", "99999"), ("--default-max-tokens", "0"),
                                         ("--local-prefill-tokens", "-5")])
def test_the_gateway_refuses_bad_values_at_start(flag, value, capsys):
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, value])
    assert f"argument {flag}" in capsys.readouterr().err
    assert parser.parse_args(["--http-port", "-1"]).http_port == -1  # (-1: no HTTP API)


def test_tandem_up_passes_the_gateway_policy_flags_it_was_given_to_the_gateway():
    from tandem.services.cli import build_parser
    from tandem.services.flags import gateway_policy_argv

    argv = ["up", "--max-concurrent-requests", "3", "--routing", "round-robin", "--queue-timeout", "2.5"]
    args = build_parser(argv).parse_args(argv)
    assert gateway_policy_argv(args) == ["--routing", "round-robin", "--max-concurrent-requests", "3",
                                         "--queue-timeout", "2.5"]
    assert gateway_policy_argv(build_parser(["up"]).parse_args(["up"])) == []  # (defaults: the gateway's own)


def test_the_default_weights_are_the_packaged_gguf_and_a_checkpoints_own_dtype(model_dir, tmp_path):
    """No --model: the packaged Q4_1 GGUF with fp32 activations; --model (even the converted default dir) or
    --quantization none: that dir's own weights, in the type its config.json stores (bf16 stays bf16), and the
    KV cache in the model's type unless --kv-dtype says otherwise."""
    from tandem.shared.model_files import packaged_gguf_path

    default = EngineArgs()
    config = default.create_model_config(model_dir)
    assert (config.quantization, config.dtype) == (str(packaged_gguf_path()), "float32")
    assert "the default for the packaged model" in default.weights_line(config)
    for args in (EngineArgs(model=str(model_dir)), EngineArgs(quantization="none")):
        config = args.create_model_config(model_dir)
        assert (config.quantization, config.dtype, config.weight_format) == (None, "float32", "fp32")
    bf16_dir = tmp_path / "bf16"
    bf16_dir.mkdir()
    checkpoint = json.loads((Path(model_dir) / "config.json").read_text())
    (bf16_dir / "config.json").write_text(json.dumps({**checkpoint, "torch_dtype": "bfloat16"}))
    args = EngineArgs(model=str(bf16_dir))
    config, cache, _ = args.create_configs("decode", model_dir)
    assert (config.dtype, config.weight_format, cache.kv_dtype) == ("bfloat16", "bf16", "bfloat16")
    assert "the checkpoint's torch_dtype" in args.weights_line(config)
    config, cache, _ = EngineArgs(model=str(bf16_dir), dtype="float32", kv_dtype="bfloat16").create_configs(
        "decode", model_dir)
    assert (config.dtype, cache.kv_dtype) == ("float32", "bfloat16")


def test_the_engine_settings_line_says_lora_runs_when_lora_modules_turned_it_on():
    from tandem.services.flags import implied_engine_settings, settings_line

    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, "decode")
    line = settings_line("decode d", implied_engine_settings(parser.parse_args(["--lora-modules", "sql=/a/sql"])))
    assert '"enable_lora": true' in line
    assert '"enable_lora": false' in settings_line("decode d", implied_engine_settings(parser.parse_args([])))
