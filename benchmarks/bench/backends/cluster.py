"""cluster: the disaggregated server, a gateway over gRPC (grpc.aio), on a running cluster or a LocalCluster
started here (redis, gateway, one prefill and one decode process by default, given the engine flags).

Requests go as raw prompts (no chat template), greedy with ignore_eos; the gateway tokenizes them as the
workload did. TTFT and ITL are measured here, at the client, on the gateway's token messages.
"""
from __future__ import annotations

import dataclasses
import sys
import time

import grpc

from tandem.benchmarks.bench.backends.base import RequestResult, weights_description
from tandem.benchmarks.bench.workloads import BenchRequest
from tandem.services.client import make_request
from tandem.services.flags import engine_argv
from tandem.shared.engine_args import EngineArgs
from tandem.v1 import gateway_pb2_grpc


class ClusterBackend:
    name = "cluster"
    static_batching = False

    def __init__(self, model_dir: str, engine_args: EngineArgs, gateway: str | None = None,
                 log_dir: str | None = None, request_timeout_s: float = 600, num_prefill: int = 1,
                 prefill_args: list[str] = (), decode_args: list[str] = (), gateway_args: list[str] = ()):
        """gateway: HOST:PORT of a running cluster (engine_args are then only reported); None starts one with
        every engine flag given to the prefill and the decode, then prefill_args / decode_args to that tier
        alone (later flags win), gateway_args to the gateway, and num_prefill prefill processes."""
        self.model_dir = model_dir
        self.engine_args = engine_args
        self.gateway = gateway
        self.log_dir = log_dir
        self.request_timeout_s = request_timeout_s
        self.num_prefill = num_prefill
        self.extra_args = {"prefill": list(prefill_args), "decode": list(decode_args), "gateway": list(gateway_args)}
        self.cluster = None
        self.channel: grpc.aio.Channel | None = None
        self.stub = None

    async def start(self) -> None:
        address = self.gateway
        if address is None:
            from tandem.services.launcher import LocalCluster

            flags = engine_argv(dataclasses.replace(self.engine_args, model=None))
            extra = self.extra_args
            self.cluster = LocalCluster(self.engine_args.model, num_prefill=self.num_prefill,
                                        prefill_args=flags + extra["prefill"], decode_args=flags + extra["decode"],
                                        gateway_args=engine_argv(self.engine_args, groups=("model",)) + extra["gateway"],
                                        log_dir=self.log_dir)  # fmt: skip
            print(f"cluster: starting redis, gateway, {self.num_prefill} prefill, decode (logs: "
                  f"{self.cluster.log_dir})", file=sys.stderr)  # fmt: skip
            self.cluster.start()
            address = self.cluster.gateway_address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def generate(self, request: BenchRequest) -> RequestResult:
        message = make_request(request.prompt, raw=True, max_tokens=request.output_len, temperature=0.0,
                               ignore_eos=True)  # fmt: skip
        result = RequestResult(request.index, request.prompt_len, start_s=time.perf_counter())
        try:
            async for reply in self.stub.Generate(message, timeout=self.request_timeout_s):
                if reply.token_ids:
                    result.token_times_s.append(time.perf_counter())
                    result.output_token_ids.extend(reply.token_ids)
                if reply.HasField("finish_reason"):
                    result.prompt_len = reply.usage.prompt_tokens
                    result.cached_tokens = reply.usage.cached_tokens
                    below = {"host": reply.usage.cached_tokens_host, "disk": reply.usage.cached_tokens_disk}
                    result.cached_tokens_by_tier = {"pool": result.cached_tokens - sum(below.values()), **below}
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"{e.code().name}: {e.details()}") from None
        result.end_s = time.perf_counter()
        return result

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def describe(self) -> dict:
        return {
            "gateway": self.gateway or f"LocalCluster: {self.num_prefill} prefill + 1 decode process",
            "extra_args": self.extra_args,
            "engine_args": dataclasses.asdict(self.engine_args),
            # (a running gateway's engines were started elsewhere: their weights are not known here)
            "weights": ("of the running gateway" if self.gateway
                        else weights_description(self.engine_args.create_model_config(self.model_dir))),
            "log_dir": str(self.cluster.log_dir) if self.cluster else None,
        }
