"""Security on a real cluster (docs/security.md): mutual TLS on every internal hop (gateway -> prefill -> decode,
gateway -> decode), TLS and an API key on the gateway's gRPC and HTTP APIs, and a Redis with a password. The
certificates come from trustme (one CA; the services share one certificate for 127.0.0.1, as `tandem up
--tls-*` gives them). Greedy answers are checked against HF transformers fp32."""
import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.client import Client, generate
from tandem.services.security import TLSConfig, open_channel
from tandem.v1 import common_pb2, common_pb2_grpc
from tests.integration.helpers import RedisServer, greedy_request
from tests.prompts import PROMPTS

trustme = pytest.importorskip("trustme")
REPO = Path(__file__).resolve().parents[2]
API_KEY, PASSWORD = "sk-test-0123456789", "redis-pa55word"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """{file name: path}: ca.pem, a certificate it signed for 127.0.0.1 (service.pem/.key, also the clients'),
    and one of another CA (rogue.pem/.key, other-ca.pem)."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    other.cert_pem.write_to_path(d / "other-ca.pem")
    for name, issuer in (("service", ca), ("rogue", other)):
        cert = issuer.issue_cert("127.0.0.1", "localhost")
        cert.cert_chain_pems[0].write_to_path(d / f"{name}.pem")
        cert.private_key_pem.write_to_path(d / f"{name}.key")
    return {p.name: str(p) for p in d.iterdir()}


@pytest.fixture(scope="module")
def redis_with_password():
    server = RedisServer(password=PASSWORD)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(model_dir, hf_references, pki, redis_with_password):
    from tandem.services.launcher import LocalCluster

    engine = ["--num-blocks", "256", "--threads", "1"]
    tls = TLSConfig(pki["service.pem"], pki["service.key"], pki["ca.pem"])
    # --local-prefill-tokens 0: every prompt goes through the prefill, so the prefill -> decode hop carries KV
    with LocalCluster(str(model_dir), prefill_args=engine, decode_args=engine, redis_url=redis_with_password.url,
                      gateway_args=["--local-prefill-tokens", "0"], tls=tls, api_keys=(API_KEY,)) as c:
        yield c


def client_tls(pki, name: str | None = None, ca: str = "ca.pem") -> TLSConfig:
    """A client's TLS: trusting ca, presenting name's certificate (None: no client certificate)."""
    return TLSConfig(pki.get(f"{name}.pem"), pki.get(f"{name}.key"), pki[ca])


def health(address: str, tls: TLSConfig | None) -> str:
    """The health status name, or the status code's name of the failed call."""
    try:
        with open_channel(address, tls, aio=False) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as e:
        return e.code().name


def test_greedy_answers_over_mutual_tls_equal_hf(cluster, pki, hf_references):
    for name, kind, text in PROMPTS[:1] + [p for p in PROMPTS if p[0] == "raw_story"]:
        out = generate(cluster.gateway_address, greedy_request(kind, text, MAX_TOKENS), timeout=300,
                       tls=client_tls(pki), api_key=API_KEY)  # fmt: skip
        assert out.token_ids == hf_references[name][1][:MAX_TOKENS], name
    with open_channel(cluster.addresses["prefill0"], client_tls(pki, "service"), aio=False) as channel:
        load = common_pb2_grpc.InstanceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    assert load.num_prompt_tokens > 0  # (the prompts went gateway -> prefill -> decode, every hop mutual TLS)


@pytest.mark.parametrize("tier", ["prefill0", "decode0"])
def test_an_internal_service_admits_only_peers_with_a_certificate_of_its_ca(cluster, pki, tier):
    address = cluster.addresses[tier]
    assert health(address, client_tls(pki, "service")) == "SERVING"
    assert health(address, client_tls(pki)) == "UNAVAILABLE"  # TLS, but no client certificate
    assert health(address, client_tls(pki, "rogue")) == "UNAVAILABLE"  # a certificate of another CA
    assert health(address, None) == "UNAVAILABLE"  # plaintext


def test_the_gateway_speaks_only_tls_and_trusts_no_other_ca(cluster, pki):
    assert health(cluster.gateway_address, client_tls(pki)) == "SERVING"  # (no key, no client certificate)
    assert health(cluster.gateway_address, None) == "UNAVAILABLE"
    assert health(cluster.gateway_address, client_tls(pki, ca="other-ca.pem")) == "UNAVAILABLE"
    with Client(cluster.gateway_address, api_key=API_KEY) as client, pytest.raises(grpc.RpcError) as error:
        client.generate("Hello", max_tokens=2)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("key, message", [(None, "missing API key"), ("sk-wrong", "invalid API key")])
def test_grpc_without_the_api_key_is_unauthenticated(cluster, pki, key, message):
    with Client(cluster.gateway_address, tls=client_tls(pki), api_key=key) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.generate("Hello", max_tokens=2)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert message in error.value.details() and "--api-key" in error.value.details()
    if key:
        assert key not in error.value.details()


def http(cluster, pki, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=pki["ca.pem"])
    request = urllib.request.Request(f"https://127.0.0.1:{cluster.http_port}{path}",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, context=context, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_http_api_is_https_and_needs_the_key_but_for_health(cluster, pki, hf_references):
    status, body = http(cluster, pki, "/v1/models", None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert "missing API key" in body["error"]["message"]
    status, body = http(cluster, pki, "/v1/models", "sk-wrong")
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert http(cluster, pki, "/health", None) == (200, {"status": "ok"})
    ids, expected = hf_references["raw_story"]
    status, body = http(cluster, pki, "/v1/completions", API_KEY,
                        {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0})  # fmt: skip
    assert status == 200, body
    assert body["choices"][0]["text"] == _decode(cluster, expected[:MAX_TOKENS])
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port: the connection closes (or resets)
        urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/health", timeout=10)


def test_the_lora_adapter_endpoints_need_the_key(cluster, pki):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (docs/lora.md) are guarded as every /v1 path: 401
    without the key; with it, this cluster's engines (no --enable-lora) refuse a load by name, and an unload of a
    name no engine has is a 404."""
    load = {"lora_name": "sql", "lora_path": "/nonexistent"}
    for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        status, reply = http(cluster, pki, path, None, body)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
    status, reply = http(cluster, pki, "/v1/load_lora_adapter", API_KEY, load)
    assert (status, reply["error"]["param"]) == (400, "lora_path") and "--enable-lora" in reply["error"]["message"]
    status, reply = http(cluster, pki, "/v1/unload_lora_adapter", API_KEY, {"lora_name": "sql"})
    assert (status, reply["error"]["param"]) == (404, "lora_name"), reply


def _decode(cluster, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cluster.model).decode(token_ids)


def test_no_secret_reaches_a_log(cluster):
    logs = {path.name: path.read_text(errors="replace") for path in cluster.log_dir.glob("*.log")}
    assert "settings:" in logs["gateway.log"] and "redis://:***@" in logs["gateway.log"]
    assert not [name for name, text in logs.items() if API_KEY in text or PASSWORD in text]


@pytest.mark.parametrize("service", ["decode", "gateway"])
def test_a_wrong_redis_password_stops_a_service_with_a_clear_error(redis_with_password, service, tmp_path):
    url = redis_with_password.url.replace(PASSWORD, "not-the-password")
    env = dict(os.environ, REDIS_URL=url)
    result = subprocess.run([sys.executable, "-m", f"tandem.services.{service}", "--port", "0", "--host", "127.0.0.1",
                             "--metrics-port" if service == "decode" else "--http-port", "0"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --redis-url redis://:***@127.0.0.1:{redis_with_password.port}/0: Redis refused")
    assert "not-the-password" not in result.stdout + result.stderr


def test_rediss_urls_carry_the_password_and_the_ca(redis_with_password, pki):
    """The registry through TLS: rediss:// with ssl_ca_certs in the URL (redis-py's from_url). The redis-server
    at hand is built without TLS, so a TLS terminator (Python's ssl, the service's certificate) fronts it."""
    from tandem.shared.cluster_state.registry import InstanceInfo, Registry

    async def run():
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(pki["service.pem"], pki["service.key"])

        async def relay(reader, writer):
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", redis_with_password.port)

            async def pipe(src, dst):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        terminator = await asyncio.start_server(relay, "127.0.0.1", port, ssl=context)
        try:
            base = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={pki['ca.pem']}"
            registry = Registry(base)
            info = InstanceInfo("decode-tls", "decode", "127.0.0.1:1", "m", 16)
            await registry.publish(info)
            listed = [i.instance_id for i in await registry.list_instances("decode")]
            await registry.remove(info)
            await registry.close()
            untrusted = Registry(base.replace(pki["ca.pem"], pki["other-ca.pem"]))
            with pytest.raises(Exception, match="certificate verify failed"):
                await untrusted.publish(info)
            await untrusted.close()
            return listed
        finally:
            terminator.close()

    assert "decode-tls" in asyncio.run(run())  # (beside the running cluster's instances)


@pytest.mark.parametrize("name", ["decode0", "gateway"])
def test_the_container_health_check_speaks_mutual_tls(cluster, name):
    """deploy/docker/healthcheck.py against a process of the cluster: it reads the TLS flags from the service's
    command line and presents its certificate."""
    result = subprocess.run([sys.executable, "deploy/docker/healthcheck.py", str(cluster.processes[name].pid)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_client_cli_over_tls_with_the_key_from_the_environment(cluster, pki, hf_references):
    name, kind, text = PROMPTS[0]
    env = dict(os.environ, TANDEM_API_KEY=API_KEY)
    result = subprocess.run([sys.executable, "-m", "tandem.services.cli", "generate", "--json", "--gateway",
                             cluster.gateway_address, "--tls-ca-file", pki["ca.pem"], "--max-tokens", str(MAX_TOKENS),
                             "--temperature", "0", text], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["token_ids"] == hf_references[name][1][:MAX_TOKENS]
