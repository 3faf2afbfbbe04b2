"""Container health check: grpc.health.v1 Check on the ports the service (PID 1) listens on; exit 0 when one says
SERVING. The port is found, not configured, so engines started with --port 0 (any free port) are checked too.

With TLS (the service's --tls-cert-file / $TANDEM_TLS_CERT_FILE, read from its command line, else this
environment), the check speaks TLS: it trusts --tls-ca-file, presents the service's own certificate (mutual TLS),
and expects the name --tls-server-name, else the first DNS name of the service's certificate (the check dials
127.0.0.1, which a real certificate seldom holds). Usage: healthcheck.py [PID]."""
import os
import ssl
import sys

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

TLS_SETTINGS = ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_server_name")


def tls_settings(cmdline: list[str]) -> dict[str, str]:
    """The service's TLS settings: its flags (--tls-cert-file X or --tls-cert-file=X), else TANDEM_TLS_*."""
    found = {name: os.environ[f"TANDEM_{name.upper()}"] for name in TLS_SETTINGS
             if os.environ.get(f"TANDEM_{name.upper()}")}  # fmt: skip
    for i, token in enumerate(cmdline):
        flag, eq, value = token.partition("=")
        name = flag.removeprefix("--").replace("-", "_")
        if name in TLS_SETTINGS:
            found[name] = value if eq else (cmdline[i + 1] if i + 1 < len(cmdline) else "")
    return found


def channel(port: int, tls: dict[str, str]) -> grpc.Channel:
    if not tls.get("tls_cert_file"):
        return grpc.insecure_channel(f"127.0.0.1:{port}")

    def read(name):
        return open(tls[name], "rb").read() if tls.get(name) else None

    name = tls.get("tls_server_name") or next((value for kind, value in ssl._ssl._test_decode_cert(
        tls["tls_cert_file"]).get("subjectAltName", ()) if kind == "DNS"), None)  # fmt: skip
    credentials = grpc.ssl_channel_credentials(read("tls_ca_file"), read("tls_key_file"), read("tls_cert_file"))
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options)


def main(pid: int = 1) -> None:
    process = psutil.Process(pid)
    tls = tls_settings(process.cmdline())
    ports = sorted({c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN})
    for port in ports:
        try:
            with channel(port, tls) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                sys.exit(0)
        except grpc.RpcError:
            pass
    sys.exit(f"no port of {ports} answers SERVING")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
