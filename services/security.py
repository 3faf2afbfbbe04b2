"""Transport security and client authentication, built from settings (docs/security.md):

- TLSConfig: certificate files -> gRPC server and channel credentials (TLS, and mutual TLS with a CA), the
  same files for uvicorn's HTTPS. One identity per process: its certificate serves its ports and is the client
  certificate it presents on internal hops.
- APIKeys: the gateway's keys; APIKeyInterceptor refuses gRPC calls of the public API without one
  (UNAUTHENTICATED). The HTTP API checks the same keys (services/gateway/http_middleware.py).
- redacted_url / check_redis_auth: Redis URLs carry passwords (redis://:PASSWORD@host); keep them out of logs,
  and refuse to start on a password Redis rejects.

Imports neither torch nor redis at module level (the client CLI imports it).
"""
from __future__ import annotations

import argparse
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.services.grpc_errors import rewrap_handler

PUBLIC_API_PREFIX = "/tandem.v1.Gateway/"  # what an API key guards; health and reflection stay open
CLIENT_AUTH_CHOICES = ("none", "require")
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s/]+@", re.IGNORECASE)


# -- TLS -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TLSConfig:
    """PEM files of one process. A service serves TLS when it has cert_file and key_file; a client given a
    TLSConfig always speaks TLS (trusting the system's roots when ca_file is None)."""

    cert_file: str | None = None  # certificate chain: this process's identity, also its client certificate
    key_file: str | None = None  # its private key
    ca_file: str | None = None  # CA bundle that verifies peers (servers we call; clients when required)
    server_name: str | None = None  # name expected in servers' certificates (default: the address's host)
    require_client_cert: bool = False  # server side: a client without a certificate signed by ca_file is refused
    client_ca_file: str | None = None  # server side: the CA of the clients' certificates instead of ca_file (gateway)

    def _read(self, setting: str) -> bytes | None:
        path = getattr(self, setting)
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"--tls-{setting.replace('_', '-')} {path}: cannot read it ({e.strerror})") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for grpc.Server.add_secure_port. ValueError naming the setting of a file that cannot
        be read."""
        return grpc.ssl_server_credentials([(self._read("key_file"), self._read("cert_file"))],
                                           root_certificates=self._read(self._client_ca) if self.require_client_cert
                                           else None, require_client_auth=self.require_client_cert)  # fmt: skip

    @property
    def _client_ca(self) -> str:
        return "client_ca_file" if self.client_ca_file else "ca_file"

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a channel to a TLS server: ca_file's roots (or the system's), and this process's
        certificate as client certificate when it has one. ValueError naming the setting of an unreadable
        file."""
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca_file"),
                                            private_key=self._read("key_file"),
                                            certificate_chain=self._read("cert_file"))  # fmt: skip

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def uvicorn_settings(self) -> dict:
        """uvicorn.Config's TLS arguments for the HTTP API (a client certificate required as on gRPC)."""
        import ssl

        settings = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.require_client_cert:
            settings |= {"ssl_ca_certs": getattr(self, self._client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return settings

    def argv(self) -> list[str]:
        """The service flags that give a child process these files (LocalCluster)."""
        names = ("cert_file", "key_file", "ca_file", "server_name")
        return [a for n in names if getattr(self, n) for a in (f"--tls-{n.replace('_', '-')}", getattr(self, n))]


def open_channel(address: str, tls: TLSConfig | None, options=(), interceptors=None, aio: bool = True):
    """A grpc.aio (or, aio=False, a sync) channel to address: TLS with tls's credentials, plaintext when None."""
    module = grpc.aio if aio else grpc
    extra = {"interceptors": interceptors} if aio and interceptors else {}
    if tls is None:
        return module.insecure_channel(address, options=list(options), **extra)
    return module.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()],
                                 **extra)  # fmt: skip


def add_tls_args(parser: argparse.ArgumentParser, public: bool = False) -> None:
    """--tls-cert-file, --tls-key-file, --tls-ca-file, --tls-server-name; with public (the gateway),
    --tls-client-auth for its public ports."""
    peers = ("its clients (an engine's: every client, mutual TLS; the gateway's: the clients of its public ports "
             "under --tls-client-auth require)")  # (one text for every service: the settings table shows one)
    parser.add_argument("--tls-cert-file", default=None,
                        help="PEM certificate (chain): serve TLS with it, and present it as the client certificate "
                             "on calls to other services; needs --tls-key-file")  # fmt: skip
    parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    parser.add_argument("--tls-ca-file", default=None,
                        help=f"PEM CA bundle that verifies the services this one calls and {peers}; without it, "
                             "servers are verified against the system's roots")  # fmt: skip
    parser.add_argument("--tls-server-name", default=None,
                        help="name the certificates of the services this one calls must hold (default: the host of "
                             "the address each one registered)")  # fmt: skip
    if public:
        parser.add_argument("--tls-client-auth", choices=CLIENT_AUTH_CHOICES, default="none",
                            help="require: the gRPC and HTTP clients of the gateway must present a certificate "
                                 "signed by --tls-client-ca-file, else --tls-ca-file (none: TLS and API keys only)")
        parser.add_argument("--tls-client-ca-file", default=None,
                            help="PEM CA bundle of the public clients' certificates under --tls-client-auth require: "
                                 "a CA other than --tls-ca-file, whose certificates the prefill and decode services "
                                 "accept (a public client holding one could call them directly)")  # fmt: skip


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The service's TLSConfig from its flags (add_tls_args), None when --tls-cert-file is not set. An engine
    given --tls-ca-file requires client certificates; the gateway does with --tls-client-auth require.
    ValueError naming the flag: a certificate without its key (or the reverse), a TLS setting without a
    certificate, or a file that cannot be read."""
    cert, key = args.tls_cert_file, args.tls_key_file
    client_auth = getattr(args, "tls_client_auth", None)
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together: pass both or neither")
    if cert is None:
        given = [flag for flag, value in (("--tls-ca-file", args.tls_ca_file), ("--tls-server-name",
                 args.tls_server_name), ("--tls-client-auth", client_auth == "require")) if value]  # fmt: skip
        if given:
            raise ValueError(f"{given[0]} needs --tls-cert-file and --tls-key-file (a service serves TLS with them)")
        return None
    client_ca = getattr(args, "tls_client_ca_file", None)
    if client_auth == "require" and not (args.tls_ca_file or client_ca):
        raise ValueError("--tls-client-auth require needs --tls-client-ca-file or --tls-ca-file (the CA client "
                         "certificates are checked against)")  # fmt: skip
    if client_ca and client_auth != "require":
        raise ValueError("--tls-client-ca-file needs --tls-client-auth require")
    require = client_auth == "require" if client_auth is not None else args.tls_ca_file is not None
    tls = TLSConfig(cert, key, args.tls_ca_file, args.tls_server_name, require, client_ca)
    for setting in ("cert_file", "key_file", "ca_file", "client_ca_file"):
        tls._read(setting)  # (an unreadable file stops the start, naming its flag)
    return tls


def add_client_tls_args(parser: argparse.ArgumentParser) -> None:
    """A client's TLS flags (tandem generate / chat), defaulting to the same variables as the services'."""
    from tandem.shared import envs

    parser.add_argument("--tls", action="store_true",
                        help="speak TLS to the gateway (implied by the --tls-* files); trusts the system's roots "
                             "unless --tls-ca-file")  # fmt: skip
    parser.add_argument("--tls-ca-file", default=envs.TANDEM_TLS_CA_FILE,
                        help="PEM CA bundle that verifies the gateway ($TANDEM_TLS_CA_FILE)")
    parser.add_argument("--tls-cert-file", default=envs.TANDEM_TLS_CERT_FILE,
                        help="PEM client certificate, for a gateway with --tls-client-auth require "
                             "($TANDEM_TLS_CERT_FILE)")  # fmt: skip
    parser.add_argument("--tls-key-file", default=envs.TANDEM_TLS_KEY_FILE,
                        help="PEM key of --tls-cert-file ($TANDEM_TLS_KEY_FILE)")
    parser.add_argument("--tls-server-name", default=envs.TANDEM_TLS_SERVER_NAME,
                        help="name the gateway's certificate holds, when not the host of --gateway "
                             "($TANDEM_TLS_SERVER_NAME)")  # fmt: skip


def client_tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """A client's TLSConfig (add_client_tls_args), None for plaintext. ValueError naming the flag: a certificate
    without its key or the reverse, or a file that cannot be read."""
    files = (args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
    if not args.tls and not any(files) and not args.tls_server_name:
        return None
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together: pass both or neither")
    tls = TLSConfig(*files, server_name=args.tls_server_name)
    for setting in ("cert_file", "key_file", "ca_file"):
        tls._read(setting)
    return tls


# -- API keys ------------------------------------------------------------------------------------------------
def api_key_list(value: str) -> list[str]:
    """argparse type: comma-separated keys (empty items dropped)."""
    return [key.strip() for key in value.split(",") if key.strip()]


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", type=api_key_list, action="extend", default=None,
                        help="require this key of every client (gRPC metadata or HTTP header 'authorization: Bearer "
                             "KEY'); repeatable or comma-separated; default: no key needed")  # fmt: skip
    parser.add_argument("--api-key-file", default=None,
                        help="also accept each key in this file (one a line, # comments): for mounted secrets")


def api_keys_from_args(args: argparse.Namespace) -> APIKeys | None:
    """The gateway's APIKeys (--api-key and --api-key-file's lines), None when it has none. ValueError naming
    --api-key-file when it cannot be read or holds no key."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({e.strerror})") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {args.api_key_file}: holds no key")
        keys += from_file
    return APIKeys(tuple(keys)) if keys else None


@dataclass(frozen=True)
class APIKeys:
    keys: tuple[str, ...] = field(repr=False)  # (never in a log line)

    def refusal(self, authorization: str | None) -> str | None:
        """None when the value of an "authorization" header is "Bearer <one of the keys>" (compared in constant
        time); otherwise why it is refused (never echoing what was sent)."""
        if not authorization:
            return "missing API key: send the header (gRPC: metadata) 'authorization: Bearer <key>'"
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "malformed authorization: expected 'Bearer <key>'"
        token_bytes = token.strip().encode()
        matches = [hmac.compare_digest(token_bytes, key.encode()) for key in self.keys]  # (each key, every time)
        return None if any(matches) else "invalid API key"


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of the public API (PUBLIC_API_PREFIX) whose metadata lacks a valid
    "authorization: Bearer <key>" with UNAUTHENTICATED; health and reflection stay open (load balancers and
    grpcurl list probe them without a key)."""

    def __init__(self, keys: APIKeys):
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PUBLIC_API_PREFIX):
            return handler
        metadata = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        refusal = self.keys.refusal(metadata.get("authorization"))
        if refusal is None:
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{refusal} (the gateway's --api-key)")

        async def refuse_stream(request, context):  # (the outer interceptors wrap an async generator)
            await refuse(request, context)
            yield  # NOTE: never reached (abort raises)

        return rewrap_handler(handler, lambda fn: refuse, lambda fn: refuse_stream)


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata that carries api_key (None: none)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


# -- Redis ---------------------------------------------------------------------------------------------------
def redacted_url(text: str) -> str:
    """text with the password of every URL in it replaced by ***: redis://:s3cret@h:6379/0 ->
    redis://:***@h:6379/0."""
    return _URL_PASSWORD.sub(r"\g<head>***@", text)


async def check_redis_auth(url: str) -> None:
    """Ping Redis at url once. ValueError naming --redis-url when Redis refuses the credentials (a wrong or
    missing password): a setting that cannot work. An unreachable Redis is no error here (a service serves
    without it and retries)."""
    import redis.asyncio as aioredis
    from redis.exceptions import AuthenticationError, RedisError

    client = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        await client.ping()
    except (RedisError, OSError) as e:
        if isinstance(e, AuthenticationError) or any(word in str(e) for word in ("NOAUTH", "WRONGPASS")):
            raise ValueError(f"--redis-url {redacted_url(url)}: Redis refused the credentials ({e})") from None
    finally:
        await client.aclose()
