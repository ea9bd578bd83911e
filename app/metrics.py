"""Prometheus metrics with vLLM's names, computed in the frontend from engine timestamps.

Nothing here asks the engine anything. Every step's EngineCoreOutputs
carries the step's timestamp (when its tokens were produced) and each
output the request's lifecycle events (QUEUED, SCHEDULED, PREEMPTED), so
the output handler derives the intervals the way vLLM V1 does:

- time to first token and end-to-end latency: frontend wall clock, from the
  request's ``arrival_time`` to the first token / the finish being seen here;
- queue: QUEUED -> first SCHEDULED; prefill: SCHEDULED -> first token;
  decode: first -> last token; inference: SCHEDULED -> last token;
  inter-token latency: between successive steps that gave the request a
  token (all engine clock, so a preemption shows up in them);
- token counts: prompt tokens when the first token comes, generation
  tokens as they come.

Scheduler and engine counters ride on client 0's outputs as totals since
the engine started (``SchedulerStats``, ``EngineStats``); they become
Prometheus counters by their increase, gauges by their last value.

Cost: observations are counted in plain lists (a ``bisect`` per value) and
added to prometheus_client at most every ``FLUSH_INTERVAL_S`` and at every
scrape; a ``Histogram.observe`` per token would take two locks per token.

Several processes: each frontend counts its own requests (every request
belongs to one frontend), and the engine-level series come only from client
0, the one frontend every engine sends its snapshots to, so nothing is
counted twice. With ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client's
multiprocess mode, set before start-up), the values live in files there and
any frontend's /metrics sums the frontends' request series and takes the most
recent engine gauges.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

from core.protocol import (
    EngineCoreEventType,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    SchedulerStats,
    SpecDecodingStats,
    TransportStats,
)

# vLLM's bucket boundaries.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

FLUSH_INTERVAL_S = 0.1  # at most this stale between scrapes (another process's /metrics, multiprocess mode)
LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory, if this server runs in that mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class _Observations:
    """One histogram series' observations, counted here and added to prometheus_client in bulk.

    prometheus_client has no bulk observe, so ``flush`` adds to the child's
    bucket and sum values directly (``_upper_bounds``, ``_buckets``,
    ``_sum``: internals of the pinned version, the same in its multiprocess
    mode, whose values are files); tests/server/test_metrics.py checks the result.
    """

    __slots__ = ("_child", "_bounds", "_counts", "_sum", "_pending")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        self._bounds = list(child._upper_bounds)  # ends with +Inf
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = False

    def observe(self, value: float) -> None:
        # Prometheus puts a value in the first bucket whose bound is >= it.
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value
        self._pending = True

    def flush(self) -> None:
        if not self._pending:
            return
        buckets = self._child._buckets
        counts = self._counts
        for i, count in enumerate(counts):
            if count:
                buckets[i].inc(count)
                counts[i] = 0
        self._child._sum.inc(self._sum)
        self._sum = 0.0
        self._pending = False


class _Total:
    """A Prometheus counter that follows a running total kept elsewhere; it only moves up."""

    __slots__ = ("_child", "seen")

    def __init__(self, child: Counter) -> None:
        self._child = child
        self.seen = 0.0

    def update(self, total: float) -> None:
        if total > self.seen:
            self._child.inc(total - self.seen)
            self.seen = total


class _RequestTimes:
    """What the metrics need of one unfinished request."""

    __slots__ = (
        "arrival_time", "num_prompt_tokens", "max_tokens", "queued_ts", "scheduled_ts",
        "first_token_ts", "last_token_ts", "num_generation_tokens",
    )

    def __init__(self, request: EngineCoreRequest) -> None:
        self.arrival_time = request.arrival_time
        self.num_prompt_tokens = request.num_prompt_tokens
        self.max_tokens = request.sampling_params.max_tokens
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.first_token_ts = 0.0
        self.last_token_ts = 0.0
        self.num_generation_tokens = 0


@dataclass
class IdleWindow:
    """The engine's busy loop: idle and total seconds, up to now."""

    idle_seconds: float
    loop_seconds: float


class _Family:
    """The metric objects, built once per FrontendMetrics; children per engine in ``_EngineSeries``."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int, log_stats: bool) -> None:
        r = registry
        mostrecent = "mostrecent"
        self.log_stats = log_stats
        if log_stats:
            self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                 LABELS, registry=r, multiprocess_mode=mostrecent)
            self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                 LABELS, registry=r, multiprocess_mode=mostrecent)
            self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  LABELS, registry=r, multiprocess_mode=mostrecent)
            self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
            self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                             LABELS, registry=r)
            self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                           (*LABELS, "finished_reason"), registry=r)
            self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                       LABELS, registry=r)
            self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                          "Prefix cache queries, in terms of number of queried tokens.",
                                          LABELS, registry=r)
            self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                       "Prefix cache hits, in terms of number of cached tokens.", LABELS, registry=r)
            token_buckets = build_1_2_5_buckets(max_model_len)

            def hist(name: str, doc: str, buckets: list) -> Histogram:
                return Histogram(name, doc, LABELS, registry=r, buckets=buckets)

            self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                             TTFT_BUCKETS)
            self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                            ITL_BUCKETS)
            self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                            REQUEST_LATENCY_BUCKETS)
            self.queue = hist("vllm:request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
            self.prefill = hist("vllm:request_prefill_time_seconds",
                                "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
            self.decode = hist("vllm:request_decode_time_seconds",
                               "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
            self.inference = hist("vllm:request_inference_time_seconds",
                                  "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
            self.prompt_hist = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    token_buckets)
            self.generation_hist = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        token_buckets)
            self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                         "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
            self.max_tokens = hist("vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.", token_buckets)
            self.idle_fraction = Gauge("ringllm:engine_idle_fraction",
                                       "Fraction of the last stats interval the engine's busy loop waited for work.",
                                       LABELS, registry=r, multiprocess_mode=mostrecent)
            self.idle_seconds = Counter("ringllm:engine_idle_seconds",
                                        "Seconds the engine's busy loop has waited for work.", LABELS, registry=r)
            self.loop_seconds = Counter("ringllm:engine_busy_loop_seconds",
                                        "Seconds the engine's busy loop has run (idle or not).", LABELS, registry=r)
        self.registry = r
        self._spec: tuple[Counter, Counter, Counter, Counter] | None = None
        # Transport series: the frontend's own counters are kept whatever --disable-log-stats says.
        direction = (*LABELS, "direction")
        self.messages = Counter("ringllm:transport_messages", "Messages between frontend and engine.",
                                direction, registry=r)
        self.bytes = Counter("ringllm:transport_bytes",
                             "Wire bytes between frontend and engine (ring records with their headers).",
                             direction, registry=r)
        self.oob_bytes = Counter("ringllm:transport_oob_bytes",
                                 "Tensor bytes sent out of band (shared-memory pool) instead of in messages.",
                                 direction, registry=r)
        self.ring_full_waits = Counter("ringllm:transport_ring_full_waits",
                                       "Sends that waited for the consumer to make room (back-pressure).",
                                       direction, registry=r)
        self.doorbell_wakeups = Counter("ringllm:transport_doorbell_wakeups",
                                        "Doorbell rings that woke a sleeping peer (one syscall each).",
                                        (*LABELS, "woken"), registry=r)


    def spec_decode(self) -> tuple[Counter, Counter, Counter, Counter]:
        """vLLM's speculative decoding counters, registered when an engine first reports them."""
        if self._spec is None:
            r = self.registry
            self._spec = (
                Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", LABELS, registry=r),
                Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", LABELS, registry=r),
                Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", LABELS, registry=r),
                Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                        "Accepted tokens per draft position.", (*LABELS, "position"), registry=r),
            )
        return self._spec


class _EngineSeries:
    """The series of one engine index, with the running totals they follow."""

    def __init__(self, family: _Family, model_name: str, engine: int) -> None:
        labels = (model_name, str(engine))
        self.family = family
        self.labels = labels
        f = family
        frontend_in = (*labels, "to_frontend")
        frontend_out = (*labels, "to_engine")
        self.frontend_totals = [
            (_Total(f.messages.labels(*frontend_out)), "messages_sent"),
            (_Total(f.messages.labels(*frontend_in)), "messages_received"),
            (_Total(f.bytes.labels(*frontend_out)), "bytes_sent"),
            (_Total(f.bytes.labels(*frontend_in)), "bytes_received"),
            (_Total(f.oob_bytes.labels(*frontend_out)), "oob_bytes_sent"),
            (_Total(f.ring_full_waits.labels(*frontend_out)), "ring_full_waits"),
            (_Total(f.doorbell_wakeups.labels(*labels, "engine")), "doorbell_rings"),
        ]
        self.engine_totals = [
            (_Total(f.oob_bytes.labels(*frontend_in)), "oob_bytes_sent"),
            (_Total(f.ring_full_waits.labels(*frontend_in)), "ring_full_waits"),
            (_Total(f.doorbell_wakeups.labels(*labels, "frontend")), "doorbell_rings"),
        ]
        self.scheduler_stats: SchedulerStats | None = None
        self.engine_stats: EngineStats | None = None
        self.prompt_tokens = 0  # running totals of this frontend's requests
        self.generation_tokens = 0
        if not f.log_stats:
            return
        self.running = f.running.labels(*labels)
        self.waiting = f.waiting.labels(*labels)
        self.kv_usage = f.kv_usage.labels(*labels)
        self.idle_fraction = f.idle_fraction.labels(*labels)
        self.prompt_total = _Total(f.prompt_tokens.labels(*labels))
        self.generation_total = _Total(f.generation_tokens.labels(*labels))
        self.preemptions = _Total(f.preemptions.labels(*labels))
        self.prefix_queries = _Total(f.prefix_queries.labels(*labels))
        self.prefix_hits = _Total(f.prefix_hits.labels(*labels))
        self.idle_total = _Total(f.idle_seconds.labels(*labels))
        self.loop_total = _Total(f.loop_seconds.labels(*labels))
        self.ttft = _Observations(f.ttft.labels(*labels))
        self.itl = _Observations(f.itl.labels(*labels))
        self.e2e = _Observations(f.e2e.labels(*labels))
        self.queue = _Observations(f.queue.labels(*labels))
        self.prefill = _Observations(f.prefill.labels(*labels))
        self.decode = _Observations(f.decode.labels(*labels))
        self.inference = _Observations(f.inference.labels(*labels))
        self.prompt_hist = _Observations(f.prompt_hist.labels(*labels))
        self.generation_hist = _Observations(f.generation_hist.labels(*labels))
        self.iteration_tokens = _Observations(f.iteration_tokens.labels(*labels))
        self.max_tokens = _Observations(f.max_tokens.labels(*labels))
        self.histograms = [
            self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.decode, self.inference,
            self.prompt_hist, self.generation_hist, self.iteration_tokens, self.max_tokens,
        ]
        self.success: dict[str, Counter] = {}
        self.spec_totals: list[_Total] | None = None  # drafts, draft tokens, accepted, then per position

    def count_success(self, finish_reason: str) -> None:
        child = self.success.get(finish_reason)
        if child is None:
            child = self.success[finish_reason] = self.family.request_success.labels(*self.labels, finish_reason)
        child.inc()

    def _flush_spec(self, spec: SpecDecodingStats) -> None:
        totals = self.spec_totals
        if totals is None:
            drafts, draft_tokens, accepted, per_pos = self.family.spec_decode()
            totals = self.spec_totals = [
                _Total(drafts.labels(*self.labels)), _Total(draft_tokens.labels(*self.labels)),
                _Total(accepted.labels(*self.labels)),
                *(_Total(per_pos.labels(*self.labels, str(i))) for i in range(len(spec.num_accepted_tokens_per_pos))),
            ]
        values = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, *spec.num_accepted_tokens_per_pos)
        for total, value in zip(totals, values):
            total.update(value)

    def idle_window(self) -> IdleWindow | None:
        """The busy loop's idle and total seconds, carried forward to now: a waiting
        engine sends nothing, so the time since an idle snapshot is idle time.
        (The engine's and this process's monotonic clocks are Linux's one CLOCK_MONOTONIC.)"""
        stats = self.engine_stats
        if stats is None:
            return None
        gap = max(time.monotonic() - stats.timestamp, 0.0)
        idle = stats.idle_seconds + (gap if stats.idle else 0.0)
        return IdleWindow(idle, stats.loop_seconds + gap)

    def flush(self, frontend: TransportStats | None) -> None:
        if frontend is not None:
            for total, field in self.frontend_totals:
                total.update(getattr(frontend, field))
        engine = self.engine_stats
        if engine is not None and engine.transport is not None:
            for total, field in self.engine_totals:
                total.update(getattr(engine.transport, field))
        if not self.family.log_stats:
            return
        self.prompt_total.update(self.prompt_tokens)
        self.generation_total.update(self.generation_tokens)
        for observations in self.histograms:
            observations.flush()
        stats = self.scheduler_stats
        if stats is not None:
            self.running.set(stats.num_running_reqs)
            self.waiting.set(stats.num_waiting_reqs)
            self.kv_usage.set(stats.kv_cache_usage)
            self.preemptions.update(stats.num_preemptions)
            self.prefix_queries.update(stats.prefix_cache_queries)
            self.prefix_hits.update(stats.prefix_cache_hits)
            if stats.spec_decoding is not None:
                self._flush_spec(stats.spec_decoding)
        window = self.idle_window()
        if window is not None:
            self.idle_total.update(window.idle_seconds)
            self.loop_total.update(window.loop_seconds)


class FrontendMetrics:
    """The frontend's metrics: fed by AsyncLLM's output handler, read by /metrics and the stats log.

    With ``log_stats`` off (``--disable-log-stats``) only the frontend's own
    transport counters exist, read at scrape time; nothing is recorded per step.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_config: Mapping[str, object],
        transport_stats: Callable[[], TransportStats | None],
        log_stats: bool = True,
    ) -> None:
        self.model_name = model_name
        self.log_stats = log_stats
        # A registry of our own: several engines in one process (tests) must not collide.
        self.registry = CollectorRegistry()
        if multiprocess_dir() is None:
            ProcessCollector(registry=self.registry)
        self._family = _Family(self.registry, max_model_len, log_stats)
        self._transport_stats = transport_stats
        self.engines: dict[int, _EngineSeries] = {}
        self._requests: dict[str, _RequestTimes] = {}
        self._last_flush = 0.0
        self._series(0)
        if log_stats:
            info_labels = {"model_name": model_name, "engine": "0", **{k: str(v) for k, v in cache_config.items()}}
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         list(info_labels), registry=self.registry, multiprocess_mode="mostrecent")
            info.labels(**info_labels).set(1)

    def _series(self, engine: int) -> _EngineSeries:
        series = self.engines.get(engine)
        if series is None:
            series = self.engines[engine] = _EngineSeries(self._family, self.model_name, engine)
        return series

    # ------------------------------------------------------------ recording

    def add_request(self, request: EngineCoreRequest) -> None:
        self._requests[request.request_id] = _RequestTimes(request)

    def record(self, outputs: EngineCoreOutputs, finished_here: Iterable[str] = ()) -> None:
        """One step's outputs, after the output processor saw them. ``finished_here``:
        requests a stop string ended in the frontend (the engine is told to abort them)."""
        series = self._series(outputs.engine_index)
        step_ts = outputs.timestamp
        requests = self._requests
        itl = series.itl
        now = 0.0
        generated = 0
        for out in outputs.outputs:
            times = requests.get(out.request_id)
            if times is None:
                continue
            if out.events:
                _apply_events(times, out.events)
            n = len(out.new_token_ids)
            if n:
                generated += n
                times.num_generation_tokens += n
                if times.first_token_ts == 0.0:
                    now = now or time.time()
                    times.first_token_ts = step_ts
                    series.ttft.observe(now - times.arrival_time)
                    series.prompt_tokens += times.num_prompt_tokens
                else:
                    itl.observe(step_ts - times.last_token_ts)
                times.last_token_ts = step_ts
            if out.finish_reason is not None:
                now = now or time.time()
                self._finish(series, requests.pop(out.request_id), str(out.finish_reason), now)
        series.generation_tokens += generated
        for request_id in finished_here:
            self.finish_request(request_id, "stop", outputs.engine_index)
        stats = outputs.scheduler_stats
        if stats is not None:
            series.scheduler_stats = stats
            if stats.num_batched_tokens:
                series.iteration_tokens.observe(stats.num_batched_tokens)
        if outputs.engine_stats is not None:
            series.engine_stats = outputs.engine_stats
        mono = time.monotonic()
        if mono - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush(mono)

    def finish_request(self, request_id: str, finish_reason: str, engine: int = 0) -> None:
        """A request that ended in the frontend: a stop string, or its client went away ("abort")."""
        times = self._requests.pop(request_id, None)
        if times is not None:
            self._finish(self._series(engine), times, finish_reason, time.time())

    def _finish(self, series: _EngineSeries, times: _RequestTimes, finish_reason: str, now: float) -> None:
        series.count_success(finish_reason)
        series.e2e.observe(now - times.arrival_time)
        series.prompt_hist.observe(times.num_prompt_tokens)
        series.generation_hist.observe(times.num_generation_tokens)
        series.max_tokens.observe(times.max_tokens)
        if times.scheduled_ts:
            series.queue.observe(max(times.scheduled_ts - times.queued_ts, 0.0))
            if times.first_token_ts:
                series.prefill.observe(times.first_token_ts - times.scheduled_ts)
                series.decode.observe(times.last_token_ts - times.first_token_ts)
                series.inference.observe(times.last_token_ts - times.scheduled_ts)

    def forget_requests(self) -> None:
        """The engine died: its requests will never finish."""
        self._requests.clear()

    # ------------------------------------------------------------ reading

    def flush(self, now: float | None = None) -> None:
        """Hand everything counted so far to prometheus_client."""
        frontend = self._transport_stats()
        for engine, series in self.engines.items():
            series.flush(frontend if engine == 0 else None)
        self._last_flush = time.monotonic() if now is None else now

    def render(self) -> tuple[bytes, str]:
        """The text exposition of /metrics and its content type."""
        self.flush()
        registry = self.registry
        if multiprocess_dir() is not None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


def _apply_events(times: _RequestTimes, events: list) -> None:
    for event in events:
        if event.type == EngineCoreEventType.QUEUED:
            times.queued_ts = event.timestamp
        elif event.type == EngineCoreEventType.SCHEDULED and not times.scheduled_ts:
            times.scheduled_ts = event.timestamp
