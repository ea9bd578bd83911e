"""bench.arrival: the gamma arrival process has the requested mean rate, from a fixed seed."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from bench.arrival import arrival_offsets, paced

N = 20_001  # 20,000 gaps: the sample mean is within about 1% of the true mean (CV 1 / sqrt(N))


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(rate: float, burstiness: float) -> None:
    offsets = arrival_offsets(N, rate, burstiness, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert (N - 1) / offsets[-1] == pytest.approx(rate, rel=0.03)  # achieved rate over the run
    # Burstiness is the gamma shape: the gaps' coefficient of variation is 1 / sqrt(shape).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    a = arrival_offsets(100, 2.0, 1.0, seed=7)
    assert np.array_equal(a, arrival_offsets(100, 2.0, 1.0, seed=7))
    assert not np.array_equal(a, arrival_offsets(100, 2.0, 1.0, seed=8))


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5
    assert arrival_offsets(0, 1.0).size == 0


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0.0)


def test_paced_yields_every_item_in_order() -> None:
    async def collect() -> list[str]:
        return [item async for item in paced(["a", "b", "c"], np.array([0.0, 0.0, 0.001]))]

    assert asyncio.run(collect()) == ["a", "b", "c"]
