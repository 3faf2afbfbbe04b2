"""A quantized KV cache (--kv-dtype fp8_e4m3 | fp8_e5m2 | int8) on the real default model (fp32 weights), in one
process: next-token distributions within a stated KL of fp32 KV's, greedy tokens mostly the same, and a prefill ->
decode transfer of quantized KV over the wire format that is byte exact (the decode then continues exactly as one
engine of that KV dtype does)."""
import pytest
import torch

from tandem.services.kv_wire import kv_from_message, kv_to_messages
from tandem.shared.config import CacheConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.model import load_model
from tandem.shared.model_runner import ModelRunner, run_model
from tandem.shared.request import Request, SamplingParams

# KL(fp32 KV || quantized KV) per position, nats, over TEXT (106 tokens): measured 0.0058 (e4m3), 0.024 (e5m2),
# 0.0007 (int8); over the 2,048 positions of the eval text 0.0088, 0.032, 0.0009 (benchmarks/quant.py --kv-dtypes,
# docs/quantization.md#quantized-kv-cache)
KL_BOUND = {"fp8_e4m3": 0.01, "fp8_e5m2": 0.03, "int8": 0.005}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based inks and a wooden press adapted from those used to make wine. Within fifty "
        "years presses ran in more than two hundred cities across Europe, and the price of books fell so far that "
        "ordinary merchants could own a small library. Scholars argue about how much the press changed the way "
        "people thought, but few doubt that it changed how quickly ideas travelled: pamphlets, newspapers and "
        "scientific journals all followed, and literacy spread with them.")


@pytest.fixture(scope="module")
def model(model_config):
    return load_model(model_config, torch.device("cpu"))


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    return tokenizer(TEXT)["input_ids"]


def logprobs(model_config, model, kv_dtype: str, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model_config, CacheConfig(16, -(-len(ids) // 16), kv_dtype), model=model)
    logits = run_model(model, runner.kv_caches, [(ids, 0, list(range(runner.cache_config.num_blocks)), len(ids))],
                       16, runner.device, kv_quant=runner.cache_config.kv_quant)
    return logits.log_softmax(-1)


def greedy(model_config, model, kv_dtype: str, ids: list[int], n: int, export_kv: bool = False):
    engine = LLMEngine(model_config, CacheConfig(16, 32, kv_dtype), SchedulerConfig(256, 4), model=model,
                       export_kv=export_kv)
    engine.add_request(Request("r", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    tokens, kv = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            kv += [o.kv] if o.kv is not None else []
    return tokens, kv, engine


def test_quantized_kv_stays_within_a_kl_bound_of_fp32_kv(model_config, model, text_ids):
    reference = logprobs(model_config, model, "float32", text_ids)
    expected, _, _ = greedy(model_config, model, "float32", text_ids[:40], 12)
    for kv_dtype, bound in KL_BOUND.items():
        lp = logprobs(model_config, model, kv_dtype, text_ids)
        kl = float((reference.exp() * (reference - lp)).sum(-1).mean())
        top1 = float((reference.argmax(-1) == lp.argmax(-1)).float().mean())
        assert kl <= bound and top1 >= 0.9, (kv_dtype, kl, top1)
        if kv_dtype == "fp8_e5m2":
            # (e5m2's 2-bit mantissa puts this prompt's second token in a near-tie: logprobs -1.590 and -1.592 on
            # 2026-12-06, so its greedy continuation flips with the linears' summation order; the teacher-forced
            # top-1 agreement above is its check)
            continue
        tokens, _, _ = greedy(model_config, model, kv_dtype, text_ids[:40], 12)
        assert sum(a == b for a, b in zip(tokens, expected)) >= 8, (kv_dtype, tokens, expected)


def test_a_quantized_kv_transfer_is_byte_exact_and_decodes_as_one_engine(model_config, model, text_ids):
    """Prefill (fp8_e4m3, exporting) -> KVBlocksMessages -> a decode of that KV dtype: the decode's pool holds the
    prefill's bytes (codes and scales) for every block, and its greedy tokens equal one fp8_e4m3 engine's."""
    ids = text_ids[:70]  # 4 full blocks and a partial one
    expected, _, _ = greedy(model_config, model, "fp8_e4m3", ids, 8)
    (first, *_), kv, prefill = greedy(model_config, model, "fp8_e4m3", ids, 1, export_kv=True)
    decode = LLMEngine(model_config, CacheConfig(16, 32, "fp8_e4m3"), SchedulerConfig(256, 4), model=model)
    decode.reserve(Request("r", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    messages = [m for blocks in kv for m in kv_to_messages("r", blocks, model_config, max_bytes=200_000,
                                                           kv_dtype="fp8_e4m3")]
    assert len(messages) > len(kv) and {m.dtype for m in messages} == {"fp8_e4m3"}
    for m in messages:
        decode.import_kv("r", kv_from_message(m, model_config, decode.cache_config))
    sent = torch.cat([blocks.data for blocks in kv], dim=2)  # [layers, 2, 5 blocks, 16, heads, 68] uint8
    table = decode.kv_cache_manager.get_block_table("r")
    assert sent.dtype == torch.uint8 and torch.equal(decode.model_runner.kv_caches[:, :, table], sent)
    decode.finish_kv_import("r", first)
    tokens = []
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens += o.new_token_ids
    assert [first] + tokens == expected
    with pytest.raises(ValueError, match="dtype is 'fp8_e4m3', this decode instance has 'float32'"):
        kv_from_message(messages[0], model_config, CacheConfig(16, 32, "float32"))
