"""One source of truth for settings: the defaults the README and the public proto document equal the code's,
the flags every service parses come from EngineArgs, an engine without a registry refuses to start, and the
client CLI starts without torch."""
import argparse
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from services.flags import add_engine_service_args, add_gateway_args
from shared.config import TIER_DEFAULTS, EngineArgs
from shared.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def readme_flag_defaults() -> dict[str, str]:
    """{field name: the default cell} of the README's engine flag table."""
    section = (REPO / "README.md").read_text().split("## Service flags", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `--([a-z-]+)` \| ([^|]+) \|", section, flags=re.M)
    return {flag.replace("-", "_"): cell.strip() for flag, cell in rows}


def test_readme_flag_table_lists_every_engine_setting_with_the_code_default():
    documented = readme_flag_defaults()
    assert set(documented) == {f.name for f in fields(EngineArgs)}
    for f in fields(EngineArgs):
        cell = documented[f.name]
        if f.name in TIER_DEFAULTS["decode"]:
            assert cell == ", ".join(f"{tier} {d[f.name]}" for tier, d in TIER_DEFAULTS.items()), f.name
        elif f.default is None:
            assert not re.match(r"\d", cell), f"{f.name}: the README gives a value, the code has none"
        else:
            assert cell.split()[0] == str(f.default), f.name


def test_readme_gateway_default_max_tokens_is_the_code_default():
    readme = (REPO / "README.md").read_text()
    assert f"`--default-max-tokens` ({SamplingParams.max_tokens})" in readme


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
        monkeypatch.delenv(variable, raising=False)
    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, tier)
    args = EngineArgs.from_namespace(parser.parse_args([]))
    assert args == EngineArgs(**TIER_DEFAULTS[tier])
    gateway = argparse.ArgumentParser()
    add_gateway_args(gateway)
    assert gateway.parse_args([]).default_max_tokens == SamplingParams.max_tokens


def test_an_engine_without_a_registry_refuses_to_start(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no REDIS_URL
    result = subprocess.run([sys.executable, "-m", "services.decode", "--port", "0"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "no registry" in result.stderr and "--standalone" in result.stderr


def test_the_client_cli_imports_neither_torch_nor_redis_nor_the_engine():
    code = ("import sys, services.cli; "
            "print(sorted(m for m in ('torch', 'redis', 'transformers', 'shared.engine') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
