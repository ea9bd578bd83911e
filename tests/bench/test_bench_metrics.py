"""bench.metrics and bench.report on hand-made timings, with hand-computed expectations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.client import RequestResult
from bench.metrics import (
    calculate_metrics,
    output_len,
    parse_goodput,
    per_second_activity,
)
from bench.report import build_result, format_console, format_failures, percentile_key

DURATION = 2.0


def synthetic() -> list[RequestResult]:
    """Four requests (times in seconds); the third failed.

    r0: sent at 0.0, content at 0.10, 0.12, 0.15, 0.20; 4 tokens -> TPOT (0.2-0.1)/3
    r1: sent at 0.5, content at 0.80, 0.90;             2 tokens -> TPOT 0.1/1
    r2: failed
    r3: sent at 1.0, content at 1.20;                   1 token  -> no TPOT (0 for goodput)
    """
    return [
        RequestResult(10, True, 0.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4),
        RequestResult(20, True, 0.5, 0.3, [0.1], 0.4, 2),
        RequestResult(30, False, 0.7, error="HTTP 500: boom"),
        RequestResult(5, True, 1.0, 0.2, [], 0.2, 1),
    ]


def test_totals_and_throughputs() -> None:
    m = calculate_metrics(synthetic(), DURATION)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 35  # the failed request's prompt is not counted
    assert m.total_output == 7
    assert m.output_lens == [4, 2, 0, 1]
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    assert m.request_goodput is None


def test_latency_statistics() -> None:
    m = calculate_metrics(synthetic(), DURATION, percentiles=[50, 90, 99])
    ttft = m.latency["ttft"]  # 100, 300, 200 ms
    assert ttft.mean == pytest.approx(200.0)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(math.sqrt(20000 / 3))
    assert ttft.percentiles == pytest.approx([(50, 200.0), (90, 280.0), (99, 298.0)])
    itl = m.latency["itl"]  # pooled gaps: 20, 30, 50, 100 ms
    assert itl.mean == pytest.approx(50.0)
    assert itl.median == pytest.approx(40.0)
    tpot = m.latency["tpot"]  # only requests with more than one token: 33.3 and 100 ms
    assert tpot.mean == pytest.approx((100 / 3 + 100) / 2)
    assert tpot.percentiles[0] == pytest.approx((50, (100 / 3 + 100) / 2))
    e2el = m.latency["e2el"]  # 200, 400, 200 ms
    assert e2el.mean == pytest.approx(800 / 3)
    assert e2el.median == pytest.approx(200.0)
    assert m.tpots == pytest.approx([0.1 / 3, 0.1, 0.0, 0.0])


def test_goodput_counts_requests_within_every_limit() -> None:
    outputs = synthetic()
    # r0 meets both; r1 misses TTFT; r3 meets TTFT and has TPOT 0.
    m = calculate_metrics(outputs, DURATION, goodput=parse_goodput(["ttft:250", "tpot:50"]))
    assert m.request_goodput == pytest.approx(2 / DURATION)
    m = calculate_metrics(outputs, DURATION, goodput={"tpot": 40.0})  # r1's TPOT is 100 ms
    assert m.request_goodput == pytest.approx(2 / DURATION)
    m = calculate_metrics(outputs, DURATION, goodput={"e2el": 150.0})
    assert m.request_goodput == 0.0
    m = calculate_metrics(outputs, DURATION, goodput={"e2el": 200.0})  # limits are inclusive
    assert m.request_goodput == pytest.approx(2 / DURATION)


def test_peak_tokens_and_concurrency_in_one_second_buckets() -> None:
    tokens, in_flight = per_second_activity(synthetic())
    # chunks at 0.1 0.12 0.15 0.2 0.8 0.9 | 1.2; requests r0, r1 in second 0, r3 in second 1
    assert tokens.tolist() == [6, 1, 0]
    assert in_flight.tolist() == [2, 1, 0]
    m = calculate_metrics(synthetic(), DURATION)
    assert m.max_output_tokens_per_s == 6.0
    assert m.max_concurrent_requests == 2


def test_peak_spreads_a_requests_tokens_over_its_chunks() -> None:
    packed = RequestResult(4, True, 0.0, 0.5, [0.2, 1.0], 1.7, 6)  # 6 tokens in chunks at 0.5, 0.7, 1.7
    tokens, _ = per_second_activity([packed], [6])
    assert tokens.tolist() == [4.0, 2.0, 0.0]
    assert per_second_activity([packed])[0].tolist() == [2.0, 1.0, 0.0]  # vLLM's count: chunks
    assert calculate_metrics([packed], 2.0).max_output_tokens_per_s == 4.0


def test_output_len_falls_back_to_tokenizer_then_chunks() -> None:
    r = RequestResult(3, True, 0.0, 0.1, [0.1, 0.1], 0.3, None, "abcd")
    assert output_len(r, lambda text: len(text)) == 4
    assert output_len(r) == 3


def test_everything_failed_gives_zeros() -> None:
    m = calculate_metrics([RequestResult(4, error="x")], 1.0)
    assert (m.completed, m.failed, m.total_output, m.max_concurrent_requests) == (0, 1, 0, 0)
    assert m.latency["ttft"].mean == 0.0 and m.latency["itl"].percentiles == [(50, 0.0), (90, 0.0), (99, 0.0)]


def test_parse_goodput_rejects_bad_items() -> None:
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_result_keys_are_vllms_and_failures_are_listed() -> None:
    outputs = synthetic()
    m = calculate_metrics(outputs, DURATION, percentiles=[50, 99.9])
    result = build_result(m, outputs, DURATION, ["ttft", "tpot", "itl", "e2el"], {"max_concurrency": 4})
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                "max_output_tokens_per_s", "max_concurrent_requests",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms",
                "mean_e2el_ms", "p99.9_itl_ms", "std_tpot_ms"):
        assert key in result, key
    assert result["start_times"] == pytest.approx([0.0, 0.5, 0.7, 1.0])
    assert result["errors"][2] == "HTTP 500: boom"
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"
    console = format_console(result, ["ttft"], [50, 99.9])
    assert "Failed requests:                         1" in console
    assert "P99.9 TTFT (ms):" in console
    assert format_failures(result["errors"]) == "1 failed requests:\n  x1 [requests 2]: HTTP 500: boom"
    assert np.isfinite(result["std_tpot_ms"])
