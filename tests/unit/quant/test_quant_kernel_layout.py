"""The layers' canonical tensors feed kernels/quant_gemm.py (the CUDA path) unchanged, including the padded K of
a group size that does not divide K. Runs the Triton kernels on CPU through the interpreter in a subprocess,
because TRITON_INTERPRET is only read when triton is first imported."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import torch
import torch.nn.functional as F
from tandem.kernels.quant_gemm import w4a16_gemm, w8a16_gemm
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear

torch.manual_seed(0)
for k, group_size in ((128, 32), (96, 64)):  # 96 / 64: K padded to 128
    linear = torch.nn.Linear(k, 48, bias=False)
    layer = WeightOnlyInt4Linear.from_float(linear, group_size)
    x = torch.randn(5, k)
    x_pad = F.pad(x, (0, layer.padded_in_features - k))
    y = w4a16_gemm(x_pad, layer.qweight, layer.scales, layer.zeros, group_size)
    assert torch.allclose(y, layer(x), atol=1e-3, rtol=1e-3), (y - layer(x)).abs().max()
    int8 = WeightOnlyInt8Linear.from_float(linear)
    y = w8a16_gemm(x, int8.qweight, int8.scales)
    assert torch.allclose(y, int8(x), atol=1e-3, rtol=1e-3), (y - int8(x)).abs().max()
print("ok")
"""


@pytest.mark.skipif(not (REPO / "kernels" / "quant_gemm.py").exists(), reason="kernels/quant_gemm.py not present")
def test_canonical_layout_matches_the_triton_kernels():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + SCRIPT],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
