"""Container health check: grpc.health.v1 Check on the ports the service (PID 1) listens on; exit 0 when one says
SERVING. The port is found, not configured, so engines started with --port 0 (any free port) are checked too."""
import sys

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

ports = sorted({c.laddr.port for c in psutil.Process(1).net_connections("tcp") if c.status == psutil.CONN_LISTEN})
for port in ports:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            sys.exit(0)
    except grpc.RpcError:
        pass
sys.exit(f"no port of {ports} answers SERVING")
