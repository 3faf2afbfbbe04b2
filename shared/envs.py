"""Every environment variable tandem reads, in one place (as vLLM's envs.py and mini-sglang's env module), but
the services' settings: each flag --x-y of a service reads TANDEM_X_Y (REDIS_URL for --redis-url,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT for --otlp-traces-endpoint), converted and checked as the flag
(services/flags.py apply_env; the README's settings table lists them all).

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
    "TANDEM_CACHE": (_cache_dir, "cache dir for converted models; else $XDG_CACHE_HOME/tandem, ~/.cache/tandem"),
    "REDIS_URL": (_str("REDIS_URL"), "Redis holding the instance registry"),
    "REDIS_SERVER": (_str("REDIS_SERVER"), "redis-server binary `tandem up` starts when REDIS_URL is unset"),
    "TANDEM_GATEWAY": (lambda: os.environ.get("TANDEM_GATEWAY") or "127.0.0.1:50051", "gateway of the client CLI"),
    # (the client CLI's security settings: the same names as the gateway's flags, docs/security.md)
    "TANDEM_API_KEY": (lambda: (os.environ.get("TANDEM_API_KEY") or "").split(",")[0].strip() or None,
                       "API key the client CLI sends (the first, when comma-separated)"),
    "TANDEM_TLS_CA_FILE": (_str("TANDEM_TLS_CA_FILE"), "client CLI: CA bundle that verifies the gateway (TLS)"),
    "TANDEM_TLS_CERT_FILE": (_str("TANDEM_TLS_CERT_FILE"), "client CLI: client certificate (TLS)"),
    "TANDEM_TLS_KEY_FILE": (_str("TANDEM_TLS_KEY_FILE"), "client CLI: key of the client certificate"),
    "TANDEM_TLS_SERVER_NAME": (_str("TANDEM_TLS_SERVER_NAME"), "client CLI: name the gateway's certificate holds"),
    "TANDEM_CPU_ARCH": (_str("TANDEM_CPU_ARCH"), "-march of the C++ CPU kernels' build (default native; read by "
                        "kernels/cpu_ext.py)"),
    "TANDEM_TRITON_ON_CPU": (lambda: os.environ.get("TANDEM_TRITON_ON_CPU") == "1",
                             "1: CPU tensors go through the Triton kernels (with TRITON_INTERPRET=1)"),
    "TANDEM_LAUNCHER_PID": (lambda: int(os.environ["TANDEM_LAUNCHER_PID"]) if os.environ.get("TANDEM_LAUNCHER_PID")
                            else None, "set by `tandem up` where it cannot give its children a parent-death "
                            "signal (not Linux): a service exits once that process is no longer its parent"),
    "OTEL_EXPORTER_OTLP_ENDPOINT": (_str("OTEL_EXPORTER_OTLP_ENDPOINT"),
                                    "OTLP/gRPC endpoint for traces when --otlp-traces-endpoint "
                                    "(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is unset"),
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
