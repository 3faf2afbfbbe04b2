"""The Python client's and the `tandem` CLI's requests (services/client.py, services/cli.py), built offline: each
option reaches its GenerateRequest field."""
import pytest

from tandem.services.cli import _request, build_parser
from tandem.services.client import build_request, make_request


def test_a_request_names_its_lora_adapter_from_the_client_and_the_cli():
    assert build_request("Hi", lora_name="sql", max_tokens=2).lora_name == "sql"
    assert not build_request("Hi").HasField("lora_name")  # (absent: the base model)
    assert make_request("Hi", lora_name="sql").lora_name == "sql"
    for command in ("generate", "chat"):
        argv = [command, "--lora-name", "sql"] + (["Hi"] if command == "generate" else [])
        assert _request(build_parser(argv).parse_args(argv), "Hi").lora_name == "sql"
    argv = ["generate", "Hi"]
    assert not _request(build_parser(argv).parse_args(argv), "Hi").HasField("lora_name")
    with pytest.raises(TypeError, match="lora_names"):
        build_request("Hi", lora_names="sql")
