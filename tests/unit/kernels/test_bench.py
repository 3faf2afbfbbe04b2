"""tandem.kernels.bench: the benchmark cases run (tiny shapes, on the kernel test device) and agree with their
references."""

import subprocess
import sys

import pytest
import torch

from tandem.kernels import bench


@pytest.mark.parametrize("index", range(len(bench.make_cases("cpu", small=True))))
def test_small_case_matches_reference(device, index):
    case = bench.make_cases(device.type, small=True)[index]
    assert case.bytes_moved > 0
    assert bench.max_abs_diff(case.kernel(), case.ref()) < 1e-3, case.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available, so kernels.bench would run the full "
                    "benchmark; this test checks the no-CUDA exit")
def test_exits_cleanly_without_cuda():
    result = subprocess.run([sys.executable, "-m", "tandem.kernels.bench"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device" in result.stdout
