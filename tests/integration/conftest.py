"""Integration fixtures: HF transformers fp32 greedy references and real local clusters (real Redis)."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.prompts import PROMPTS, prompt_token_ids

NUM_REFERENCE_TOKENS = 48
# HF's greedy tokens are kept here between sessions (TANDEM_TEST_ORACLE_CACHE="" turns it off): HF generate takes
# about 55 ms a token here, 16 s for the shared references alone
ORACLE_CACHE = os.environ.get("TANDEM_TEST_ORACLE_CACHE", str(Path.home() / ".cache" / "tandem" / "hf-oracle"))


class HFOracle:
    """HF transformers' greedy tokens (generate, fp32) for the default model, computed once for every key of what
    they depend on (the checkpoint's content and generation config, transformers' and torch's versions, the prompt
    ids, the token count) and kept on disk under ORACLE_CACHE: a later session reads what HF computed in an
    earlier one, never a token list written by hand."""

    def __init__(self, model, model_dir):
        import transformers

        from tandem.shared.model_files import fingerprint

        self.model = model
        self.context = json.dumps([fingerprint(Path(model_dir)), model.generation_config.to_json_string(),
                                   transformers.__version__, torch.__version__])  # fmt: skip
        self.memory: dict[tuple, list[int]] = {}

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """At most n greedy tokens after ids, ending at EOS."""
        key = (tuple(ids), n)
        if key in self.memory:
            return self.memory[key]
        digest = hashlib.sha256(json.dumps([self.context, ids, n]).encode()).hexdigest()
        path = Path(ORACLE_CACHE) / f"{digest}.json" if ORACLE_CACHE else None
        if path is not None and path.exists():
            tokens = json.loads(path.read_text())
        else:
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
            tokens = out[0, len(ids) :].tolist()
            if path is not None:  # (written whole, then renamed: two workers may compute one key at once)
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    partial = path.with_suffix(f".{os.getpid()}.tmp")
                    partial.write_text(json.dumps(tokens))
                    os.replace(partial, path)
                except OSError:  # (a read-only home: the tokens serve this session only)
                    pass
        self.memory[key] = tokens
        return tokens


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The default model in HF transformers, fp32, loaded once for every test that compares against it (the
    oracle; tests only generate with it, never change it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_oracle(hf_model, model_dir):
    return HFOracle(hf_model, model_dir)


@pytest.fixture(scope="session")
def hf_references(hf_oracle, tokenizer):
    """{prompt name: (prompt token ids, 48 greedy tokens from HF generate in fp32, cut at EOS)}."""
    refs = {}
    for name, kind, text in PROMPTS:
        ids = prompt_token_ids(tokenizer, kind, text)
        refs[name] = (ids, hf_oracle.greedy(ids, NUM_REFERENCE_TOKENS))
    return refs


def start_cluster(model_dir, block_size: int, chunk: int, num_blocks: int = 512, lora: bool = False):
    """lora: the engines serve LoRA adapters (--enable-lora; none loaded at start: tests load theirs at run time)."""
    from tandem.services.launcher import LocalCluster

    engine = ["--block-size", str(block_size), "--num-blocks", str(num_blocks), "--threads", "1"] + (
        ["--enable-lora"] if lora else [])  # fmt: skip
    return LocalCluster(
        str(model_dir),
        prefill_args=engine + ["--max-num-batched-tokens", str(chunk)],
        decode_args=engine + ["--max-num-batched-tokens", "256"],
    ).start()


@pytest.fixture(scope="session")
def cluster(model_dir, hf_references):
    """Default test cluster: block_size 16, prefill chunk 64 (smaller than the long prompt), LoRA on (no adapter
    loaded: the base model's tokens are the same; test_lora_serving.py loads and unloads its own)."""
    c = start_cluster(model_dir, block_size=16, chunk=64, lora=True)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def hf_greedy(hf_oracle):
    """generate(prompt ids, n) -> HF transformers fp32 greedy tokens (at most n, ending at EOS), cached."""
    return hf_oracle.greedy


@pytest.fixture(scope="session")
def int8_dir(model_dir, tmp_path_factory):
    """An INT8 (RTN, per channel) checkpoint of the default model, written once by `tandem quantize` (the int8
    serving tests and the draft model of speculative decoding share it)."""
    out = tmp_path_factory.mktemp("int8") / "SmolLM2-int8"
    subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", "--bits", "8", "--out",
                    str(out), "--model", str(model_dir)], check=True, timeout=600)  # fmt: skip
    return out


@pytest.fixture
def redis_server():
    """A fresh redis-server of this test's own (tests.integration.helpers.RedisServer), stopped after it."""
    from tests.integration.helpers import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()
