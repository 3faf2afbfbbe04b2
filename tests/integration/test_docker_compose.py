"""The docker-compose deployment for real (TANDEM_TEST_DOCKER=1; needs a running Docker engine and compose): the
image built offline by deploy/docker/build.sh, the cluster on the host's network (deploy/docker/compose.host-network.yml,
loopback only) with two prefills and two decodes, greedy answers through the gateway equal to HF transformers',
and scaling each tier down and up again while registrations follow and requests succeed."""
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.launcher import free_port
from tandem.shared.cluster_state.registry import KEY_PREFIX
from tests.integration.conftest import NUM_REFERENCE_TOKENS
from tests.integration.helpers import generate_all, greedy_request
from tests.prompts import PROMPTS

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("TANDEM_IMAGE", "tandem:latest")
BUILD_TIMEOUT_S, READY_TIMEOUT_S = 2400, 900


def compose_command() -> list[str]:
    """`docker compose` (v2 plugin) where it exists, else docker-compose (v1, Debian's package)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor docker-compose is installed")


class Compose:
    def __init__(self):
        self.redis_port, self.gateway_port, self.http_port = free_port(), free_port(), free_port()
        self.project = f"tandem-test-{os.getpid()}"
        self.env = dict(os.environ, COMPOSE_PROJECT_NAME=self.project, TANDEM_IMAGE=IMAGE, REDIS_IMAGE=IMAGE,
                        REDIS_PORT=str(self.redis_port), GATEWAY_PORT=str(self.gateway_port),
                        HTTP_PORT=str(self.http_port), TANDEM_THREADS="1",
                        TANDEM_QUANTIZATION="none")  # (the fp32 weights HF's references are computed on)  # fmt: skip
        self.base = compose_command() + ["-f", "docker-compose.yml", "-f", "deploy/docker/compose.host-network.yml"]
        self.gateway = f"127.0.0.1:{self.gateway_port}"

    def run(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run(self.base + list(args), cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        assert proc.returncode == 0, f"compose {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def scale(self, prefill: int, decode: int) -> None:
        self.run("up", "-d", "--no-build", "--no-recreate", "--scale", f"prefill={prefill}", "--scale",
                 f"decode={decode}")  # fmt: skip

    def registered(self) -> dict[str, int]:
        client = redis.Redis(port=self.redis_port)
        try:
            return {tier: len(client.keys(f"{KEY_PREFIX}:{tier}:*")) for tier in ("prefill", "decode")}
        finally:
            client.close()

    def health(self) -> dict[str, str]:
        """{container name: its Docker health status} (the image's HEALTHCHECK: gRPC health on its own port)."""
        ids = self.run("ps", "-q").split()
        out = subprocess.run(["docker", "inspect", "--format", "{{.Name}} {{if .State.Health}}{{.State.Health.Status}}"
                              "{{else}}none{{end}}", *ids], capture_output=True, text=True, check=True).stdout
        return dict(line.lstrip("/").split() for line in out.splitlines())

    def wait_until(self, prefill: int, decode: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until exactly this many instances of each tier are registered, every container is healthy, and the
        gateway is SERVING."""
        deadline, seen = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                seen = (self.registered(), self.health())
                if seen[0] == {"prefill": prefill, "decode": decode} and set(seen[1].values()) == {"healthy"} \
                        and len(seen[1]) == 2 + prefill + decode and self.gateway_serving():  # fmt: skip
                    return
            except (redis.RedisError, grpc.RpcError):
                pass
            time.sleep(2)
        raise TimeoutError(f"not {prefill} prefill + {decode} decode ready in {timeout_s:.0f}s; last seen {seen}\n"
                           + self.run("logs", "--tail", "20"))  # fmt: skip

    def gateway_serving(self) -> bool:
        with grpc.insecure_channel(self.gateway) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def image():
    subprocess.run(["deploy/docker/build.sh", IMAGE], cwd=ROOT, check=True, timeout=BUILD_TIMEOUT_S)
    return IMAGE


@pytest.fixture(scope="module")
def compose(image, hf_references):
    c = Compose()
    try:
        c.scale(prefill=2, decode=2)
        c.wait_until(prefill=2, decode=2)
        yield c
    finally:
        try:
            print(c.run("logs", "--tail", "5"))
        finally:
            c.run("down", "-v", "--timeout", "60", timeout=300)


def check_against_hf(address: str, hf_references) -> None:
    requests = [greedy_request(kind, text, NUM_REFERENCE_TOKENS) for _, kind, text in PROMPTS]
    for (name, _, _), out in zip(PROMPTS, generate_all(address, requests)):
        assert out.token_ids == hf_references[name][1], f"{name}: diverged from HF transformers"
        assert out.prompt_tokens == len(hf_references[name][0])


def test_cpu_kernels_built_into_image(image):
    """The C++ CPU kernels load in a container without a compiler run: the extension's file is the image's own."""
    script = ("import glob, os, tandem.kernels.cpu_ext as c; so = glob.glob('/opt/torch_extensions/*/*.so'); "
              "before = [os.stat(p).st_mtime for p in so]; assert c.available(); "
              "assert so and [os.stat(p).st_mtime for p in so] == before, so; print('loaded', so)")  # fmt: skip
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", image, "python", "-c", script],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "loaded" in out.stdout


def test_compose_cluster_serves_and_scales(compose, hf_references):
    check_against_hf(compose.gateway, hf_references)

    # Scale decode down while requests are in flight: the stopped replica drains them (SIGTERM) and deregisters.
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(check_against_hf, compose.gateway, hf_references)
        time.sleep(2)
        compose.scale(prefill=2, decode=1)
        in_flight.result(timeout=600)
    compose.wait_until(prefill=2, decode=1)
    check_against_hf(compose.gateway, hf_references)

    compose.scale(prefill=1, decode=1)
    compose.wait_until(prefill=1, decode=1)
    check_against_hf(compose.gateway, hf_references)

    compose.scale(prefill=2, decode=2)
    compose.wait_until(prefill=2, decode=2)
    check_against_hf(compose.gateway, hf_references)
