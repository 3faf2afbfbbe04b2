"""Malformed internal messages sent straight to a running decode's TransferKV and Generate and a prefill's
Prefill (hypothesis), and the KV transfer's integrity checks (checksum, totals, every layer of every block).

Each answer is a success or a client error (INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION) whose message
names what is wrong; a refused transfer fails its request on the decode (its Generate stream says why); after
every example every KV block is free, the services still serve a plain request, and no service logged a
traceback."""
import uuid

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.services.client import generate, make_request
from tandem.services.kv_wire import checksum
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.passes import fuzz_settings
from tests.integration.helpers import kv_transfer, load

CLIENT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
FUZZ = fuzz_settings(20)
PROMPT_LEN = 40  # 3 blocks of 16: the last one partial
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "logprobs", "seed", "prompt_logprobs")  # fmt: skip
numbers = st.one_of(st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.integers(-(2**63), 2**64))  # fmt: skip
uint32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))


@pytest.fixture(scope="module")
def decode(cluster):
    with grpc.insecure_channel(cluster.addresses["decode0"], options=[("grpc.max_send_message_length", -1)]) as ch:
        yield decode_pb2_grpc.DecodeStub(ch)


@pytest.fixture(scope="module")
def prefill(cluster):
    with grpc.insecure_channel(cluster.addresses["prefill0"]) as channel:
        yield prefill_pb2_grpc.PrefillStub(channel)


@pytest.fixture(scope="module")
def tracebacks_before(cluster):
    return count_tracebacks(cluster)


def count_tracebacks(cluster) -> int:
    return sum(p.read_text(errors="replace").count("Traceback") for p in cluster.log_dir.glob("*.log"))


def reserve(decode, request_id: str, n: int = PROMPT_LEN):
    """Decode.Generate for a prompt of n tokens under a salt of its own (its zero KV never reaches a real
    request's prefix cache); returns the call, past its reserved message."""
    params = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    call = decode.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=list(range(1, n + 1)),
                                                    sampling_params=params, cache_salt="fuzz-" + request_id),
                           timeout=120)  # fmt: skip
    assert next(call).reserved
    return call


def expect_client_error(err: grpc.RpcError, *words: str) -> None:
    assert err.code() in CLIENT_CODES, (err.code(), err.details())
    assert not words or any(w in err.details() for w in words), err.details()


def expect_healthy(cluster, tracebacks_before: int, gateway: bool = False) -> None:
    """Every engine's blocks free (polled: aborts land on the engine thread), no new traceback in any log; with
    gateway, a plain request is still served end to end."""
    import time

    deadline = time.monotonic() + 15
    while True:
        loads = {name: load(addr) for name, addr in cluster.addresses.items()}
        if all(l.num_free_blocks == l.num_blocks and l.num_waiting == 0 for l in loads.values()):
            break
        assert time.monotonic() < deadline, {n: (l.num_free_blocks, l.num_blocks, l.num_waiting) for n, l in loads.items()}
        time.sleep(0.1)
    assert count_tracebacks(cluster) == tracebacks_before, f"a service logged a traceback: see {cluster.log_dir}"
    if gateway:
        out = generate(cluster.gateway_address, make_request("Hi", raw=True, max_tokens=1, temperature=0.0), timeout=120)
        assert out.completion_tokens == 1


def finish_generate(call) -> list[decode_pb2.DecodeResponse]:
    """The rest of a decode's Generate stream (cancelled on the first error, as the gateway does)."""
    replies = []
    for reply in call:
        replies.append(reply)
        if reply.HasField("finish_reason"):
            break
    call.cancel()
    return replies


# -- directed: integrity -------------------------------------------------------------------------------------
def test_a_complete_transfer_decodes_and_is_acknowledged(cluster, decode, model_config, tracebacks_before):
    rid = uuid.uuid4().hex
    call = reserve(decode, rid)
    stream = kv_transfer(cluster.addresses["decode0"], model_config, rid, num_blocks=3)
    assert decode.TransferKV(iter(stream), timeout=60).num_blocks_received == 3
    replies = finish_generate(call)
    assert replies[-1].HasField("finish_reason") and not any(r.error for r in replies)
    expect_healthy(cluster, tracebacks_before)


def corrupt(stream):
    data = bytearray(stream[0].data)
    data[12345] ^= 0x10
    stream[0].data = bytes(data)


def drop_a_layer_message(stream):
    del stream[1]  # (totals left as sent: num_messages_sent no longer matches)


def drop_a_layer_message_and_lie(stream):
    del stream[1]
    stream[-1].num_messages_sent -= 1  # (totals agree; the missing layers do not come: coverage catches it)


def truncate_the_stream(stream):
    del stream[-1]  # (no last message: the stream ends without first_token_id)


def missing_totals(stream):
    stream[-1].ClearField("num_blocks_sent")


@pytest.mark.parametrize("damage,words", [
    (corrupt, "checksum mismatch"), (drop_a_layer_message, "num_messages_sent"),
    (drop_a_layer_message_and_lie, "lack layers"), (truncate_the_stream, "without the last message"),
    (missing_totals, "lacks num_blocks_sent"),
])  # fmt: skip
def test_a_damaged_transfer_fails_the_request_cleanly(cluster, decode, model_config, tracebacks_before, damage, words):
    """The transfer answers INVALID_ARGUMENT naming the problem, the request's Generate stream gets an error
    naming it too, which the gateway relays to the client as UNAVAILABLE (the server's fault, worth a retry)
    with this text after the decode's id, and its blocks are free."""
    rid = uuid.uuid4().hex
    call = reserve(decode, rid)
    # (small messages: split by layers, several per block)
    stream = kv_transfer(cluster.addresses["decode0"], model_config, rid, num_blocks=3, max_bytes=200_000)
    damage(stream)
    with pytest.raises(grpc.RpcError) as err:
        decode.TransferKV(iter(stream), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details(), err.value.details()
    replies = finish_generate(call)
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_ABORT and words in replies[-1].error, replies[-1]
    assert not replies[-1].error_is_invalid_request  # (the client's request was fine: a server-side failure)
    status, message = client_error_for(replies[-1])
    assert status == "UNAVAILABLE" and message.startswith("decode decode-1: KV transfer") and words in message
    expect_healthy(cluster, tracebacks_before)


def client_error_for(reply: decode_pb2.DecodeResponse):
    """The UpstreamError the gateway makes of a decode's failed reply (Placer.read_decode): what the client
    of the public API gets, as (status name, message), once --max-migrations is spent (before that, an
    UNAVAILABLE one is a DecodeLostError: the request migrates, for the reason "kv_transfer_failed")."""
    import asyncio

    from tandem.services.gateway.placement import DecodeLostError, Placer
    from tandem.shared.errors import UpstreamError
    from tandem.shared.cluster_state.registry import InstanceInfo

    class Call:
        async def read(self):
            return reply

    try:
        asyncio.run(Placer.read_decode(None, Call(), InstanceInfo("decode-1", "decode", "127.0.0.1:1", "m", 16)))
    except UpstreamError as e:
        assert isinstance(e, DecodeLostError) == (e.status == "UNAVAILABLE")
        assert not isinstance(e, DecodeLostError) or e.reason == "kv_transfer_failed"
        return e.status, str(e)
    raise AssertionError("the gateway took a failed reply for a good one")


def test_block_indices_past_the_reservation_and_unknown_ids_are_refused(cluster, decode, model_config,
                                                                        tracebacks_before):  # fmt: skip
    rid = uuid.uuid4().hex
    call = reserve(decode, rid)
    stream = kv_transfer(cluster.addresses["decode0"], model_config, rid, num_blocks=2, first_block_index=2)
    with pytest.raises(grpc.RpcError) as err:
        decode.TransferKV(iter(stream), timeout=60)
    expect_client_error(err.value, "exceed the request's 3 reserved blocks")
    assert "exceed" in finish_generate(call)[-1].error
    for request_id, words in (("nobody-" + rid, "unknown request"), ("", "request_id is required")):
        stream = kv_transfer(cluster.addresses["decode0"], model_config, request_id, num_blocks=1)
        with pytest.raises(grpc.RpcError) as err:
            decode.TransferKV(iter(stream), timeout=60)
        expect_client_error(err.value, words)
    expect_healthy(cluster, tracebacks_before)


def test_a_concurrent_second_transfer_is_refused_and_leaves_the_first_alone(cluster, decode, model_config,
                                                                           tracebacks_before):  # fmt: skip
    import threading

    rid = uuid.uuid4().hex
    call = reserve(decode, rid)
    stream = kv_transfer(cluster.addresses["decode0"], model_config, rid, num_blocks=3)
    gate = threading.Event()

    def held_open():  # the first transfer: its data, then it waits before its last message
        yield from stream[:-1]
        gate.wait(30)
        yield stream[-1]

    first = decode.TransferKV.future(held_open(), timeout=60)
    import time

    time.sleep(1.0)
    with pytest.raises(grpc.RpcError) as err:
        decode.TransferKV(iter(stream), timeout=60)
    expect_client_error(err.value, "already has one under way")
    gate.set()
    assert first.result().num_blocks_received == 3
    replies = finish_generate(call)
    assert replies[-1].HasField("finish_reason") and not any(r.error for r in replies)
    expect_healthy(cluster, tracebacks_before)


# -- fuzz: TransferKV ----------------------------------------------------------------------------------------
FIELD_VALUES = {
    "request_id": st.sampled_from(["", "nobody", "x" * 5000, "\u00e9\u6f22\u0000"]),
    "model_id": st.sampled_from(["", "other:model:fp32", "\u00e9" * 3]),
    "dtype": st.sampled_from(["float16", "bfloat16", "int8", "", "float64", "float32\x00", "\U0001f642"]),
    "block_size": uint32, "num_kv_heads": uint32, "head_dim": uint32, "layer_start": uint32, "layer_end": uint32,
    "first_block_index": uint32, "num_blocks": uint32,
}  # fmt: skip


@st.composite
def damaged(draw, good: decode_pb2.KVBlocksMessage, itemsize: int = 4) -> decode_pb2.KVBlocksMessage:
    """good with up to three fields replaced, its data kept, resized to the new shape, random, cut or empty,
    and its checksum right for the new data, wrong or missing."""
    msg = decode_pb2.KVBlocksMessage()
    msg.CopyFrom(good)
    for name in draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=3)):
        setattr(msg, name, draw(FIELD_VALUES[name]))
    kind = draw(st.sampled_from(["keep", "fit", "random", "cut", "empty"]))
    size = max(0, msg.layer_end - msg.layer_start) * 2 * msg.num_blocks * msg.block_size * msg.num_kv_heads * msg.head_dim
    if kind == "fit" and size * itemsize <= 8 * 1024 * 1024:
        msg.data = bytes(size * itemsize)
    elif kind == "random":
        msg.data = draw(st.binary(max_size=64))
    elif kind == "cut":
        msg.data = msg.data[: draw(st.integers(0, max(0, len(msg.data) - 1)))]
    elif kind == "empty":
        msg.data = b""
    how = draw(st.sampled_from(["right", "right", "wrong", "missing"]))
    if how == "right":
        msg.checksum = checksum(msg.data)
    elif how == "wrong":
        msg.checksum = (checksum(msg.data) + 1) % 2**64
    else:
        msg.ClearField("checksum")
    return msg


@given(data=st.data())
@FUZZ
def test_fuzz_transfer_kv(cluster, decode, model_config, tracebacks_before, data):
    rid = uuid.uuid4().hex
    call = reserve(decode, rid)
    good = kv_transfer(cluster.addresses["decode0"], model_config, rid, num_blocks=3, max_bytes=800_000)
    body = data.draw(st.lists(st.one_of(st.sampled_from(good[:-1]), damaged(good[0])), max_size=4))
    last = decode_pb2.KVBlocksMessage()
    last.CopyFrom(good[-1])
    last.first_token_id = data.draw(st.sampled_from([5, model_config.vocab_size, 2**32 - 1]))
    if data.draw(st.booleans()):
        last.num_messages_sent = sum(1 for m in body if m.num_blocks)
    stream = body + data.draw(st.sampled_from([[last], [], [last, last]]))
    try:
        reply = decode.TransferKV(iter(stream), timeout=60)
        assert reply.num_blocks_received == 3
        assert finish_generate(call)[-1].HasField("finish_reason")
    except grpc.RpcError as e:
        expect_client_error(e, "KV", "request", "checksum", "first token", "num_", "_id")
        if stream and stream[0].request_id == rid:  # (this transfer owned the request: the request failed)
            assert finish_generate(call)[-1].error
        call.cancel()
    expect_healthy(cluster, tracebacks_before)


# -- fuzz: Decode.Generate and Prefill.Prefill ---------------------------------------------------------------
def fuzzed_params(data) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(max_tokens=4)
    for name, value in data.draw(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), numbers, max_size=4)).items():
        try:
            setattr(p, name, type(getattr(p, name))(value))
        except (TypeError, ValueError, OverflowError):
            continue  # (not representable in the field: a client library refuses it before sending)
    if p.max_tokens > 4:
        p.max_tokens = 4
    if data.draw(st.booleans()):
        p.stop_token_ids.extend(data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    if data.draw(st.booleans()):
        for t, bias in data.draw(st.dictionaries(st.integers(0, 2**32 - 1), st.floats(width=32), max_size=3)).items():
            p.logit_bias[t] = bias
    return p


def fuzzed_prompt(data, vocab_size: int) -> list[int]:
    return data.draw(st.one_of(
        st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=60),
        st.lists(st.integers(0, 2**32 - 1), max_size=5),  # (out of vocabulary, or empty)
        st.just([1] * 9000),  # (longer than the context)
        st.just([vocab_size]),
    ))  # fmt: skip


@given(data=st.data())
@FUZZ
def test_fuzz_decode_generate(cluster, decode, model_config, tracebacks_before, data):
    request = decode_pb2.DecodeRequest(
        request_id=data.draw(st.sampled_from([uuid.uuid4().hex, "", "y" * 20000])),
        prompt_token_ids=fuzzed_prompt(data, model_config.vocab_size), sampling_params=fuzzed_params(data),
        cache_salt="fuzz", compute_prompt=data.draw(st.booleans()),
        priority=data.draw(st.sampled_from([0, -(2**31), 2**31 - 1])))  # fmt: skip
    call = decode.Generate(request, timeout=120)
    try:
        first = next(call)
        assert first.reserved
        if request.compute_prompt:
            replies = finish_generate(call)
            assert replies[-1].HasField("finish_reason"), replies[-1]
    except grpc.RpcError as e:
        expect_client_error(e, *SAMPLING_FIELDS, "prompt", "request", "token", "logit_bias", "stop", "KV", "tokens")
    finally:
        call.cancel()
    expect_healthy(cluster, tracebacks_before)


@given(data=st.data())
@FUZZ
def test_fuzz_prefill(cluster, decode, prefill, model_config, tracebacks_before, data):
    """A Prefill for a request the decode reserved (or did not: the decode then refuses its KV), with random
    prompt ids, sampling values and skip counts: a success or a client error; nothing held anywhere after."""
    rid = uuid.uuid4().hex
    reserved = data.draw(st.booleans())
    call = reserve(decode, rid) if reserved else None
    prompt = list(range(1, PROMPT_LEN + 1)) if data.draw(st.booleans()) else fuzzed_prompt(data, model_config.vocab_size)
    request = prefill_pb2.PrefillRequest(
        request_id=data.draw(st.sampled_from([rid, rid, ""])), prompt_token_ids=prompt,
        sampling_params=fuzzed_params(data), decode_address=cluster.addresses["decode0"], decode_instance_id="decode0",
        num_skip_blocks=data.draw(st.sampled_from([0, 0, 1, 3, 2**32 - 1])), cache_salt="fuzz-" + rid,
        priority=data.draw(st.sampled_from([0, 2**31 - 1])))  # fmt: skip
    try:
        prefill.Prefill(request, timeout=120)
        if call is not None:  # (the KV went to the decode: it decodes, or failed the request for bad KV)
            assert finish_generate(call)[-1].HasField("finish_reason")
    except grpc.RpcError as e:
        expect_client_error(e, *SAMPLING_FIELDS, "prompt", "request", "token", "logit_bias", "stop", "KV",
                            "num_skip_blocks", "decode_address")  # fmt: skip
    finally:
        if call is not None:
            call.cancel()  # (as the gateway does when the prefill fails)
    expect_healthy(cluster, tracebacks_before, gateway=data.draw(st.booleans()))


def test_services_still_serve_after_the_fuzzing(cluster, tracebacks_before):
    expect_healthy(cluster, tracebacks_before, gateway=True)


pytestmark = [pytest.mark.fuzz, pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")]
