"""When each request is sent: all at once, or a gamma process of a given mean rate.

The gaps between requests are gamma distributed with shape ``burstiness`` and
scale ``1 / (rate * burstiness)``, so their mean is ``1 / rate`` whatever the
burstiness: 1.0 is a Poisson process, below 1 burstier, above 1 more regular
(as ``vllm bench serve``). The schedule is computed up front from the seed, so
it is the same in every run and does not depend on how late the sender runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send time of each of ``n`` requests in seconds after the first (which is at 0)."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if n <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


async def paced(items: Sequence[T], offsets: np.ndarray) -> AsyncIterator[T]:
    """Yield each item once its offset (seconds from the first yield) has come."""
    start = time.perf_counter()
    for item, offset in zip(items, offsets.tolist()):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item
