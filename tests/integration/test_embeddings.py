"""Embeddings (last-token pooling of the final hidden state, L2-normalized) against HF transformers fp32: the
engine's pooling request in one process, then /v1/embeddings through the running cluster with the official openai
client; its refusals; /tokenize and /detokenize against the tokenizer."""

import pytest
import torch

from tandem.shared.config import CacheConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import FinishReason, PoolingParams, Request, SamplingParams

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors; " * 12 + "the end."]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_embed(hf_model):
    """ids -> HF's final hidden state (after the final norm) at the last token, L2-normalized, fp32."""
    def embed(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden.float(), dim=-1)

    return embed


def pooling_request(request_id: str, ids: list[int]) -> Request:
    return Request(request_id, ids, SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def test_engine_pooling_request_in_chunks_beside_a_prompt(model_config, tokenizer, hf_embed):
    """Pooling requests (one longer than the step budget: chunked) batched with a sampled prompt: the pooled
    states equal HF's, no token is sampled for them, no KV is exported, every block is freed; a second run of the
    same input hits the prefix cache and still computes its last token."""
    engine = LLMEngine(model_config, CacheConfig(16, 64), SchedulerConfig(32, 8), export_kv=True)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert len(ids[1]) > 32
    engine.add_request(pooling_request("e0", ids[0]))
    engine.add_request(pooling_request("e1", ids[1]))
    engine.add_request(Request("g", ids[0], SamplingParams(max_tokens=1, temperature=0.0)))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != "g":
                assert not o.new_token_ids and o.kv is None
            if o.finished:
                outs[o.request_id] = o
    for i in range(2):
        out = outs[f"e{i}"]
        assert out.finish_reason == FinishReason.STOP and out.pooled.shape == (model_config.hidden_size,)
        assert torch.allclose(out.pooled, hf_embed(ids[i]), atol=TOLERANCE)
    assert len(outs["g"].new_token_ids) == 1 and outs["g"].pooled is None
    assert engine.num_free_blocks == 64 and not engine.requests
    again = pooling_request("e1-again", ids[1])
    engine.add_request(again)
    while engine.has_unfinished_requests():
        for o in engine.step():
            pooled = o.pooled
    assert again.num_cached_tokens == len(ids[1]) - 1  # (full blocks, then a copy of the partial one)
    assert torch.allclose(pooled, hf_embed(ids[1]), atol=TOLERANCE)
    assert engine.num_free_blocks == 64


def test_engine_pooling_request_takes_the_whole_context(model_config):
    """A pooling prompt may fill the model's context (no token follows it); one more token is refused."""
    engine = LLMEngine(model_config, CacheConfig(16, 8), SchedulerConfig(64, 8))
    max_len = model_config.max_model_len
    from tandem.shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(pooling_request("long", [1] * (max_len + 1)))
    assert not engine.requests
