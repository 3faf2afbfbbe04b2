"""Talking to a running cluster from tests."""
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.client import generate
from tandem.v1 import common_pb2, common_pb2_grpc, gateway_pb2


def greedy_request(kind: str, text: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    from services.client import make_request

    return make_request(text, raw=(kind == "raw"), max_tokens=max_tokens, temperature=0.0)


def generate_all(address: str, requests: list[gateway_pb2.GenerateRequest]):
    """Send all requests at once (several in flight) and return their Completions in order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: generate(address, r, timeout=600), requests))


def load(address: str) -> common_pb2.InstanceLoad:
    """Instance.GetLoad of an engine instance (either tier)."""
    with grpc.insecure_channel(address) as channel:
        return common_pb2_grpc.InstanceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10)


def wait_all_blocks_free(cluster, timeout_s: float = 30) -> dict[str, common_pb2.InstanceLoad]:
    """Poll every engine instance until its pool is entirely free; return the last loads seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {name: load(addr) for name, addr in cluster.addresses.items()}
        if all(l.num_free_blocks == l.num_blocks for l in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)
