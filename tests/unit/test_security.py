"""services/security.py without a model: TLS and mutual TLS of a real gRPC Server on loopback (certificates from
trustme), the settings that refuse to start, API key checks, and secrets kept out of the settings line."""
import argparse
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.flags import add_engine_service_args, add_gateway_args, settings_line
from tandem.services.security import APIKeys, TLSConfig, open_channel, redacted_url, tls_from_args
from tandem.services.server import Server

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """{name: path}: a CA, certificates it signed (for 127.0.0.1, and for the name tandem-internal), and a
    certificate of another CA."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    other.cert_pem.write_to_path(d / "other-ca.pem")
    for name, issuer, identity in (("ip", ca, "127.0.0.1"), ("named", ca, "tandem-internal"),
                                   ("rogue", other, "127.0.0.1")):  # fmt: skip
        cert = issuer.issue_cert(identity)
        cert.cert_chain_pems[0].write_to_path(d / f"{name}.pem")
        cert.private_key_pem.write_to_path(d / f"{name}.key")
    return {p.name: str(p) for p in d.iterdir()}


def identity(pki, name: str, **kw) -> TLSConfig:
    return TLSConfig(pki[f"{name}.pem"], pki[f"{name}.key"], pki["ca.pem"], **kw)


async def health_check(address: str, tls: TLSConfig | None) -> str:
    """The health status name, or the failing status code's name."""
    try:
        async with open_channel(address, tls) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as e:
        return e.code().name


def probe(server_tls: TLSConfig, clients: dict[str, TLSConfig | None]) -> dict[str, str]:
    async def run():
        server = Server("decode", "decode-test", "127.0.0.1", 0, tls=server_tls)
        await server.start()
        try:
            return {name: await health_check(f"127.0.0.1:{server.port}", tls) for name, tls in clients.items()}
        finally:
            await server.grpc.stop(None)

    return asyncio.run(run())


def test_mutual_tls_admits_only_clients_with_a_certificate_of_its_ca(pki):
    server_tls = identity(pki, "ip", require_client_cert=True)
    results = probe(server_tls, {
        "same CA": identity(pki, "ip"),
        "no client certificate": TLSConfig(ca_file=pki["ca.pem"]),
        "certificate of another CA": TLSConfig(pki["rogue.pem"], pki["rogue.key"], pki["ca.pem"]),
        "plaintext": None,
        "server not trusted": TLSConfig(pki["ip.pem"], pki["ip.key"], pki["other-ca.pem"]),
    })  # fmt: skip
    assert results == {"same CA": "SERVING", "no client certificate": "UNAVAILABLE",
                       "certificate of another CA": "UNAVAILABLE", "plaintext": "UNAVAILABLE",
                       "server not trusted": "UNAVAILABLE"}  # fmt: skip


def test_a_separate_client_ca_admits_public_clients_and_not_internal_certificates(pki):
    """The gateway's --tls-client-ca-file: public clients hold certificates of their own CA (here "other"), which
    the internal services (trusting only ca.pem) refuse; an internal certificate is no public credential either."""
    server_tls = identity(pki, "ip", require_client_cert=True, client_ca_file=pki["other-ca.pem"])
    results = probe(server_tls, {
        "public client (its own CA)": TLSConfig(pki["rogue.pem"], pki["rogue.key"], pki["ca.pem"]),
        "internal certificate": identity(pki, "ip"),
    })  # fmt: skip
    assert results == {"public client (its own CA)": "SERVING", "internal certificate": "UNAVAILABLE"}
    internal = probe(identity(pki, "ip", require_client_cert=True),
                     {"public client": TLSConfig(pki["rogue.pem"], pki["rogue.key"], pki["ca.pem"])})
    assert internal == {"public client": "UNAVAILABLE"}


def test_tls_without_client_certificates_and_the_server_name_override(pki):
    server_tls = identity(pki, "named")  # (a certificate for tandem-internal, dialled as 127.0.0.1)
    results = probe(server_tls, {"no client certificate, name override": TLSConfig(ca_file=pki["ca.pem"],
                                                                                   server_name="tandem-internal"),
                                 "no override": TLSConfig(ca_file=pki["ca.pem"])})  # fmt: skip
    assert results == {"no client certificate, name override": "SERVING", "no override": "UNAVAILABLE"}


def engine_args(argv):
    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, "decode")
    return parser.parse_args(argv)


def gateway_args(argv):
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser.parse_args(argv)


def test_a_ca_makes_an_engine_require_client_certificates_and_the_gateway_only_when_asked(pki):
    files = ["--tls-cert-file", pki["ip.pem"], "--tls-key-file", pki["ip.key"], "--tls-ca-file", pki["ca.pem"]]
    assert tls_from_args(engine_args(files)).require_client_cert
    assert not tls_from_args(gateway_args(files)).require_client_cert
    assert tls_from_args(gateway_args(files + ["--tls-client-auth", "require"])).require_client_cert
    assert tls_from_args(engine_args([])) is None


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert-file", "c.pem"], "--tls-cert-file and --tls-key-file go together"),
    (["--tls-ca-file", "ca.pem"], "--tls-ca-file needs --tls-cert-file"),
    (["--tls-cert-file", "/nonexistent.pem", "--tls-key-file", "/nonexistent.key"],
     "--tls-cert-file /nonexistent.pem: cannot read it"),
])  # fmt: skip
def test_tls_settings_that_cannot_work_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        tls_from_args(engine_args(argv))


def test_client_auth_without_a_ca_is_refused(pki):
    argv = ["--tls-cert-file", pki["ip.pem"], "--tls-key-file", pki["ip.key"], "--tls-client-auth", "require"]
    with pytest.raises(ValueError, match="--tls-client-auth require needs --tls-client-ca-file or --tls-ca-file"):
        tls_from_args(gateway_args(argv))


def test_api_keys_accept_only_a_bearer_of_a_key():
    keys = APIKeys(("k1", "second-key"))
    assert keys.refusal("Bearer k1") is None and keys.refusal("bearer second-key") is None
    assert keys.refusal(None).startswith("missing API key")
    assert keys.refusal("k1").startswith("malformed authorization")
    assert keys.refusal("Bearer k2") == "invalid API key"
    assert keys.refusal("Bearer k1x") == "invalid API key"


def test_keys_come_from_flags_commas_and_the_environment(monkeypatch):
    from tandem.services.flags import apply_env

    monkeypatch.setenv("TANDEM_API_KEY", "env-a,env-b")
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    apply_env(parser, [])
    assert parser.parse_args([]).api_key == ["env-a", "env-b"]
    assert parser.parse_args(["--api-key", "x,y", "--api-key", "z"]).api_key == ["env-a", "env-b", "x", "y", "z"]


def test_the_settings_line_masks_api_keys_and_redis_passwords():
    args = gateway_args(["--api-key", "sk-secret", "--redis-url", "redis://:pa55word@10.0.0.1:6379/0"])
    line = settings_line("gateway g", args)
    assert "sk-secret" not in line and "pa55word" not in line
    assert '"api_key": "***"' in line and "redis://:***@10.0.0.1:6379/0" in line


@pytest.mark.parametrize("url, expected", [
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://user:s3cret@h:6380/0?ssl_ca_certs=/ca.pem", "rediss://user:***@h:6380/0?ssl_ca_certs=/ca.pem"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("http://h:8080/a@b", "http://h:8080/a@b"),
])  # fmt: skip
def test_redacted_url(url, expected):
    assert redacted_url(url) == expected


@pytest.mark.parametrize("path, guarded", [("/v1/embeddings", True), ("/tokenize", True), ("/detokenize", True),
                                           ("/health", False), ("/metrics", False)])
def test_the_http_api_key_guards_v1_tokenize_and_detokenize(path, guarded):
    import asyncio

    from tandem.services.gateway.http_middleware import APIKeyMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(headers) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await APIKeyMiddleware(app, APIKeys(("k1",)))(scope, None, send)
        return sent[0]["status"]

    assert asyncio.run(call([])) == (401 if guarded else 200)
    assert asyncio.run(call([(b"authorization", b"Bearer k1")])) == 200
