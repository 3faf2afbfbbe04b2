"""Integration fixtures: HF transformers fp32 greedy references and real local clusters (real Redis)."""
import subprocess
import sys

import pytest
import torch

from tests.prompts import PROMPTS, prompt_token_ids

NUM_REFERENCE_TOKENS = 48


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The default model in HF transformers, fp32, loaded once for every test that compares against it (the
    oracle; tests only generate with it, never change it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_references(hf_model, tokenizer):
    """{prompt name: (prompt token ids, 48 greedy tokens from HF generate in fp32, cut at EOS)}."""
    model = hf_model
    refs = {}
    for name, kind, text in PROMPTS:
        ids = prompt_token_ids(tokenizer, kind, text)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_REFERENCE_TOKENS, do_sample=False)
        refs[name] = (ids, out[0, len(ids) :].tolist())
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
def hf_greedy(hf_model):
    """generate(prompt ids, n) -> HF transformers fp32 greedy tokens (at most n, ending at EOS), cached."""
    model = hf_model
    cache = {}

    def generate(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)  # ends at EOS
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return generate


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
