"""Builds and loads the C++ CPU kernels (kernels/cpu/*.cpp: quantized and dense GEMMs, paged decode attention,
the elementwise layer ops, the batched LoRA delta, a model's decoder layers as one call) as one torch extension;
kernels/cpu_qgemm.py, kernels/cpu_dense.py, kernels/cpu_attention.py, kernels/cpu_layer_ops.py, kernels/cpu_lora.py
and shared/decoder_stack.py wrap them.

The extension is compiled once with torch.utils.cpp_extension (gcc, ninja; about a minute) into torch's extension
cache ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) for -march=$TANDEM_CPU_ARCH (default native:
AVX-512 where the CPU has it; an image built for other machines sets x86-64-v3, i.e. AVX2 + FMA);
`python -m tandem.kernels.cpu_ext` builds it ahead of time (`make setup` does). Without AVX2/FMA or a compiler,
available() is False and callers use torch ops.
Torch only: nothing here imports triton or shared/.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "cpu" / name for name in ("qgemm.cpp", "qgemm_vnni.cpp", "dense_gemm.cpp",
                                                               "dense_gemm_packed.cpp", "attention.cpp",
                                                               "prefill_attention.cpp", "layer_ops.cpp", "lora.cpp",
                                                               "decoder_stack.cpp", "thread_pool.cpp", "module.cpp")]
HEADERS = [Path(__file__).parent / "cpu" / name for name in ("simd.h", "thread_pool.h", "ops.h")]
log = logging.getLogger(__name__)
STALE_LOCK_S = 600.0  # a build lock older than this was left by a killed build


@functools.cache
def extension():
    """The compiled module, or None when this CPU or machine cannot build or run it (the reason is logged)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("CPU kernels disabled: this CPU has no AVX2")
        return None
    from torch.utils.cpp_extension import _get_build_directory, load

    # torch runs `ninja` from PATH: the one pip installed beside this interpreter (a venv's bin/) when the venv
    # is not activated (a service started as /venv/bin/python)
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    try:
        # NOTE: read here, not through shared.envs (kernels import nothing from shared); listed there.
        arch = os.environ.get("TANDEM_CPU_ARCH") or "native"
        # headers are not sources ninja tracks: their digest in the name rebuilds when they change; so does the
        # checkout's path, so that two checkouts on one machine never rebuild over each other's build
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS) + str(SOURCES[0].parent).encode()).hexdigest()[:8]
        name = f"tandem_cpu_kernels_{arch.replace('-', '_')}_{digest}"
        _remove_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock")
        return load(name=name, sources=[str(s) for s in SOURCES],
                    # (no contraction of a * b + c into FMA unless written so: layer_ops rounds as torch does)
                    extra_cflags=["-O3", f"-march={arch}", "-ffp-contract=off"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: serve with the torch path
        log.warning("CPU kernels disabled: building %s failed: %s", ", ".join(s.name for s in SOURCES), e)
        return None


def _remove_stale_lock(lock: Path) -> None:
    """torch waits forever on a build's lock file; one left by a build that was killed (a service stopped while it
    compiled) would hang every later start. A build takes minutes: a lock older than STALE_LOCK_S is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale CPU-kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


def set_num_threads(num_threads: int) -> None:
    """Threads the GEMM and attention kernels use, the caller's included (kernels/cpu/thread_pool.h: helpers that
    claim work from a shared counter, so a descheduled one never stalls the caller). torch's own thread count is
    separate. No effect when the kernels are not available."""
    if available():
        extension().set_num_threads(max(1, num_threads))


def num_threads() -> int:
    """Threads the GEMM and attention kernels use now (1 when the kernels are not available)."""
    return extension().get_num_threads() if available() else 1


def available() -> bool:
    """True when the kernels are built (building them on first call) and this CPU can run them."""
    return extension() is not None


if __name__ == "__main__":  # build ahead of time: `python -m tandem.kernels.cpu_ext`
    logging.basicConfig(level=logging.INFO)
    print("CPU kernels:", "built" if available() else "not available (see the warning above)")
