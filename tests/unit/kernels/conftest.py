"""Kernel tests: each Triton kernel against its plain-torch *_ref on the same inputs.

By default the kernels run on CPU tensors through the Triton interpreter. With TANDEM_KERNEL_DEVICE=cuda they
run compiled on the GPU instead: every test builds its inputs on the `device` fixture below (usually on CPU
with the seeded generators, then moved, so both modes see the same values) and the interpreter stays off.

    OMP_NUM_THREADS=1 python -m pytest tests/unit/kernels -q                         # CPU, interpreted
    TANDEM_KERNEL_DEVICE=cuda python -m pytest tests/unit/kernels -q                 # GPU, compiled

NOTE: TRITON_INTERPRET is read when triton is imported (triton.jit picks the interpreter then), so it is set
here, before any test module imports triton or kernels.
"""

import os

KERNEL_DEVICE = os.environ.get("TANDEM_KERNEL_DEVICE", "cpu").strip().lower() or "cpu"
if KERNEL_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"TANDEM_KERNEL_DEVICE must be 'cpu' or 'cuda', got {KERNEL_DEVICE!r}")
if KERNEL_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise ValueError("TANDEM_KERNEL_DEVICE=cuda tests the compiled kernels: unset TRITON_INTERPRET")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

DEVICE = torch.device(KERNEL_DEVICE)
CUDA_MISSING = KERNEL_DEVICE == "cuda" and not torch.cuda.is_available()

# Block ids above 2**21 make block_id * block_stride exceed 2**31 elements for a [16, 1, 64] block, so int32
# offset arithmetic in a kernel would wrap. The cache is allocated with torch.empty and only the blocks in use
# are written: on CPU that stays virtual memory; on CUDA it is a real 4 GiB per fp16 cache (8 GiB for a
# key/value pair), freed when the test ends.
LARGE_NUM_BLOCKS = 2**21 + 64

TOLERANCES = {  # (atol, rtol) against the fp32-math references
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture(autouse=True)
def _require_cuda():
    if CUDA_MISSING:
        pytest.skip("TANDEM_KERNEL_DEVICE=cuda but torch.cuda.is_available() is False (no GPU or a CPU-only torch)")


@pytest.fixture
def device() -> torch.device:
    """Where the kernel tests put their tensors: cpu (Triton interpreter, the default) or cuda
    (TANDEM_KERNEL_DEVICE=cuda, compiled kernels)."""
    return DEVICE


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on device with t's exact strides (Tensor.to makes non-dense views such as x[..., ::2] contiguous,
    which would hide the stride the bad-argument tests pass)."""
    if t.device == device:
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


@pytest.fixture
def on_device(device):
    """to_device bound to the `device` fixture: for tensors built at collection time (parametrize values)."""
    return lambda t: to_device(t, device)


@pytest.fixture
def make_paged_kv(device):
    """Factory: random key/value caches and block tables, on `device`, for sequences of the given context
    lengths. The values come from a seeded CPU generator, so they are the same on every device."""

    def make(context_lens, block_size, num_kv_heads, head_dim, dtype=torch.float32, large_block_ids=False,
             seed=0):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [max(1, -(-n // block_size)) for n in context_lens]
        max_blocks = max(blocks_per_seq) + 1  # one spare column, never read
        total = sum(blocks_per_seq)
        shape = (block_size, num_kv_heads, head_dim)
        if large_block_ids:
            key_cache = torch.empty(LARGE_NUM_BLOCKS, *shape, dtype=dtype, device=device)
            value_cache = torch.empty(LARGE_NUM_BLOCKS, *shape, dtype=dtype, device=device)
            ids = LARGE_NUM_BLOCKS - 1 - torch.randperm(total, generator=gen)
            key_cache[ids.to(device)] = torch.randn(total, *shape, generator=gen).to(dtype).to(device)
            value_cache[ids.to(device)] = torch.randn(total, *shape, generator=gen).to(dtype).to(device)
        else:
            num_blocks = total + 3
            key_cache = torch.randn(num_blocks, *shape, generator=gen).to(dtype).to(device)
            value_cache = torch.randn(num_blocks, *shape, generator=gen).to(dtype).to(device)
            ids = torch.randperm(num_blocks, generator=gen)[:total]
        block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks_per_seq):
            block_tables[i, :n] = ids[start:start + n].int()
            start += n
        return key_cache, value_cache, block_tables.to(device)

    return make


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=atol, rtol=rtol)


@pytest.fixture
def close():
    """assert_close with the per-dtype tolerances above."""
    return assert_close


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def kernel_threads(request):
    """The C++ CPU kernels' thread count for one test (1, then 2), restored after it."""
    from tandem.kernels import cpu_ext

    before = cpu_ext.num_threads()
    cpu_ext.set_num_threads(request.param)
    yield request.param
    cpu_ext.set_num_threads(before)
