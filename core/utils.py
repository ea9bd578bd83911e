"""Small arithmetic shared by the scheduler, the KV cache manager and the runner."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers: how many ``b``-sized blocks hold ``a``."""
    return -(-a // b)
