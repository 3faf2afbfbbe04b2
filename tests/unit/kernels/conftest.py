"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

NOTE: TRITON_INTERPRET is read when triton is imported, so it is set here, before any test module imports
triton or kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Block ids above 2**21 make block_id * block_stride exceed 2**31 elements for a [16, 1, 64] block, so int32
# offset arithmetic in a kernel would wrap. The cache is allocated with torch.empty (virtual memory only) and
# only the blocks in use are touched.
LARGE_NUM_BLOCKS = 2**21 + 64

TOLERANCES = {  # (atol, rtol) against the fp32-math references
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture
def make_paged_kv():
    """Factory: random key/value caches and block tables for sequences of the given context lengths."""

    def make(context_lens, block_size, num_kv_heads, head_dim, dtype=torch.float32, large_block_ids=False,
             seed=0):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [max(1, -(-n // block_size)) for n in context_lens]
        max_blocks = max(blocks_per_seq) + 1  # one spare column, never read
        total = sum(blocks_per_seq)
        shape = (block_size, num_kv_heads, head_dim)
        if large_block_ids:
            key_cache = torch.empty(LARGE_NUM_BLOCKS, *shape, dtype=dtype)
            value_cache = torch.empty(LARGE_NUM_BLOCKS, *shape, dtype=dtype)
            ids = LARGE_NUM_BLOCKS - 1 - torch.randperm(total, generator=gen)
            key_cache[ids] = torch.randn(total, *shape, generator=gen).to(dtype)
            value_cache[ids] = torch.randn(total, *shape, generator=gen).to(dtype)
        else:
            num_blocks = total + 3
            key_cache = torch.randn(num_blocks, *shape, generator=gen).to(dtype)
            value_cache = torch.randn(num_blocks, *shape, generator=gen).to(dtype)
            ids = torch.randperm(num_blocks, generator=gen)[:total]
        block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks_per_seq):
            block_tables[i, :n] = ids[start:start + n].int()
            start += n
        return key_cache, value_cache, block_tables

    return make


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture
def close():
    """assert_close with the per-dtype tolerances above."""
    return assert_close
