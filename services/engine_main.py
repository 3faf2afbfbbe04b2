"""The process main of an engine service (prefill, decode): flags -> engine on its thread -> gRPC server,
registered in Redis with a heartbeat until SIGTERM/SIGINT. Also serves Instance.GetLoad for both tiers."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import uuid
from typing import Any, Callable

from tandem.services.convert import stats_to_proto
from tandem.services.engine_lora import EngineLoRA
from tandem.services.flags import (HelpFormatter, add_engine_service_args, apply_env, implied_engine_settings,
                                   own_address, settings_line)
from tandem.services.logs import setup_logging
from tandem.services.metrics import STATS_REFRESH_S, EngineMetrics, metrics_url, serve_metrics
from tandem.services.security import check_redis_auth, tls_from_args
from tandem.services.server import Server, dump_stacks_on_sigusr1, exit_on_signal_while_starting, new_instance_id
from tandem.services.tracing import setup_tracing
from tandem.shared.async_engine import AsyncEngine, build_engine
from tandem.shared.engine_args import EngineArgs
from tandem.shared.cluster_state import cancel_and_wait
from tandem.shared.cluster_state.prefix_index import KVEventPublisher
from tandem.shared.cluster_state.registry import InstanceInfo, Registry
from tandem.shared.utils import machine_cpus
from tandem.v1 import common_pb2_grpc

log = logging.getLogger(__name__)
# The calls that bring a new request to an engine: refused while it drains (services/server.py)
ADMISSION_METHODS = {"prefill": ("/tandem.v1.Prefill/Prefill", "/tandem.v1.Prefill/Embed"),
                     "decode": ("/tandem.v1.Decode/Generate",)}


class InstanceServicer(common_pb2_grpc.InstanceServicer):
    """What any engine instance answers about itself, and its LoRA adapters (services/engine_lora.py)."""

    def __init__(self, engine: AsyncEngine, lora: EngineLoRA):
        self.engine, self.lora = engine, lora

    async def GetLoad(self, request, context):
        return stats_to_proto(await self.engine.stats())

    async def LoadLoRAAdapter(self, request, context):
        return await self.lora.load(request)

    async def UnloadLoRAAdapter(self, request, context):
        return await self.lora.unload(request)

    async def ListLoRAAdapters(self, request, context):
        return await self.lora.list()


def engine_main(tier: str, description: str, add_servicer: Callable[[Server, AsyncEngine, EngineMetrics, Any], Any],
                export_kv: bool = False, argv=None) -> None:
    """Parse the engine flags, load the engine, add_servicer(server, async_engine, metrics, args) -> the servicer
    (its busy(): work that outlives its calls), serve (gRPC, and Prometheus metrics on --metrics-port) until
    SIGTERM/SIGINT, then drain (services/server.py) and exit 0. With --tensor-parallel-size N the other ranks run
    as child processes (shared/parallel/); one that exits, or a step that fails, takes the instance down:
    NOT_SERVING, its registry record removed, every call ended UNAVAILABLE at once (as the process's death would
    end them: the gateway places its requests elsewhere, migrating the streams), exit 1; a drain stops them all.

    Exits with a one-line error when no registry is given and --standalone is not set: an instance nobody can
    find would look healthy and never get a request."""
    parser = argparse.ArgumentParser(prog=f"python -m tandem.services.{tier}", description=description,
                                     formatter_class=HelpFormatter)  # fmt: skip
    add_engine_service_args(parser, tier)
    apply_env(parser, argv)
    args = implied_engine_settings(parser.parse_args(argv))
    args.advertise_host = args.advertise_host or own_address()
    if not args.redis_url and not args.standalone:
        parser.error("no registry: pass --redis-url (or set REDIS_URL), or --standalone to serve unregistered")
    try:
        tls = tls_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    instance_id = new_instance_id(tier)
    print(settings_line(f"{tier} {instance_id}", args), flush=True)
    args.tls = tls  # (its server, and its channels to other instances: mutual TLS when it has a CA)
    setup_logging(tier, instance_id, args.log_format)
    setup_tracing(tier, instance_id, args.otlp_traces_endpoint)
    exit_on_signal_while_starting()
    dump_stacks_on_sigusr1()
    try:
        failure = asyncio.run(_serve(args, tier, instance_id, add_servicer, export_kv))
    except (ValueError, OSError) as e:  # a model or setting that cannot be served: one line, no traceback
        sys.exit(f"error: {e}")
    if failure is not None:  # (a tensor-parallel instance was lost: down, not drained)
        sys.exit(f"error: {failure}")


async def _log_stats(engine: AsyncEngine, interval_s: float = 30.0) -> None:
    """Every interval_s, when requests came meanwhile: the prefix cache's size, hit rate and evictions, and
    with speculative decoding, its acceptance rate and tokens per verified step."""
    last = last_drafts = 0
    while True:
        await asyncio.sleep(interval_s)
        s = await engine.stats()
        if s.prefix_cache_queries != last:
            last = s.prefix_cache_queries
            log.info("prefix cache: %d blocks, hit rate %.1f%% (%d of %d prompt tokens since start), %d evictions",
                     s.num_cached_blocks, 100 * s.prefix_cache_hit_rate, s.prefix_cache_hits,
                     s.prefix_cache_queries, s.num_evictions)  # fmt: skip
        if s.spec_num_drafts != last_drafts:
            last_drafts = s.spec_num_drafts
            log.info("speculative decoding: acceptance rate %.1f%% (%d of %d draft tokens since start), mean "
                     "acceptance length %.2f tokens per verified step", 100 * s.spec_acceptance_rate,
                     s.spec_num_accepted_tokens, s.spec_num_draft_tokens, s.spec_mean_acceptance_length)  # fmt: skip


YIELD_CHECK_S = 0.5  # how often a decode reads the prefill tier's records (the records beat every second)
YIELD_MIN_BACKLOG_S = 1.0  # a prefill's queued prompts, in seconds at its measured rate, that a decode yields to
# a prefill record not published again for this long (two heartbeats missed) is a prefill that died or froze: its
# queue is nothing to yield to (its record stays listed until its TTL, 10 s)
YIELD_STALE_S = 2.5


def prefill_backlog_s(prefill: InstanceInfo) -> float:
    """Seconds of prompt work queued at a prefill: its queued tokens over its measured tokens/s (0 while it has
    measured none)."""
    return prefill.num_queued_tokens / prefill.tokens_per_s if prefill.tokens_per_s > 0 else 0.0


async def _yield_to_prefill(registry: Registry, info: InstanceInfo, engine: AsyncEngine, interval_s: float) -> None:
    """A decode's steps start at most every interval_s while a prefill instance on its CPUs (InstanceInfo.shares_cpus)
    has at least YIELD_MIN_BACKLOG_S of prompts queued; at full speed otherwise. Why: on a machine whose cores both
    tiers share, a decode running a few requests steps every ~10 ms, each step streaming all the weights for a few
    tokens, and takes half the cores from the prefill, doubling every queued prompt's TTFT; spacing its steps gives
    the prefill most of the cores while its queue lasts, for a TPOT of about interval_s (docs/performance.md). A
    registry that cannot be read (Redis down: its lists are old) is no reason to yield: full speed until it answers;
    nor is a prefill whose record was last published over YIELD_STALE_S ago (it died or froze)."""
    yielding_to = None
    while True:
        try:
            prefills = await registry.list_instances("prefill")
            if not registry.healthy:  # (that read got no answer: these are the last lists seen)
                prefills = []
            now_s = time.time()  # (a record shares_cpus with this one only on this machine: one clock)
            busy = [p for p in prefills if p.shares_cpus(info) and prefill_backlog_s(p) >= YIELD_MIN_BACKLOG_S
                    and now_s - p.published_s <= YIELD_STALE_S]
            engine.step_interval_s = interval_s if busy else 0.0
            now = busy[0].instance_id if busy else None
            if now != yielding_to:
                if busy:
                    log.info("yielding CPUs to prefill %s (%.1f s of prompts queued): a step every %.0f ms at most",
                             now, prefill_backlog_s(busy[0]), interval_s * 1e3)  # fmt: skip
                else:
                    log.info("no prefill on these CPUs is backed up: stepping at full speed")
                yielding_to = now
        except Exception as e:  # (a record the decision cannot read: full speed; logged once until it reads)
            engine.step_interval_s = 0.0
            if yielding_to != "failed":
                log.warning("could not read the prefill tier's records, stepping at full speed: %s", e)
            yielding_to = "failed"
        await asyncio.sleep(YIELD_CHECK_S)


async def _refresh_metrics(engine: AsyncEngine, metrics: EngineMetrics) -> None:
    """Keep the metrics' EngineStats snapshot at most STATS_REFRESH_S old, or as old as the engine's current step
    (a scrape and a heartbeat never wait on the engine)."""
    while True:
        metrics.stats.stats = await engine.stats()
        await asyncio.sleep(STATS_REFRESH_S)


def _with_load(info: InstanceInfo, metrics: EngineMetrics, lora: EngineLoRA) -> InstanceInfo:
    """The instance's registry record with the load of the metrics' last EngineStats snapshot and the last list of
    its LoRA adapters: never a wait on the engine, so a long step does not stop the heartbeat (the instance would
    drop out of the registry while it works)."""
    stats = metrics.stats.stats
    info.num_free_blocks, info.num_running, info.num_waiting, info.num_queued_tokens = (
        stats.num_free_blocks, stats.num_running, stats.num_waiting, stats.num_queued_tokens)  # fmt: skip
    info.tokens_per_s = round(metrics.tokens_per_s, 1)
    info.kv_tier_load_s = dict(stats.kv_tier_load_s)  # (measured by the engine: the router's price of a tier hit)
    return lora.record(info)


def _serving_line(engine, engine_args: EngineArgs, info: InstanceInfo, registered: bool, metrics_at: str) -> str:
    """The start-up line saying what this instance serves, where, and with which settings and weights."""
    model_config, cache_config, scheduler_config = engine.model_config, engine.cache_config, engine.scheduler.config
    return (f"{info.tier} {info.instance_id} serving {model_config.model_id} on {info.address}"
            f"{'' if registered else ' (standalone)'}: {cache_config.num_blocks} KV blocks of "
            f"{cache_config.block_size} tokens ({cache_config.kv_dtype}), {scheduler_config.max_num_batched_tokens} "
            f"tokens and {scheduler_config.max_num_seqs} requests per step, {engine_args.threads} torch threads, "
            f"{engine_args.resolved_kernel_threads(info.tier)} kernel threads, {engine_args.device}, "
            f"prefix caching {'on' if cache_config.enable_prefix_caching else 'off'}; metrics on {metrics_at}; "
            f"weights: {engine_args.weights_line(model_config)}")


def _watch_ranks(engine) -> tuple[asyncio.Future, Callable[[str], None]]:
    """A future that gets the reason once a tensor-parallel instance is lost (never, for one process): a rank of
    engine exits, or lost(reason) is called (AsyncEngine's on_lost: a step failed). lost runs on the event loop."""
    loop = asyncio.get_running_loop()
    failed = loop.create_future()

    def lost(reason: str) -> None:
        if not failed.done():
            failed.set_result(reason)

    if engine.tp_workers is not None:
        engine.tp_workers.add_failure_callback(lambda reason: loop.call_soon_threadsafe(lost, reason))
    return failed, lost


async def _serve_until_stopped(server, servicer, leave_registry, instance_lost) -> str | None:
    """Serve until a signal drains the server (None), or until the tensor-parallel instance is lost: then down at
    once (NOT_SERVING, out of the registry, every call ended UNAVAILABLE as by a dead process, which the gateway
    answers by placing its requests elsewhere: no request fails for it) and the reason is returned."""
    serving = asyncio.create_task(server.serve_until_signal(on_drain=leave_registry, busy=servicer.busy))
    await asyncio.wait([serving, instance_lost], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        return None
    serving.cancel()
    log.error("the instance is lost (%s): ending its calls and exiting", instance_lost.result())
    await server.health.enter_graceful_shutdown()
    server.drain.draining = True
    await leave_registry()
    await server.grpc.stop(grace=None)  # (nothing would answer them: the engine steps no more)
    return instance_lost.result()


async def _check_start(engine_args: EngineArgs, redis_url: str | None) -> None:
    """What stops a start before the model loads: --device cuda without a usable GPU, a wrong Redis password."""
    import torch

    if engine_args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is usable here (torch {torch.__version__})")
    if redis_url:
        await check_redis_auth(redis_url)


async def _serve(args, tier: str, instance_id: str, add_servicer, export_kv: bool) -> str | None:
    from tandem.shared.model_files import default_model_dir

    engine_args = EngineArgs.from_namespace(args)
    await _check_start(engine_args, args.redis_url)
    registry = Registry(args.redis_url) if args.redis_url else None
    publish_index = registry is not None and engine_args.enable_prefix_caching
    engine = build_engine(engine_args, tier, default_model_dir(), export_kv=export_kv, kv_events=publish_index,
                          tp_worker_module="tandem.services.tp_worker")  # (ranks > 0 ship and take KV too)
    model_config = engine.model_config
    cache_config = engine.cache_config  # with num_blocks resolved (--memory-utilization)
    metrics = EngineMetrics(tier, model_config.name, instance_id)
    instance_lost, lost = _watch_ranks(engine)
    async_engine = AsyncEngine(engine, asyncio.get_running_loop(), on_step=metrics.observe_step, on_lost=lost)
    server = Server(tier, instance_id, args.host, args.port, args.drain_timeout, ADMISSION_METHODS[tier], args.tls)
    metrics_port = serve_metrics(metrics.registry, args.host, args.metrics_port)
    servicer = add_servicer(server, async_engine, metrics, args)
    lora = EngineLoRA(async_engine, engine.read_lora)
    await lora.start()
    common_pb2_grpc.add_InstanceServicer_to_server(InstanceServicer(async_engine, lora), server.grpc)
    incarnation = uuid.uuid4().hex[:12]  # this start of the instance: the prefix index trusts only its entries
    contract = engine.hash_contract if publish_index else None
    info = InstanceInfo(instance_id, tier, f"{args.advertise_host}:{server.port}", model_config.model_id,
                        cache_config.block_size, cache_config.num_blocks, incarnation=incarnation,
                        hash_contract=contract.to_dict() if contract else None,
                        kv_dtype=cache_config.kv_dtype)  # fmt: skip
    # (its ranks, and where each takes KV: rank 0 on its address, the others' TransferKVShard servers)
    info.tensor_parallel_size = engine.tp_workers.group.size if engine.tp_workers is not None else 1
    info.kv_endpoints = [info.address] + list(getattr(servicer, "kv_rank_endpoints", ()))
    info.boot_id, info.cpus = machine_cpus()

    async def current_info() -> InstanceInfo:
        return _with_load(info, metrics, lora)

    metrics.stats.stats = await async_engine.stats()  # (the first registration carries the real load)
    await server.start()
    stats_refresh = asyncio.create_task(_refresh_metrics(async_engine, metrics))
    lora_refresh = asyncio.create_task(lora.refresh())
    heartbeat = publisher = publishing = None
    if registry:
        try:  # registered before its first index entry: the gateway's cleanup drops unregistered incarnations
            await registry.publish(await current_info())
        except Exception as e:
            log.warning("first registration failed (the heartbeat retries): %s", e)
        heartbeat = asyncio.create_task(registry.heartbeat(current_info))
    if publish_index:
        publisher = KVEventPublisher(args.redis_url, instance_id, incarnation, contract, async_engine.kv_snapshot)
        publishing = asyncio.create_task(publisher.run(async_engine.kv_events))
    stats_log = asyncio.create_task(_log_stats(async_engine))
    yielding = None
    if registry and tier == "decode" and args.yield_to_prefill_ms > 0:
        yielding = asyncio.create_task(_yield_to_prefill(registry, info, async_engine, args.yield_to_prefill_ms / 1e3))

    async def leave_registry() -> None:  # (a drain's first step: the gateway stops routing here at once)
        # (no beat nor index write lands after removal; the requests left finish at full speed)
        await cancel_and_wait(stats_log, heartbeat, publishing, yielding)
        async_engine.step_interval_s = 0.0
        if heartbeat:
            try:
                await registry.remove(info)
            except Exception as e:  # Redis may already be gone at shutdown
                log.warning("could not deregister: %s", e)
        if publishing:
            try:
                await publisher.remove_incarnation()
            except Exception as e:
                log.warning("could not remove this instance's prefix index entries: %s", e)

    print(_serving_line(engine, engine_args, info, registry is not None,
                        metrics_url(args.advertise_host, metrics_port)), flush=True)
    try:
        return await _serve_until_stopped(server, servicer, leave_registry, instance_lost)
    finally:  # (the drain stopped the Redis loops already; a failure may not have: asyncio.run's one cancel
        # of each could be lost, shared/cluster_state/__init__.py)
        await cancel_and_wait(stats_refresh, lora_refresh, stats_log, heartbeat, publishing, yielding)
        async_engine.stop()
