"""What every service shares: the gRPC server with its error interceptor and health service, engine flags,
protobuf <-> engine conversions, and the registry heartbeat."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.async_engine import AsyncEngine
from shared.config import CacheConfig, ModelConfig, SchedulerConfig, parse_dtype
from shared.model_files import default_model_dir
from shared.engine import LLMEngine
from shared.registry import InstanceInfo, Registry
from shared.request import FinishReason, RequestStatus, SamplingParams
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


class ServiceUnavailable(Exception):
    """No instance can take the request now (mapped to UNAVAILABLE)."""


class UpstreamError(Exception):
    """A call to another tier failed; passed on with its status code and a message naming that instance."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps engine exceptions to gRPC status codes, in one place for every service.

    ValueError -> INVALID_ARGUMENT, MemoryError -> RESOURCE_EXHAUSTED, KeyError -> NOT_FOUND,
    ServiceUnavailable -> UNAVAILABLE, an upstream call's error -> its own code, anything else -> INTERNAL.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        return handler


async def _abort_for(context, e: Exception):
    if isinstance(e, UpstreamError):
        await context.abort(e.code, str(e))
    if isinstance(e, grpc.aio.AioRpcError):
        await context.abort(e.code(), e.details())
    if isinstance(e, ServiceUnavailable):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, MemoryError):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if isinstance(e, KeyError):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
    log.exception("unhandled error")
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def _wrap_unary(fn):
    async def wrapper(request, context):
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_for(context, e)

    return wrapper


def _wrap_stream(fn):
    async def wrapper(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_for(context, e)

    return wrapper


def make_server(port: int, host: str = "0.0.0.0") -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """An asyncio gRPC server with the error interceptor, raised message limits and the standard health service."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=GRPC_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, bound, health_servicer


def sampling_params_from_proto(p: common_pb2.SamplingParams, default_max_tokens: int = 64) -> SamplingParams:
    """Proto -> engine SamplingParams; ValueError (INVALID_ARGUMENT) on bad values."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else default_max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def engine_load(engine: LLMEngine) -> common_pb2.InstanceLoad:
    """Snapshot of an engine's load (run on the engine thread)."""
    scheduler = engine.scheduler
    return common_pb2.InstanceLoad(
        model_id=engine.model_config.model_id,
        block_size=engine.cache_config.block_size,
        num_blocks=engine.cache_config.num_blocks,
        num_free_blocks=engine.num_free_blocks,
        num_running=len(scheduler.running),
        num_waiting=sum(r.status != RequestStatus.RUNNING for r in engine.requests.values()),
    )


# -- engine process set-up --------------------------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser, num_blocks: int, max_num_batched_tokens: int) -> None:
    parser.add_argument("--model", default=os.environ.get("TANDEM_MODEL"), help="HF model dir (default: converted SmolLM2)")
    add_quantization_arg(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--advertise-host", default=os.environ.get("TANDEM_ADVERTISE_HOST") or _own_address(),
                        help="host or IP other services use to reach this one (default: this host's IP)")  # fmt: skip
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=num_blocks)
    parser.add_argument("--kv-dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TANDEM_THREADS", "1")),
                        help="torch intra-op threads for this process")  # fmt: skip
    parser.add_argument("--device", default="cpu")


def _quantization_source(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must name a checkpoint directory, a .gguf file or 'gguf'")
    return value


def add_quantization_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", type=_quantization_source, default=os.environ.get("TANDEM_QUANTIZATION"),
                        help="quantized checkpoint holding every weight, run with --model's architecture and tokenizer: "
                             "a `tandem quantize` / HF AWQ / HF GPTQ dir, a .gguf file, or 'gguf' for the packaged "
                             "Q4_1 GGUF (all tiers must agree)")  # fmt: skip


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def engine_configs(args) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    torch.set_num_threads(args.threads)
    model_config = ModelConfig.from_dir(args.model or default_model_dir(), args.quantization)
    cache_config = CacheConfig(args.block_size, args.num_blocks, parse_dtype(args.kv_dtype))
    return model_config, cache_config, SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs)


class ChannelPool:
    """One gRPC channel per peer address, opened on first use, with the raised message limits."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return self._channels[address]


def engine_main(tier: str, description: str, num_blocks: int, max_num_batched_tokens: int, add_servicer,
                export_kv: bool = False, argv=None) -> None:
    """Entry point of an engine service: parse flags, load the engine, add_servicer(server, async_engine),
    serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{tier}", description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_engine_args(parser, num_blocks, max_num_batched_tokens)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tier} %(levelname)s %(message)s")
    asyncio.run(_run_engine_service(parser.parse_args(argv), tier, add_servicer, export_kv))


async def _run_engine_service(args, tier: str, add_servicer, export_kv: bool) -> None:
    model_config, cache_config, scheduler_config = engine_configs(args)
    engine = LLMEngine(model_config, cache_config, scheduler_config, args.device, export_kv=export_kv)
    async_engine = AsyncEngine(engine, asyncio.get_running_loop())
    server, port, health_servicer = make_server(args.port, args.host)
    add_servicer(server, async_engine)
    try:
        await serve_engine(server, port, health_servicer, args, tier, lambda: async_engine.call(engine_load, engine))
    finally:
        async_engine.stop()


async def serve_engine(server, bound_port, health_servicer, args, tier: str, get_load) -> None:
    """Start the server, register in Redis with a heartbeat, and serve until SIGTERM/SIGINT."""
    await server.start()
    address = f"{args.advertise_host}:{bound_port}"
    info = InstanceInfo(f"{tier}-{uuid.uuid4().hex[:8]}", tier, address, "", 0)
    registry = Registry(args.redis_url) if args.redis_url else None

    async def current_info() -> InstanceInfo:
        load = await get_load()
        info.model_id, info.block_size = load.model_id, load.block_size
        info.num_blocks, info.num_free_blocks = load.num_blocks, load.num_free_blocks
        info.num_running, info.num_waiting = load.num_running, load.num_waiting
        return info

    heartbeat = asyncio.create_task(registry.heartbeat(current_info)) if registry else None
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"{tier} serving on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    if heartbeat:
        heartbeat.cancel()
        try:
            await registry.remove(info)
        except Exception as e:  # Redis may already be gone at shutdown
            log.warning("could not deregister: %s", e)
    await server.stop(grace=2)
