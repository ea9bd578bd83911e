"""Data parallel on one host (``-dp 2``), on real servers with stories260K and the openai client.

Greedy outputs equal those of one engine; a burst of 64 streams is split evenly by the
shared-memory load table; ``data_parallel_rank`` pins an engine; a client that leaves
has its request aborted in the engine that owns it, whose KV blocks are then free.
Which engine served what is read from /metrics (the ``engine`` label) and /engine/stats.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.metrics import parse_metrics, value
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

MODEL = "stories260K"
PROMPTS = [
    "Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was",
    "There was a big", "Mom said", "The cat and the bird",
]


@pytest.fixture(scope="module")
def dp2(module_server_factory):
    return module_server_factory(["-dp", "2"])


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _successes(server) -> dict[str, float]:
    """Finished requests per engine index, from /metrics."""
    samples = parse_metrics(httpx.get(server.base_url + "/metrics", timeout=10).text)
    return {
        engine: sum(
            value(samples, "vllm:request_success_total", engine=engine, finished_reason=reason, model_name=MODEL)
            for reason in ("stop", "length", "abort", "error")
        )
        for engine in ("0", "1")
    }


async def _greedy(server, prompts: list[str]) -> list[str]:
    client = _client(server)
    try:
        done = await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in prompts)
        )
    finally:
        await client.close()
    return [c.choices[0].text for c in done]


def test_two_engines_give_the_greedy_outputs_of_one(dp2, server_factory) -> None:
    before = _successes(dp2)
    two = asyncio.run(_greedy(dp2, PROMPTS))
    after = _successes(dp2)
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)  # both engines served some
    one = asyncio.run(_greedy(server_factory([]), PROMPTS))
    assert two == one


def test_a_burst_of_64_streams_is_split_evenly(dp2) -> None:
    async def stream(client: openai.AsyncOpenAI, i: int) -> int:
        chunks = await client.completions.create(
            model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=32, temperature=1.0, stream=True,
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in chunks:
            tokens += sum(1 for c in chunk.choices if c.text)
        return tokens

    async def burst() -> None:
        client = _client(dp2)
        try:
            await asyncio.gather(*(stream(client, i) for i in range(64)))
        finally:
            await client.close()

    before = _successes(dp2)
    asyncio.run(burst())
    after = _successes(dp2)
    split = [after[e] - before[e] for e in ("0", "1")]
    assert sum(split) == 64
    assert all(24 <= n <= 40 for n in split), split  # 32 each, within 25 %


def test_data_parallel_rank_pins_the_engine(dp2) -> None:
    async def pinned(rank: int) -> list[str]:
        client = _client(dp2)
        try:
            done = await asyncio.gather(*(
                client.completions.create(
                    model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"data_parallel_rank": rank}
                )
                for p in PROMPTS[:6]
            ))
        finally:
            await client.close()
        return [c.choices[0].finish_reason for c in done]

    for rank in (1, 0):
        before = _successes(dp2)
        assert len(asyncio.run(pinned(rank))) == 6
        after = _successes(dp2)
        assert after[str(rank)] - before[str(rank)] == 6
        assert after[str(1 - rank)] == before[str(1 - rank)]

    sync = openai.OpenAI(base_url=dp2.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        sync.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"data_parallel_rank": 2})
    assert bad.value.body["param"] == "data_parallel_rank"


def _open_stream(base: str, body: dict, first_token: bool) -> tuple[httpx.Client, httpx.Response, Iterator[str]]:
    """A stream left open; with ``first_token``, read up to its first event. The line
    iterator is returned with it: dropping it would close the connection."""
    client = httpx.Client(base_url=base, timeout=60)
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    if first_token:
        while not next(lines).startswith("data: "):
            pass
    return client, response, lines


def _close(streams: list[tuple[httpx.Client, httpx.Response, Iterator[str]]]) -> None:
    for client, response, _ in streams:
        response.close()
        client.close()


def test_an_abort_reaches_the_engine_that_owns_the_request(dp2) -> None:
    base = dp2.base_url
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True,
            "temperature": 1.0, "stream": True, "data_parallel_rank": 1}

    def engine1_empty() -> bool:
        stats = dp2.engine_stats()["engines"][1]
        return stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0

    # Held by a pause: they wait in engine 1 until their clients leave.
    assert httpx.post(base + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
    try:
        held = [_open_stream(base, body, first_token=False) for _ in range(3)]
        wait_for(lambda: dp2.engine_stats()["engines"][1]["num_waiting_reqs"] == 3, "3 requests held in engine 1")
        assert dp2.engine_stats()["engines"][0]["num_waiting_reqs"] == 0
        _close(held)
        wait_for(engine1_empty, "engine 1 to drop the held requests")
    finally:
        httpx.post(base + "/resume", timeout=10)

    # Running (48 sequences, so they take a while), then frozen with their KV blocks
    # (pause "keep"): the client leaving frees the blocks.
    running = [_open_stream(base, {**body, "n": 48}, first_token=True)]
    assert httpx.post(base + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
    try:
        engine1 = dp2.engine_stats()["engines"][1]
        assert engine1["num_running_reqs"] >= 1 and engine1["kv_cache_usage"] > 0, engine1
        _close(running)
        wait_for(engine1_empty, "engine 1 to drop the running requests and free their KV blocks")
    finally:
        _close(running)
        httpx.post(base + "/resume", timeout=10)
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_engine(server_factory) -> None:
    """With --data-parallel-prefix-affinity, requests sharing a prefix of whole blocks follow
    the first one to its engine (one at a time, so the loads are equal and only the prefix
    decides); without it, the same requests alternate between the engines."""
    story = " ".join(["Once upon a time there was a little girl named Lily who loved the park."] * 4)
    prompts = [f"{story} Question {i}:" for i in range(8)]

    def split(server) -> list[float]:
        before = _successes(server)
        for prompt in prompts:
            done = httpx.post(server.base_url + "/v1/completions",
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60)
            assert done.status_code == 200, done.text
        after = _successes(server)
        return sorted(after[e] - before[e] for e in ("0", "1"))

    assert split(server_factory(["-dp", "2", "--data-parallel-prefix-affinity"])) == [0, 8]
    assert split(server_factory(["-dp", "2"])) == [4, 4]
