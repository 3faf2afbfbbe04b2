"""Compile every kernel for an NVIDIA GPU without one: `python -m tandem.kernels.compile_check [ARCH]` (default 90).

The CPU interpreter runs kernels with numpy semantics and misses GPU-only compile errors (tl.dot needs tiles
of at least 16, shared memory limits, type rules). This tool swaps in a stand-in driver that reports a CUDA
target and makes every launch a compile-only warmup, then calls each public wrapper with representative
shapes on CPU tensors: Triton lowers the kernels to PTX and runs the bundled ptxas. Nothing is launched.
Must run without TRITON_INTERPRET. Takes a few minutes on a slow CPU.
"""

import os
import sys
import time

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from tandem.kernels import kv_cache_write, paged_attention, prefill_attention, quant_gemm, rmsnorm

MAX_SHARED_MEM = 232448  # bytes per block on sm_90


class _StandInUtils:
    def get_device_properties(self, device):
        return {"max_shared_mem": MAX_SHARED_MEM, "multiprocessor_count": 132}


class _StandInDriver:
    """Just enough of triton's driver interface to compile for `arch` on a machine without a GPU."""

    def __init__(self, arch: int):
        self.arch = arch
        self.utils = _StandInUtils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _compile_all(dtype: torch.dtype) -> None:
    z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt)  # noqa: E731
    i32 = torch.int32
    cache = z(4, 16, 8, 128)
    kv_cache_write.write_kv_cache(z(3, 8, 128), z(3, 8, 128), cache, cache, z(3, dt=torch.int64))
    tables, lens = z(2, 64, dt=i32), torch.ones(2, dtype=i32)  # 1024-token bound: room for 4 splits
    for queries_per_kv, head_dim, num_splits in [(1, 128, 1), (3, 64, 1), (8, 128, 4)]:
        cache = z(4, 16, 2, head_dim)
        query = z(2, 2 * queries_per_kv, head_dim)
        paged_attention.paged_decode_attention(query, cache, cache, tables, lens, 0.1, num_splits=num_splits)
        starts = torch.tensor([0, 1, 2], dtype=i32)
        prefill_attention.paged_prefill_attention(query, cache, cache, tables, starts, lens, 0.1)
    for M in (1, 64):
        quant_gemm.w8a16_gemm(z(M, 256), z(64, 256, dt=torch.int8), z(64))
        for K, group_size in [(256, 128), (192, 24)]:  # one group per tile; groups change inside a tile
            quant_gemm.w4a16_gemm(z(M, K), z(64, K // 2, dt=torch.uint8), z(64, K // group_size),
                                  z(64, K // group_size), group_size)
    rmsnorm.rms_norm(z(2, 576), z(576), 1e-5, z(2, 576))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("tandem.kernels.compile_check: unset TRITON_INTERPRET; it compiles for the GPU instead of interpreting")
        return 1
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    driver.set_active(_StandInDriver(arch))
    launch = JITFunction.run
    compiled = {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.setdefault(self.__name__, []).append(kernel.metadata.shared)
        return kernel

    JITFunction.run = compile_only
    for module in (kv_cache_write, paged_attention, prefill_attention, quant_gemm, rmsnorm):
        module.check_devices = lambda **tensors: None  # CPU tensors stand in for CUDA ones
    start = time.time()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _compile_all(dtype)
    for name, shared in sorted(compiled.items()):
        print(f"{name:26} {len(shared):3} variants, shared memory up to {max(shared)} bytes")
    print(f"all kernels compiled for sm_{arch} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
