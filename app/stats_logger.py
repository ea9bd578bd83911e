"""The periodic stats line, and the optional per-request log lines.

Every ``interval`` seconds (``RINGLLM_LOG_STATS_INTERVAL``, default 10, like
vLLM's ``VLLM_LOG_STATS_INTERVAL``) one line per engine says what the
engine did in that interval. A quiet server stays quiet: the line is
written only when the interval, or the one before it, saw tokens, or
requests are in the engine (say, held by a pause), so that the end of a
burst is still reported once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from app.metrics import FrontendMetrics
from core import envs
from core.protocol import EngineCoreRequest, SpecDecodingStats

logger = logging.getLogger("ringllm.stats")
request_logger = logging.getLogger("ringllm.requests")



@dataclass
class _Mark:
    """An engine's totals at the previous line."""

    time: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    idle_seconds: float = 0.0
    loop_seconds: float = 0.0
    had_tokens: bool = False
    spec: SpecDecodingStats | None = None


class StatsLogger:
    """vLLM's LoggingStatLogger line, from the frontend's metrics."""

    def __init__(self, metrics: FrontendMetrics, interval: float | None = None) -> None:
        """``interval``: seconds between lines (default ``RINGLLM_LOG_STATS_INTERVAL``)."""
        self.metrics = metrics
        self.interval = envs.RINGLLM_LOG_STATS_INTERVAL if interval is None else interval
        self._marks: dict[int, _Mark] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log()

    def log(self) -> list[str]:
        """Write the line of every engine that had something to say; returns them."""
        lines = []
        now = time.monotonic()
        for engine, series in self.metrics.engines.items():
            mark = self._marks.get(engine)
            if mark is None:
                mark = self._marks[engine] = _Mark(now - self.interval)
            elapsed = max(now - mark.time, 1e-9)
            stats = series.scheduler_stats
            queries = stats.prefix_cache_queries if stats else 0
            hits = stats.prefix_cache_hits if stats else 0
            prompt = series.prompt_tokens - mark.prompt_tokens
            generation = series.generation_tokens - mark.generation_tokens
            window = series.idle_window()
            if window is not None and window.loop_seconds > mark.loop_seconds and self.metrics.log_stats:
                busy_window = window.loop_seconds - mark.loop_seconds
                series.idle_fraction.set((window.idle_seconds - mark.idle_seconds) / busy_window)
            in_engine = (stats.num_running_reqs + stats.num_waiting_reqs) if stats else 0
            had_tokens = bool(prompt or generation)
            if had_tokens or mark.had_tokens or in_engine:
                # Hit rate over this interval's lookups; over all of them when there were none.
                new_queries = queries - mark.prefix_queries
                rate = (hits - mark.prefix_hits) / new_queries if new_queries else (hits / queries if queries else 0.0)
                line = (
                    f"Engine {engine:03d}: Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                    f"Running: {stats.num_running_reqs if stats else 0} reqs, "
                    f"Waiting: {stats.num_waiting_reqs if stats else 0} reqs, "
                    f"KV cache usage: {(stats.kv_cache_usage if stats else 0.0) * 100:.1f}%, "
                    f"Prefix cache hit rate: {rate * 100:.1f}%"
                )
                logger.info("%s", line)
                lines.append(line)
                spec_line = _spec_line(engine, stats.spec_decoding if stats else None, mark.spec)
                if spec_line is not None:
                    logger.info("%s", spec_line)
                    lines.append(spec_line)
            self._marks[engine] = _Mark(
                now, series.prompt_tokens, series.generation_tokens, queries, hits,
                window.idle_seconds if window else 0.0, window.loop_seconds if window else 0.0, had_tokens,
                stats.spec_decoding if stats else None,
            )
        return lines


def _spec_line(engine: int, spec: SpecDecodingStats | None, before: SpecDecodingStats | None) -> str | None:
    """vLLM's speculative decoding line over the interval: None without verifications in it."""
    if spec is None:
        return None
    before = before or SpecDecodingStats(num_accepted_tokens_per_pos=[0] * len(spec.num_accepted_tokens_per_pos))
    drafts = spec.num_drafts - before.num_drafts
    if drafts <= 0:
        return None
    drafted = spec.num_draft_tokens - before.num_draft_tokens
    accepted = spec.num_accepted_tokens - before.num_accepted_tokens
    per_pos = ", ".join(
        f"{(now - then) / drafts:.3f}"
        for now, then in zip(spec.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)
    )
    return (
        f"Engine {engine:03d}: SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Draft acceptance rate: {accepted / max(drafted, 1) * 100:.1f}%, Accepted: {accepted} tokens, "
        f"Drafted: {drafted} tokens, Per-position acceptance rate: {per_pos}"
    )


class RequestLogger:
    """``--enable-log-requests``: a line when a request arrives and when it ends.

    The prompt's text is not logged unless ``max_log_len`` (``--max-log-len``)
    asks for that many characters of it: prompts are the users' data.
    """

    def __init__(self, tokenizer: object, max_log_len: int = 0) -> None:
        self.tokenizer = tokenizer
        self.max_log_len = max_log_len

    def received(self, request: EngineCoreRequest) -> None:
        prompt = ""
        if self.max_log_len > 0 and request.prompt_token_ids:
            text = self.tokenizer.decode(request.prompt_token_ids)  # type: ignore[attr-defined]
            prompt = f", prompt: {text[: self.max_log_len]!r}"
        request_logger.info(
            "Received request %s: %d prompt tokens, params: %s%s",
            request.request_id, request.num_prompt_tokens, request.sampling_params, prompt,
        )

    def finished(self, request_id: str, finish_reason: str | None, num_output_tokens: int) -> None:
        request_logger.info(
            "Finished request %s: finish_reason=%s, %d output tokens", request_id, finish_reason, num_output_tokens
        )
