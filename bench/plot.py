"""PNG plots of one ``bench serve`` result: latency CDFs, and tokens/s and concurrency over time.

They are drawn from the saved result dict alone, so a JSON from an earlier
run can be plotted again (``python -m bench.plot RESULT.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.client import RequestResult
from bench.metrics import per_second_activity

CDF_PANELS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2EL"))


def requests_of(result: dict[str, Any]) -> list[RequestResult]:
    """The per-request timings stored in a result dict."""
    return [
        RequestResult(prompt_len=n, success=not err, start_time=t, ttft=ttft, itl=list(itl), latency=e2el)
        for n, err, t, ttft, itl, e2el in zip(
            result["input_lens"], result["errors"], result["start_times"],
            result["ttfts"], result["itls"], result["e2els"],
        )
    ]


def _values_ms(result: dict[str, Any], key: str) -> np.ndarray:
    ok = [not e for e in result["errors"]]
    if key == "itls":
        values = [gap for good, gaps in zip(ok, result["itls"]) if good for gap in gaps]
    elif key == "tpots":
        values = [v for good, v, n in zip(ok, result["tpots"], result["output_lens"]) if good and n > 1]
    else:
        values = [v for good, v in zip(ok, result[key]) if good]
    return np.sort(np.asarray(values, dtype=np.float64)) * 1000.0


def save_plots(result: dict[str, Any], prefix: Path) -> list[Path]:
    """Write PREFIX-latency-cdf.png and PREFIX-timeline.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    title = f"{result.get('model_id', '')}  {result.get('label') or ''}".strip()
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, name) in zip(axes.flat, CDF_PANELS):
        values = _values_ms(result, key)
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF ({values.size} samples)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Latency CDFs: {title}")
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "-latency-cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    tokens, in_flight = per_second_activity(requests_of(result), result["output_lens"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    seconds = np.arange(tokens.size)
    ax.step(seconds, tokens, where="post", color="tab:blue", label="output tokens/s")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    twin = ax.twinx()
    twin.step(seconds, in_flight, where="post", color="tab:orange", label="requests in flight")
    twin.set_ylabel("requests in flight", color="tab:orange")
    ax.set_title(f"Throughput over time: {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "-timeline.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        for written in save_plots(json.loads(path.read_text()), path.with_suffix("")):
            print(written)
