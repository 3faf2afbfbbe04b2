"""Greedy tokens through gateway -> prefill -> KV transfer -> decode equal HF transformers fp32, token for token."""

from tests.integration.conftest import NUM_REFERENCE_TOKENS
from tests.integration.helpers import generate_all, greedy_request
from tests.prompts import PROMPTS


def check_against_hf(address, hf_references, block_size, chunk):
    outs = generate_all(address, [greedy_request(kind, text, NUM_REFERENCE_TOKENS) for _, kind, text in PROMPTS])
    lengths = {name: len(hf_references[name][0]) for name, _, _ in PROMPTS}
    assert any(n % block_size for n in lengths.values()), "want a prompt length the block size does not divide"
    assert max(lengths.values()) > 300 and max(lengths.values()) > chunk, "want a prompt longer than the chunk"
    for (name, _, _), out in zip(PROMPTS, outs):
        assert out.token_ids == hf_references[name][1], f"{name}: diverged from HF transformers"
        assert out.prompt_tokens == lengths[name]
        assert out.finish_reason in ("stop", "length")


def test_cluster_matches_hf_block16_chunk64(cluster, hf_references):
    check_against_hf(cluster.gateway_address, hf_references, block_size=16, chunk=64)


def test_cluster_matches_hf_block12_chunk40_two_prefills(model_dir, hf_references):
    from tandem.services.launcher import LocalCluster

    engine = ["--block-size", "12", "--num-blocks", "512", "--threads", "1"]
    with LocalCluster(str(model_dir), num_prefill=2, prefill_args=engine + ["--max-num-batched-tokens", "40"],
                      decode_args=engine) as c:  # fmt: skip
        check_against_hf(c.gateway_address, hf_references, block_size=12, chunk=40)
