"""Every environment variable tandem reads, in one place (as vLLM's envs.py and mini-sglang's env module).

A leaf module: standard library only, so the client CLI can import it without torch. Values are read when an
attribute is first looked up each time (``envs.REDIS_URL``), so a variable set before a call is seen; a module
that must read one only once (shared/device.py) copies it at import.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def _str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


def _cache_dir() -> Path:
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


# name -> (how it is read, what it means)
_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "TANDEM_MODEL": (_str("TANDEM_MODEL"), "HF model directory (default: the converted SmolLM2)"),
    "TANDEM_QUANTIZATION": (_str("TANDEM_QUANTIZATION"), "quantized checkpoint every tier loads"),
    "TANDEM_CACHE": (_cache_dir, "cache dir for converted models; else $XDG_CACHE_HOME/tandem, ~/.cache/tandem"),
    "REDIS_URL": (_str("REDIS_URL"), "Redis holding the instance registry"),
    "REDIS_SERVER": (_str("REDIS_SERVER"), "redis-server binary `tandem up` starts when REDIS_URL is unset"),
    "TANDEM_ADVERTISE_HOST": (_str("TANDEM_ADVERTISE_HOST"), "host other services use to reach an engine"),
    "TANDEM_THREADS": (lambda: int(os.environ.get("TANDEM_THREADS") or 1), "torch threads per engine process"),
    "TANDEM_GATEWAY": (lambda: os.environ.get("TANDEM_GATEWAY") or "127.0.0.1:50051", "gateway of the client CLI"),
    "TANDEM_CPU_ARCH": (_str("TANDEM_CPU_ARCH"), "-march of the C++ CPU kernels' build (default native; read by "
                        "kernels/cpu_ext.py)"),
    "TANDEM_TRITON_ON_CPU": (lambda: os.environ.get("TANDEM_TRITON_ON_CPU") == "1",
                             "1: CPU tensors go through the Triton kernels (with TRITON_INTERPRET=1)"),
    "TANDEM_LOG_FORMAT": (lambda: os.environ.get("TANDEM_LOG_FORMAT") or "text",
                          "log lines of every service: text, or json (one object per line)"),
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": (_str("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                                           "OTLP/gRPC endpoint services send traces to; unset (and no "
                                           "OTEL_EXPORTER_OTLP_ENDPOINT): no tracing"),
    "OTEL_EXPORTER_OTLP_ENDPOINT": (_str("OTEL_EXPORTER_OTLP_ENDPOINT"),
                                    "OTLP/gRPC endpoint for traces when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is unset"),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARIABLES)


def describe() -> dict[str, str]:
    """{variable: what it means}, for --help texts and docs."""
    return {name: doc for name, (_, doc) in _VARIABLES.items()}
