"""The gateway process: flags -> tokenizer, router and the request pipeline -> the gRPC server (with health and
reflection) and the OpenAI-compatible HTTP API (with /metrics) in one event loop, until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from tandem.services.flags import HelpFormatter, add_gateway_args, apply_env, settings_line
from tandem.services.channels import ChannelPool
from tandem.services.gateway.admission import AdmissionQueue
from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.router import Router
from tandem.services.gateway.server import GatewayServicer
from tandem.services.logs import setup_logging
from tandem.services.security import APIKeyInterceptor, api_keys_from_args, check_redis_auth, tls_from_args
from tandem.services.server import Server, dump_stacks_on_sigusr1, exit_on_signal_while_starting, new_instance_id
from tandem.services.tracing import setup_tracing
from tandem.shared.cluster_state import cancel_and_wait
from tandem.shared.engine_args import EngineArgs
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


async def serve(args, instance_id: str, tls, api_keys) -> None:
    import torch
    from transformers import AutoTokenizer

    from tandem.shared.block_hash import HashContract
    from tandem.shared.model_files import default_model_dir
    from tandem.shared.cluster_state.prefix_index import PrefixIndex
    from tandem.shared.cluster_state.registry import Registry

    torch.set_num_threads(1)
    await check_redis_auth(args.redis_url)  # (a wrong password stops the start: ValueError naming --redis-url)
    model_dir = args.model or default_model_dir()
    engine_args = EngineArgs.from_namespace(args)
    model_config = engine_args.create_model_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    contract = HashContract(args.block_size, model_config.model_id, engine_args.resolved_kv_dtype(model_config))
    index = PrefixIndex(args.redis_url, contract) if args.routing == "cache-aware" else None
    router = Router(Registry(args.redis_url), model_config.model_id, contract, index, args.routing,
                    args.local_prefill_tokens, kv_variant=model_config.kv_variant,
                    session_max_load=args.session_affinity_max_load, session_ttl_s=args.session_affinity_ttl)
    # The engines are called with the same certificate and CA (mutual TLS when they require it); API keys guard
    # the public API, not health or reflection.
    server = Server("gateway", instance_id, args.host, args.port, args.drain_timeout, ("/tandem.v1.Gateway/",),
                    tls, APIKeyInterceptor(api_keys) if api_keys else None)  # fmt: skip
    admission = AdmissionQueue(args.max_concurrent_requests, args.max_waiting_requests, args.queue_timeout)
    pipeline = GatewayPipeline(model_config, tokenizer, router, args.default_max_tokens, instance_id,
                               ChannelPool(tls), admission, args.max_migrations, args.tool_call_parser,
                               args.reasoning_parser)  # fmt: skip
    model_name = args.served_model_name or Path(model_dir).name  # (the base model's name in both APIs)
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(pipeline, model_name), server.grpc)
    reflection.enable_server_reflection((gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
                                         health.SERVICE_NAME, reflection.SERVICE_NAME), server.grpc)  # fmt: skip
    http = http_task = None
    if args.http_port >= 0:  # (up before health says SERVING)
        from tandem.services.gateway.openai_api import create_app, serve_http

        app = create_app(pipeline, model_name, server.instance_id, api_keys)
        http, http_port, http_task = await serve_http(app, args.host, args.http_port, args.drain_timeout, tls)
    await server.start()
    cleanup = asyncio.create_task(_every(5.0, router.cleanup_index))
    if tls and tls.require_client_cert and not tls.client_ca_file:
        log.warning("--tls-client-auth require without --tls-client-ca-file: public clients' certificates come from "
                    "--tls-ca-file, which the prefill and decode services accept too (docs/security.md)")
    security = (f"TLS{' with client certificates' if tls.require_client_cert else ''}" if tls else "plaintext") + (
        f", {len(api_keys.keys)} API key(s)" if api_keys else ", no API key")  # fmt: skip
    print(f"gateway {server.instance_id} serving on {args.host}:{server.port} ({args.routing} routing; {security})",
          flush=True)  # fmt: skip
    if http is not None:
        scheme = "https" if tls else "http"
        print(f"OpenAI-compatible API at {scheme}://{args.host}:{http_port}/v1; metrics on "
              f"{scheme}://{args.host}:{http_port}/metrics", flush=True)  # fmt: skip

    async def stop_http() -> None:  # (uvicorn stops accepting, and finishes the requests it has)
        if http is not None:
            http.should_exit = True

    async def drain() -> None:  # (requests still running near the drain timeout end with an error: pipeline.drain)
        pipeline.drain(args.drain_timeout)
        await stop_http()

    try:
        await server.serve_until_signal(on_drain=drain, busy=lambda: http_task is not None and not http_task.done())
    finally:
        await cancel_and_wait(cleanup)
        await stop_http()


async def _every(interval_s: float, job) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await job()
        except Exception:
            log.exception("periodic %s failed", job.__name__)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.services.gateway",
                                     description="Public gRPC API of the tandem cluster",
                                     formatter_class=HelpFormatter)
    add_gateway_args(parser)
    apply_env(parser, argv)
    args = parser.parse_args(argv)
    if not args.redis_url:
        parser.error("no registry: pass --redis-url (or set REDIS_URL); the gateway finds instances there")
    try:
        tls, api_keys = tls_from_args(args), api_keys_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    instance_id = new_instance_id("gateway")
    print(settings_line(f"gateway {instance_id}", args), flush=True)
    setup_logging("gateway", instance_id, args.log_format)
    setup_tracing("gateway", instance_id, args.otlp_traces_endpoint)
    exit_on_signal_while_starting()
    dump_stacks_on_sigusr1()
    try:
        asyncio.run(serve(args, instance_id, tls, api_keys))
    except ValueError as e:  # (a setting that cannot work, e.g. a password Redis refuses: one line, no traceback)
        sys.exit(f"error: {e}")
