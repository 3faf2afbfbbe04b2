"""bf16 comparisons for the kernel tests."""
import torch


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b, elementwise (0: equal; +0 and -0 count as equal)."""
    def ordered(t):  # the bit patterns as integers in the order of the values they encode
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    return (ordered(a) - ordered(b)).abs()
