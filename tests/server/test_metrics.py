"""GET /metrics (vLLM's names, read with prometheus_client's parser) and the stats log line.

Most tests run the real app over the real engine in this process
(tests/support/http.py); the last one runs a real server process in
prometheus_client's multiprocess mode, with a short stats interval.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai

from app.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from app.stats_logger import StatsLogger
from tests.support.http import MODEL, make_engine, running_server
from tests.support.metrics import (
    Samples,
    bucket_bounds,
    metric_types,
    parse_metrics,
    value,
)
from tests.support.waiting import wait_for

LABELS = {"model_name": MODEL, "engine": "0"}
# (prompt, max_tokens): finished by length (ignore_eos), so the token counts are known.
REQUESTS = [("Once upon a time", 7), ("The little dog ran to the park and", 12), ("Lily", 5)]

COUNTERS = [
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total", "vllm:request_params_max_tokens",
]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse_metrics(response.text)


def openai_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_metrics_move_by_exactly_the_requests_served(stories_dir) -> None:
    engine = make_engine(stories_dir)
    async with running_server(engine) as (client, base):
        before = await scrape(client)
        oa = openai_client(base)
        prompt_tokens = []
        for i, (prompt, max_tokens) in enumerate(REQUESTS):
            args = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
            if i == 0:  # one of them streamed: same accounting
                stream = await oa.completions.create(**args, stream=True, stream_options={"include_usage": True})
                usage = [chunk.usage async for chunk in stream if chunk.usage is not None][-1]
            else:
                usage = (await oa.completions.create(**args)).usage
            assert usage.completion_tokens == max_tokens
            assert usage.prompt_tokens == len(engine.input_processor.tokenize_prompt(prompt))
            prompt_tokens.append(usage.prompt_tokens)
        after = await scrape(client)
        response = await client.get("/metrics")

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **LABELS, **labels) - value(before, name, **LABELS, **labels)

    n = len(REQUESTS)
    generated = [max_tokens for _, max_tokens in REQUESTS]
    assert delta("vllm:prompt_tokens_total") == sum(prompt_tokens)
    assert delta("vllm:generation_tokens_total") == sum(generated)
    assert delta("vllm:request_success_total", finished_reason="length") == n
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert delta(name + "_count") == n, name
        assert delta(name + "_bucket", le="+Inf") == n, name
    # One inter-token interval per token after the first.
    assert delta("vllm:inter_token_latency_seconds_count") == sum(generated) - n
    assert delta("vllm:request_prompt_tokens_sum") == sum(prompt_tokens)
    assert delta("vllm:request_generation_tokens_sum") == sum(generated)
    assert delta("vllm:request_params_max_tokens_sum") == sum(generated)
    # Each step computed at least one token; all of them add up to prompts plus decodes.
    assert delta("vllm:iteration_tokens_total_sum") == sum(prompt_tokens) + sum(generated) - n
    assert delta("vllm:prefix_cache_queries_total") == sum(prompt_tokens)
    assert value(after, "vllm:num_requests_running", **LABELS) == 0
    assert value(after, "vllm:num_requests_waiting", **LABELS) == 0
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum") > 0

    types = metric_types(response.text)
    assert all(types[name] == "counter" for name in COUNTERS), types
    assert all(types[name] == "gauge" for name in GAUGES), types
    assert all(types[name] == "histogram" for name in HISTOGRAMS), types
    assert bucket_bounds(after, "vllm:time_to_first_token_seconds", **LABELS)[:-1] == TTFT_BUCKETS
    assert bucket_bounds(after, "vllm:inter_token_latency_seconds", **LABELS)[:-1] == ITL_BUCKETS
    assert bucket_bounds(after, "vllm:e2e_request_latency_seconds", **LABELS)[:-1] == REQUEST_LATENCY_BUCKETS
    assert bucket_bounds(after, "vllm:request_prompt_tokens", **LABELS)[:-1] == [1, 2, 5, 10, 20, 50]  # max_model_len 64
    info = [dict(labels) for (name, labels) in after if name == "vllm:cache_config_info"]
    assert info and info[0]["block_size"] == "16" and info[0]["engine"] == "0"
    # The example dashboard queries only series that exist.
    dashboard = (Path(__file__).parents[2] / "examples" / "grafana.json").read_text()
    queried = set(re.findall(r"(?:vllm|ringllm):\w+", dashboard))
    exposed = {name for name, _ in after}
    assert queried and queried <= exposed, queried - exposed


async def test_kv_cache_usage_moves_while_a_long_request_runs(stories_dir) -> None:
    engine = make_engine(stories_dir)
    async with running_server(engine) as (client, base):
        stream = await openai_client(base).completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        during = None
        async for chunk in stream:
            if during is None and chunk.choices[0].text:
                during = await scrape(client)
        after = await scrape(client)
    assert during is not None
    assert value(during, "vllm:kv_cache_usage_perc", **LABELS) > 0
    assert value(during, "vllm:num_requests_running", **LABELS) == 1
    assert value(after, "vllm:kv_cache_usage_perc", **LABELS) == 0
    assert value(after, "vllm:num_requests_running", **LABELS) == 0


async def test_the_stats_line_appears_under_load_and_not_when_idle(stories_dir, caplog) -> None:
    engine = make_engine(stories_dir)
    stats_log = StatsLogger(engine.metrics, interval=10.0)
    async with running_server(engine) as (client, base):
        assert stats_log.log() == []  # nothing has happened yet
        await openai_client(base).completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        with caplog.at_level("INFO", logger="ringllm.stats"):
            lines = stats_log.log()
        assert len(lines) == 1 and lines[0] in caplog.text
        pattern = (
            r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
            r"Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0\.0%, Prefix cache hit rate: [\d.]+%"
        )
        match = re.fullmatch(pattern, lines[0])
        assert match and float(match.group(1)) > 0, lines[0]
        # The interval after the burst reports its end once; then the idle server is quiet.
        assert len(stats_log.log()) == 1
        assert stats_log.log() == []


async def test_disable_log_stats_leaves_only_the_transport_series(stories_dir) -> None:
    engine = make_engine(stories_dir, log_stats=False)
    async with running_server(engine) as (client, base):
        await openai_client(base).completions.create(model=MODEL, prompt="Lily", max_tokens=4)
        names = metric_types((await client.get("/metrics")).text)
    assert not [name for name in names if name.startswith("vllm:")]
    assert "ringllm:transport_messages" in names
    assert engine.stats_logger is None


async def test_metrics_need_the_api_key(stories_dir) -> None:
    async with running_server(make_engine(stories_dir), api_key="sesame") as (client, _):
        assert (await client.get("/metrics")).status_code == 401
        ok = await client.get("/metrics", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and "vllm:num_requests_running" in ok.text


def test_real_server_in_multiprocess_mode(server_factory, tmp_path, monkeypatch) -> None:
    """A spawned engine: the transport series, the periodic line, request logging without
    prompts, and prometheus_client's multiprocess mode (values in files, summed at scrape)."""
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
    monkeypatch.setenv("RINGLLM_LOG_STATS_INTERVAL", "0.3")
    server = server_factory(["--enable-log-requests"])
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    client.completions.create(model="stories260K", prompt="Hello", max_tokens=2)  # the stats task starts here
    # That burst's lines: one with its tokens, then one that says the interval after it had none.
    wait_for(lambda: "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in server.log(),
             "the line of the interval after the burst")
    quiet_from = len(server.log())
    time.sleep(1.0)  # three more intervals of an idle server
    assert "Avg prompt throughput" not in server.log()[quiet_from:]

    before = parse_metrics(httpx.get(server.base_url + "/metrics").text)
    secret = "A purple giraffe named Zed"
    usages = [
        client.completions.create(
            model="stories260K", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        ).usage
        for prompt, n in [(secret, 9), ("Once upon a time", 6)]
    ]
    after = parse_metrics(httpx.get(server.base_url + "/metrics").text)
    labels = {"model_name": "stories260K", "engine": "0"}

    def delta(name: str, **extra: str) -> float:
        return value(after, name, **labels, **extra) - value(before, name, **labels, **extra)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == 15
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert value(after, "vllm:num_requests_running", **labels) == 0
    for direction in ("to_engine", "to_frontend"):
        assert delta("ringllm:transport_messages_total", direction=direction) >= 2, direction
        assert delta("ringllm:transport_bytes_total", direction=direction) > 0, direction
    assert value(after, "ringllm:engine_busy_loop_seconds_total", **labels) > 0
    assert list(multiproc.glob("*.db")), "prometheus_client wrote no multiprocess files"

    wait_for(lambda: "Avg generation throughput" in server.log()[quiet_from:], "the next periodic line")
    log = server.log()
    assert re.search(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput", log[quiet_from:])
    assert "Received request" in log and "Finished request" in log
    assert secret not in log  # prompts are not logged unless --max-log-len asks
