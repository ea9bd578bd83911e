"""The result of ``bench serve``: vLLM's console block and its JSON, key for key.

The JSON carries vLLM's key names (so tools written for ``vllm bench serve``
results read ours) and always the per-request arrays; ``e2els``, ``tpots``
and ``start_times`` are additions (per-request values the plots need).
Failed requests are counted and their errors listed, grouped by message.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.client import RequestResult
from bench.metrics import BenchmarkMetrics

WIDTH = 50
HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
MAX_LISTED_INDICES = 10


def percentile_key(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's spelling)."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def build_result(
    metrics: BenchmarkMetrics,
    outputs: Sequence[RequestResult],
    duration: float,
    selected_metrics: Sequence[str],
    info: dict[str, Any],
) -> dict[str, Any]:
    """vLLM's result dict: run description, totals, per-request arrays, latency statistics."""
    t0 = min((o.start_time for o in outputs), default=0.0)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **info,
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": metrics.output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "e2els": [o.latency for o in outputs],
        "tpots": metrics.tpots,
        "start_times": [o.start_time - t0 for o in outputs],
    }
    for name in selected_metrics:
        summary = metrics.latency[name]
        result[f"mean_{name}_ms"] = summary.mean
        result[f"median_{name}_ms"] = summary.median
        result[f"std_{name}_ms"] = summary.std
        for p, value in summary.percentiles:
            result[f"{percentile_key(p)}_{name}_ms"] = value
    return result


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_console(result: dict[str, Any], selected_metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The block vLLM prints at the end of a run."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines.append(_line("Successful requests:", result["completed"]))
    lines.append(_line("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    lines.append(_line("Benchmark duration (s):", float(result["duration"])))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    lines.append(_line("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_line("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"])))
    lines.append(_line("Peak concurrent requests:", float(result["max_concurrent_requests"])))
    lines.append(_line("Total token throughput (tok/s):", result["total_token_throughput"]))
    for name in selected_metrics:
        short, header = HEADERS[name]
        lines.append(header.center(WIDTH, "-"))
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_line(f"{key.upper()} {short} (ms):", result[f"{key}_{name}_ms"]))
    if result.get("spec_decode_num_drafts") is not None:
        lines.append(" Speculative Decoding ".center(WIDTH, "-"))
        lines.append(_line("Acceptance rate (%):", float(result["spec_decode_acceptance_rate"])))
        lines.append(_line("Acceptance length:", float(result["spec_decode_acceptance_length"])))
        lines.append(_line("Drafts:", result["spec_decode_num_drafts"]))
        lines.append(_line("Draft tokens:", result["spec_decode_draft_tokens"]))
        lines.append(_line("Accepted tokens:", result["spec_decode_accepted_tokens"]))
        per_position = ", ".join(f"{v:.1f}" for v in result["spec_decode_per_position_acceptance"])
        lines.append(f"Per-position acceptance (%): {per_position}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_failures(errors: Sequence[str]) -> str:
    """Every failed request, grouped by the last line of its error (the message, not the stack)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, error in enumerate(errors):
        if error:
            lines = error.strip().splitlines()
            groups[lines[-1] if lines else error].append(i)
    if not groups:
        return ""
    out = [f"{sum(len(v) for v in groups.values())} failed requests:"]
    for message, indices in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(map(str, indices[:MAX_LISTED_INDICES]))
        more = f", ... ({len(indices) - MAX_LISTED_INDICES} more)" if len(indices) > MAX_LISTED_INDICES else ""
        out.append(f"  x{len(indices)} [requests {shown}{more}]: {message}")
    return "\n".join(out)


def default_filename(info: dict[str, Any]) -> str:
    """vLLM's naming: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json."""
    concurrency = f"-concurrency{info['max_concurrency']}" if info.get("max_concurrency") else ""
    model = str(info.get("model_id", "model")).rstrip("/").split("/")[-1]
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{info.get('backend', 'openai')}-{info.get('request_rate')}qps{concurrency}-{model}-{date}.json"


def save_result(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
