"""Gateway: the public gRPC API. Templating, tokenization and validation, routing, then the stream relay:
first token from the prefill at once, the rest from the decode, as UTF-8-safe text deltas."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid

import grpc
import torch
from grpc_health.v1 import health_pb2
from transformers import AutoTokenizer

from services.gateway.detokenizer import TextStream
from services.gateway.router import RoundRobinRouter
from services.runtime import (
    FINISH_TO_PROTO, ChannelPool, UpstreamError, add_quantization_arg, make_server, sampling_params_from_proto,
)  # fmt: skip
from shared.config import ModelConfig
from shared.model_files import default_model_dir
from shared.registry import Registry
from shared.request import FinishReason
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant")
MAX_ATTEMPTS = 3
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, model_config: ModelConfig, tokenizer, router: RoundRobinRouter, default_max_tokens: int):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.router = router
        self.default_max_tokens = default_max_tokens
        self.channels = ChannelPool()

    def tokenize(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        """Prompt text or chat turns -> token ids. ValueError on empty or oversized input or an unknown role."""
        kind = request.WhichOneof("input")
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages or all(not m["content"] for m in messages):
                raise ValueError("prompt is empty: chat has no message with content")
            for m in messages:
                if m["role"] not in ROLES:
                    raise ValueError(f"unknown chat role {m['role']!r}; expected one of {ROLES}")
            self._check_chars(sum(len(m["content"]) for m in messages))
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        if kind != "prompt" or not request.prompt:
            raise ValueError("prompt is empty")
        self._check_chars(len(request.prompt))
        return self.tokenizer(request.prompt, add_special_tokens=False).input_ids

    def _check_chars(self, num_chars: int) -> None:
        # Cheap bound before tokenizing: no real prompt needs more than 64 characters per token of context.
        limit = 64 * self.model_config.max_model_len
        if num_chars > limit:
            raise ValueError(f"prompt has {num_chars} characters; at most {limit} fit the model's context")

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        prompt_ids = await asyncio.to_thread(self.tokenize, request)  # long prompts must not stall other streams
        max_len = self.model_config.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model's context is {max_len} tokens")
        params = sampling_params_from_proto(request.sampling_params, self.default_max_tokens)
        text = TextStream(self.tokenizer, tuple(request.sampling_params.stop))
        proto_params = common_pb2.SamplingParams()
        proto_params.CopyFrom(request.sampling_params)
        proto_params.max_tokens = min(params.max_tokens, max_len - len(prompt_ids))
        request_id = request.request_id or uuid.uuid4().hex
        decode_call, first_token_id, prefill, decode = await self._start(request_id, prompt_ids, proto_params)
        try:
            ttft_ms = (time.perf_counter() - t0) * 1000
            tokens = [first_token_id]
            yield gateway_pb2.GenerateResponse(request_id=request_id, text=text.push(tokens), token_ids=tokens)
            finish_reason = None
            while finish_reason is None and not text.stopped:
                try:
                    reply = await decode_call.read()
                except grpc.aio.AioRpcError as e:
                    raise UpstreamError(e.code(), f"decode {decode.address}: {e.details()}") from None
                if reply is grpc.aio.EOF:
                    raise RuntimeError(f"decode {decode.address} ended the stream without a finish reason")
                if reply.error:
                    raise RuntimeError(f"decode {decode.address} failed: {reply.error}")
                if reply.HasField("finish_reason"):
                    finish_reason = reply.finish_reason
                delta = text.push(list(reply.token_ids))
                if reply.token_ids:
                    yield gateway_pb2.GenerateResponse(request_id=request_id, text=delta, token_ids=reply.token_ids)
            if text.stopped:
                finish_reason = FINISH_TO_PROTO[FinishReason.STOP]
        except BaseException as e:
            log.info("request %s ended early (%s)", request_id, type(e).__name__)
            raise
        finally:
            decode_call.cancel()  # no-op when finished; otherwise aborts on the decode and frees its blocks
        e2e_ms = (time.perf_counter() - t0) * 1000
        log.info("request %s: %d prompt + %d completion tokens, %s, TTFT %.0f ms, E2E %.0f ms (prefill %s, decode %s)",
                 request_id, len(prompt_ids), len(text.token_ids), common_pb2.FinishReason.Name(finish_reason),
                 ttft_ms, e2e_ms, prefill.instance_id, decode.instance_id)  # fmt: skip
        yield gateway_pb2.GenerateResponse(
            request_id=request_id,
            text=text.finish(),
            finish_reason=finish_reason,
            usage=gateway_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(text.token_ids)),
            timings=gateway_pb2.Timings(ttft_ms=ttft_ms, e2e_ms=e2e_ms),
        )

    async def _start(self, request_id: str, prompt_ids: list[int], params: common_pb2.SamplingParams):
        """Reserve on a decode, then prefill on a prefill naming that decode; returns (decode stream, first token,
        prefill, decode). An instance that is unreachable (dead but still in the registry until its TTL) or
        full is skipped and the request is placed again, up to MAX_ATTEMPTS times."""
        skipped: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decode = await self.router.pick("decode", len(prompt_ids) + params.max_tokens, skipped)
            prefill = await self.router.pick("prefill", 0, skipped)
            decode_call = decode_pb2_grpc.DecodeStub(self.channels.get(decode.address)).Generate(
                decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params)
            )
            failed = decode
            try:
                reply = await decode_call.read()
                if reply is grpc.aio.EOF or not reply.reserved:
                    raise RuntimeError(f"decode {decode.address} did not reserve the request")
                failed = prefill
                prefill_reply = await prefill_pb2_grpc.PrefillStub(self.channels.get(prefill.address)).Prefill(
                    prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                               sampling_params=params, decode_address=decode.address)
                )  # fmt: skip
                return decode_call, prefill_reply.first_token_id, prefill, decode
            except grpc.aio.AioRpcError as e:
                decode_call.cancel()
                retry = e.code() in RETRY_CODES and attempt < MAX_ATTEMPTS
                log.warning("request %s: %s %s failed with %s%s", request_id, failed.tier, failed.address,
                            e.code().name, ", placing it again" if retry else "")  # fmt: skip
                if not retry:
                    raise UpstreamError(e.code(), f"{failed.tier} {failed.address}: {e.details()}") from None
                skipped.add(failed.instance_id)
            except BaseException:
                decode_call.cancel()
                raise


async def main_async(args) -> None:
    torch.set_num_threads(1)
    model_dir = args.model or default_model_dir()
    model_config = ModelConfig.from_dir(model_dir, args.quantization)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    router = RoundRobinRouter(Registry(args.redis_url), model_config.model_id)
    server, port, health_servicer = make_server(args.port, args.host)
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(model_config, tokenizer, router, args.default_max_tokens), server
    )
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"gateway serving on {args.host}:{port}", flush=True)
    await server.wait_for_termination()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description="Public gRPC API of the tandem cluster",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=os.environ.get("TANDEM_MODEL"))
    add_quantization_arg(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://localhost:6379/0"))
    parser.add_argument("--default-max-tokens", type=int, default=256)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    asyncio.run(main_async(parser.parse_args(argv)))
