"""GatewayPipeline's migration (services/gateway/pipeline.py), the one class under test: its Placer is replaced by a
stand-in whose "decodes" stream a fixed continuation from wherever the request's output ends and fail
(DecodeLostError) after a given number of messages. Checked against the same request without a failure: the
client's stream (text, token ids, finish reason, usage) is the same across one or more seams, also when a stop
string spans a seam and for each of n completions; what each placement is sent; the migration limit; the
counter. The engines' side (restoring the state that counts output tokens) is tests/integration/test_migration.py;
real kills through a cluster are tests/integration/test_faults.py."""
import asyncio

import pytest

from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.placement import DecodeLostError, Placement
from tandem.services.gateway.request import GatewayRequest
from tandem.services.gateway.router import Route
from tandem.shared.cluster_state.registry import InstanceInfo
from tandem.shared.errors import UpstreamError
from tandem.v1 import common_pb2, decode_pb2

TEXT = " one two three four five six seven eight nine ten eleven twelve thirteen fourteen"


class FakeDecodeCall:
    def __init__(self, replies: list[decode_pb2.DecodeResponse], fail_after: int | None, name: str):
        self.replies, self.fail_after, self.name, self.num_read = replies, fail_after, name, 0

    async def read(self) -> decode_pb2.DecodeResponse:
        if self.fail_after is not None and self.num_read >= self.fail_after:
            raise DecodeLostError(f"decode {self.name} failed while decoding (UNAVAILABLE)", "decode_failed")
        self.num_read += 1
        return self.replies[self.num_read - 1]

    def cancel(self) -> None:
        pass


class FakePlacer:
    """Each placement streams tokens[len(output so far):max_tokens], one per message, and fails after
    fail_after[its placement id] messages (never when absent)."""

    def __init__(self, tokens: list[int], fail_after: dict[str, int]):
        self.tokens, self.fail_after, self.placed = tokens, fail_after, []

    async def place(self, request: GatewayRequest, pinned=None) -> Placement:
        k = len(self.placed)
        self.placed.append(request)
        rest = self.tokens[len(request.output_token_ids) : request.sampling_params.max_tokens]
        replies = [decode_pb2.DecodeResponse(token_ids=[t]) for t in rest]
        replies[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
        call = FakeDecodeCall(replies, self.fail_after.get(request.request_id), f"decode-{k}")
        decode = InstanceInfo(f"decode-{k}", "decode", "127.0.0.1:1", "model", 16)
        return Placement(call, await call.read(), Route(decode, None, reason="decode_local"), None)

    async def read_decode(self, decode_call, decode, prefill=None) -> decode_pb2.DecodeResponse:
        return await decode_call.read()

    async def end_of(self, decode_call) -> None:
        pass


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return tokenizer.encode(TEXT, add_special_tokens=False)


def serve(model_config, tokenizer, tokens, fail_after, max_migrations=3, **params):
    """(the client's messages, the placements' requests, migrations counted) of one request."""
    pipeline = GatewayPipeline(model_config, tokenizer, None, 16, "gateway-test", max_migrations=max_migrations)
    pipeline.placer = FakePlacer(tokens, fail_after)
    request = GatewayRequest("r", [1, 2, 3], common_pb2.SamplingParams(max_tokens=len(tokens), **params))

    async def collect():
        return [msg async for msg in pipeline.run(request)]

    messages = asyncio.run(collect())
    counted = sum(s.value for m in pipeline.metrics.registry.collect() if m.name == "tandem:request_migrations"
                  for s in m.samples if s.name.endswith("_total"))  # fmt: skip
    return messages, pipeline.placer.placed, counted


def summary(messages, index=0):
    mine = [m for m in messages if m.index == index]
    return ("".join(m.text for m in mine), [t for m in mine for t in m.token_ids],
            mine[-1].finish_reason, mine[-1].usage.completion_tokens)  # fmt: skip


@pytest.mark.parametrize("fail_after", [[1], [3], [2, 1, 4]], ids=["after-first", "mid", "three-times"])
def test_a_migrated_stream_is_the_uninterrupted_one(model_config, tokenizer, tokens, fail_after):
    """fail_after[k]: messages placement k sends before its decode fails."""
    whole, _, _ = serve(model_config, tokenizer, tokens, {})
    ids = ["r"] + [f"r.m{k}" for k in range(1, len(fail_after))]
    messages, placed, counted = serve(model_config, tokenizer, tokens, dict(zip(ids, fail_after)), prompt_logprobs=1)
    assert summary(messages) == summary(whole)
    assert counted == len(placed) - 1 == len(fail_after)
    sent = 0
    for k, request in enumerate(placed):  # each placement carries every token received before it, as output
        assert list(request.output_token_ids) == tokens[:sent]
        assert request.request_id == ("r" if k == 0 else f"r.m{k}")
        assert request.sampling_params.HasField("prompt_logprobs") == (k == 0)
        sent += fail_after[k] if k < len(fail_after) else 0


def test_a_stop_string_across_the_seam_is_found(model_config, tokenizer, tokens):
    """The decode fails when the stream has sent " five" and holds back its text (it may begin "five six")."""
    stop = dict(stop=["five six"])
    whole, _, _ = serve(model_config, tokenizer, tokens, {}, **stop)
    at = next(i for i in range(len(tokens)) if tokenizer.decode(tokens[: i + 1]).endswith("five"))
    messages, placed, _ = serve(model_config, tokenizer, tokens, {"r": at + 1}, **stop)
    assert summary(messages) == summary(whole)
    assert summary(messages)[0] == " one two three four " and summary(messages)[2] == common_pb2.FINISH_REASON_STOP
    assert len(placed) == 2


def test_each_of_n_completions_migrates_on_its_own(model_config, tokenizer, tokens):
    whole, _, _ = serve(model_config, tokenizer, tokens, {}, n=2)
    messages, placed, counted = serve(model_config, tokenizer, tokens, {"r": 2, "r-1": 4}, n=2)
    for index in (0, 1):
        assert summary(messages, index) == summary(whole, index) == summary(whole, 0)
    assert counted == 2 and sorted(r.request_id for r in placed) == ["r", "r-1", "r-1.m1", "r.m1"]


def test_past_max_migrations_the_stream_fails_unavailable(model_config, tokenizer, tokens):
    with pytest.raises(UpstreamError, match=r"migrated 2 times already \(--max-migrations 2\)") as e:
        serve(model_config, tokenizer, tokens, {"r": 1, "r.m1": 1, "r.m2": 1}, max_migrations=2)
    assert e.value.status == "UNAVAILABLE"
    with pytest.raises(DecodeLostError, match="decode decode-0 failed while decoding"):  # 0: migration off
        serve(model_config, tokenizer, tokens, {"r": 1}, max_migrations=0)
