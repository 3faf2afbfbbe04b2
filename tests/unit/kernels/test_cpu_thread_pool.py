"""The CPU kernels' thread pool (kernels/cpu/thread_pool.cpp): with helper threads the GEMM and attention kernels give
bitwise the same output as on one thread (every output element is computed by one task, whoever claims it), over
thousands of back-to-back calls (helpers spinning, sleeping and waking), while another process keeps a core busy,
and after the pool shrinks and grows."""
import subprocess
import sys

import pytest
import torch

from tandem.kernels import cpu_attention, cpu_ext, cpu_qgemm
from tests.unit.kernels.test_cpu_attention_kernel import make

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernels need AVX2 and a C++ compiler")


@pytest.fixture
def pool():
    yield cpu_ext.extension()
    cpu_ext.set_num_threads(1)


def gemm_cases():
    gen = torch.Generator().manual_seed(0)
    cases = []
    for m, n, k in ((1, 960, 576), (3, 100, 64), (32, 1536, 576), (1, 5, 32)):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = torch.rand(n, k // 32, generator=gen) * 0.01
        cases.append((torch.randn(m, k, generator=gen), q, scales))
    return cases


def run_all(cases, attention_args):
    outs = [cpu_qgemm.int8_gemm(x, q, s, 32) for x, q, s in cases]
    return outs + [cpu_attention.paged_decode_attention(*attention_args, 0.125)]


def test_helpers_give_bitwise_the_same_output(pool):
    cases, attention_args = gemm_cases(), make([1, 17, 300, 64], 9, 3, 64)
    cpu_ext.set_num_threads(1)
    expected = run_all(cases, attention_args)
    for threads in (2, 3, 2):  # grow, then shrink
        cpu_ext.set_num_threads(threads)
        assert pool.get_num_threads() == threads
        for _ in range(300):
            assert all(torch.equal(a, b) for a, b in zip(run_all(cases, attention_args), expected))


def test_a_busy_neighbour_core_does_not_change_the_output(pool):
    cases, attention_args = gemm_cases(), make([5, 40], 4, 4, 32)
    cpu_ext.set_num_threads(1)
    expected = run_all(cases, attention_args)
    cpu_ext.set_num_threads(2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(200):
            assert all(torch.equal(a, b) for a, b in zip(run_all(cases, attention_args), expected))
    finally:
        busy.kill()
        busy.wait()
