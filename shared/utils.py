"""Small arithmetic the engine repeats."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b: how many b-sized pieces hold a items."""
    return -(-a // b)
