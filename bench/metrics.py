"""Benchmark metrics from per-request timings, with the definitions of ``vllm bench serve``.

Per successful request (all times client side):

- TTFT: request sent -> first content chunk;
- ITL: every gap between consecutive content chunks (pooled over requests);
- E2EL: request sent -> last content chunk;
- TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, only for requests with more
  than one output token (goodput counts a one-token request's TPOT as 0).

Throughputs divide by the benchmark's wall-clock duration: completed requests,
output tokens (from ``usage``) and input + output tokens. The peak output rate
and peak concurrency use one-second buckets from the first send, as vLLM's;
vLLM counts one token per content chunk, we spread each request's tokens
over its chunks (the same when every chunk holds one token, right when a
server packs several). Statistics of an empty list are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.client import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
MS = 1000.0


@dataclass
class Summary:
    """Mean, median, std and chosen percentiles of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Summary:
        values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * MS
        return cls(
            mean=float(np.mean(values)),
            median=float(np.median(values)),
            std=float(np.std(values)),
            percentiles=[(float(p), float(np.percentile(values, p))) for p in percentiles],
        )


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: dict[str, Summary] = field(default_factory=dict)  # "ttft", "tpot", "itl", "e2el"
    output_lens: list[int] = field(default_factory=list)  # per request, 0 for failed ones
    tpots: list[float] = field(default_factory=list)  # per request in seconds, 0 when undefined


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the limit must not be negative")
    return slos


def output_len(result: RequestResult, count_tokens: Callable[[str], int] | None = None) -> int:
    """Output tokens of a successful request: usage, else the tokenizer, else one per content chunk."""
    if result.output_tokens is not None:
        return result.output_tokens
    if count_tokens is not None:
        return count_tokens(result.generated_text)
    return len(result.itl) + 1


def request_tpot(result: RequestResult, num_tokens: int) -> float:
    """Time per output token after the first (0 when there is at most one token)."""
    return (result.latency - result.ttft) / (num_tokens - 1) if num_tokens > 1 else 0.0


def per_second_activity(
    outputs: Sequence[RequestResult], output_lens: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens received, and requests in flight, in each second since the first send.

    Only successful requests count. Each content chunk brings its request's
    output tokens divided by its number of chunks (one per chunk without
    ``output_lens``), so a server that packs several tokens into a chunk is
    not undercounted. A request is in flight in every bucket from the one it
    was sent in to the one its last chunk arrived in.
    """
    lens = list(output_lens) if output_lens is not None else [None] * len(outputs)
    done = [(o, n) for o, n in zip(outputs, lens) if o.success]
    if not done:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    t0 = min(o.start_time for o, _ in done)
    end = max(o.start_time + o.latency for o, _ in done)
    buckets = int(math.ceil(end - t0)) + 1
    tokens = np.zeros(buckets)
    in_flight = np.zeros(buckets, dtype=np.int64)
    for o, n in done:
        chunk_times = o.start_time + o.ttft + np.concatenate(([0.0], np.cumsum(o.itl)))
        idx = (chunk_times - t0).astype(np.int64)
        per_chunk = 1.0 if n is None else n / len(chunk_times)
        np.add.at(tokens, idx[(idx >= 0) & (idx < buckets)], per_chunk)
        first, last = int(o.start_time - t0), int(o.start_time + o.latency - t0)
        in_flight[first : last + 1] += 1
    return tokens, in_flight


def calculate_metrics(
    outputs: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> BenchmarkMetrics:
    """All the benchmark's metrics from its requests' results and its duration in seconds."""
    output_lens: list[int] = []
    ttfts: list[float] = []
    e2els: list[float] = []
    itls: list[float] = []
    tpots: list[float] = []  # requests with more than one token
    all_tpots: list[float] = []  # every completed request, for goodput
    total_input = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = output_len(o, count_tokens)
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = request_tpot(o, n)
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2els.append(o.latency)
    completed = len(ttfts)
    total_output = sum(output_lens)

    request_goodput = None
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        limits = [(per_metric[name], slo / MS) for name, slo in goodput.items()]
        good = sum(all(values[i] <= slo for values, slo in limits) for i in range(completed))
        request_goodput = good / duration

    tokens_per_s, in_flight = per_second_activity(outputs, output_lens)
    per_request_tpots = [request_tpot(o, n) if o.success else 0.0 for o, n in zip(outputs, output_lens)]
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration,
        request_goodput=request_goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=float(tokens_per_s.max()) if tokens_per_s.size else 0.0,
        max_concurrent_requests=int(in_flight.max()) if in_flight.size else 0,
        latency={
            "ttft": Summary.of(ttfts, percentiles),
            "tpot": Summary.of(tpots, percentiles),
            "itl": Summary.of(itls, percentiles),
            "e2el": Summary.of(e2els, percentiles),
        },
        output_lens=output_lens,
        tpots=per_request_tpots,
    )
