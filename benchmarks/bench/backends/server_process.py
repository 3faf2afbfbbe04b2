"""A server the benchmark starts itself (llama-server, vLLM): a process group of its own logging to a file, ready
when its health URL answers 200, stopped with its children."""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.benchmarks.bench.backends.sse import get

STOP_TIMEOUT_S = 10  # from SIGTERM to SIGKILL


class ServerProcess:
    def __init__(self, name: str, argv: list[str], health_url: str, log_path: Path, env: dict[str, str] | None = None):
        """argv: the command; health_url: answers 200 once the server serves; env: its whole environment (None:
        this process's)."""
        self.name, self.argv, self.health_url, self.log_path, self.env = name, argv, health_url, log_path, env
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None  # from the start to the first healthy answer

    async def start(self, timeout_s: float) -> None:
        """Start it and wait until it is healthy. RuntimeError if it exits first (its log's last line), TimeoutError
        after timeout_s (it is stopped then)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"{self.name}: starting {shlex.join(self.argv)} (log: {self.log_path})", file=sys.stderr)
        start_s = time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)  # fmt: skip
        while get(self.health_url) is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}: {self._last_line()} "
                                   f"(log: {self.log_path})")  # fmt: skip
            if time.monotonic() - start_s > timeout_s:
                self.stop()
                raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f}s (log: {self.log_path})")
            await asyncio.sleep(0.3)
        self.startup_s = time.monotonic() - start_s
        print(f"{self.name}: healthy after {self.startup_s:.0f}s", file=sys.stderr)

    def stop(self) -> None:
        """SIGTERM its process group (the server and the workers it started), SIGKILL after STOP_TIMEOUT_S."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        try:  # what is left of the group: the server, or workers that outlived it
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def _last_line(self) -> str:
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else "no output"
