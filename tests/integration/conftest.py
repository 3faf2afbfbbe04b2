"""Integration fixtures: HF transformers fp32 greedy references and real local clusters (real Redis)."""
import pytest
import torch

from tests.prompts import PROMPTS, prompt_token_ids

NUM_REFERENCE_TOKENS = 48


@pytest.fixture(scope="session")
def hf_references(model_dir, tokenizer):
    """{prompt name: (prompt token ids, 48 greedy tokens from HF generate in fp32, cut at EOS)}."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = {}
    for name, kind, text in PROMPTS:
        ids = prompt_token_ids(tokenizer, kind, text)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_REFERENCE_TOKENS, do_sample=False)
        refs[name] = (ids, out[0, len(ids) :].tolist())
    del model
    return refs


def start_cluster(model_dir, block_size: int, chunk: int, num_blocks: int = 512):
    from tandem.services.launcher import LocalCluster

    engine = ["--block-size", str(block_size), "--num-blocks", str(num_blocks), "--threads", "1"]
    return LocalCluster(
        str(model_dir),
        prefill_args=engine + ["--max-num-batched-tokens", str(chunk)],
        decode_args=engine + ["--max-num-batched-tokens", "256"],
    ).start()


@pytest.fixture(scope="session")
def cluster(model_dir, hf_references):
    """Default test cluster: block_size 16, prefill chunk 64 (smaller than the long prompt)."""
    c = start_cluster(model_dir, block_size=16, chunk=64)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def hf_greedy(model_dir):
    """generate(prompt ids, n) -> HF transformers fp32 greedy tokens (at most n, ending at EOS), cached."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = {}

    def generate(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)  # ends at EOS
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture
def redis_server():
    """A fresh redis-server of this test's own (tests.integration.helpers.RedisServer), stopped after it."""
    from tests.integration.helpers import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()
