"""Pause/resume, sleep/wake_up and collective_rpc: vLLM's routes over the real engine.

The pause tests run the app over the engine in this process
(tests/support/http.py) with the official openai client; sleep runs a real
server process, whose engine's resident memory is read from /proc.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from app.async_llm import AsyncLLM
from core.model_config import ModelConfig
from tests.support.http import MODEL, make_engine, running_server
from tests.support.metrics import parse_metrics, value
from tests.support.waiting import wait_until

GREEDY = dict(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
LABELS = {"model_name": MODEL, "engine": "0"}


def openai_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


class Stream:
    """A streamed completion read by a task: its text and token count so far, and its
    finish reason."""

    def __init__(self, oa: openai.AsyncOpenAI, **args) -> None:
        self.chunks: list[str] = []
        self.tokens = 0
        self.finish_reason: str | None = None
        self._started = asyncio.Event()
        usage = {"include_usage": True, "continuous_usage_stats": True}
        self.task = asyncio.create_task(self._read(oa, {**args, "stream_options": usage}))

    async def _read(self, oa: openai.AsyncOpenAI, args: dict) -> None:
        async for chunk in await oa.completions.create(**args, stream=True):
            if chunk.usage is not None:
                self.tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.text:
                self.chunks.append(choice.text)
                if len(self.chunks) >= 3:
                    self._started.set()
            self.finish_reason = choice.finish_reason or self.finish_reason
        self._started.set()

    async def received(self, tokens: int) -> None:
        """Every one of ``tokens`` tokens the engine produced for it has arrived."""
        await wait_until(lambda: self.tokens >= tokens, f"the stream to receive {tokens} tokens")

    async def started(self) -> None:
        """Three text chunks have arrived."""
        await self._started.wait()

    @property
    def text(self) -> str:
        return "".join(self.chunks)


async def generated_tokens(client: httpx.AsyncClient) -> float:
    return value(parse_metrics((await client.get("/metrics")).text), "vllm:generation_tokens_total", **LABELS)


async def engine_stats(client: httpx.AsyncClient) -> dict:
    return (await client.get("/engine/stats")).json()


def output_tokens(engine: AsyncLLM) -> int:
    """Tokens the in-process engine has produced for its one running request."""
    (request,) = engine.engine_core.engine_core.scheduler.running
    return len(request.output_token_ids)


async def requests_waiting(client: httpx.AsyncClient, count: int) -> None:
    """Until ``count`` requests wait in the engine (held by a pause)."""

    async def check() -> bool:
        return (await engine_stats(client))["num_waiting_reqs"] == count

    await wait_until(check, f"{count} requests waiting in the engine")


async def test_pause_keep_freezes_requests_and_resume_continues_them_token_exact(stories_dir) -> None:
    engine = make_engine(stories_dir)
    async with running_server(engine) as (client, base):
        oa = openai_client(base)
        reference = (await oa.completions.create(**GREEDY)).choices[0].text
        stream = Stream(oa, **GREEDY)
        await stream.started()
        response = await client.post("/pause", params={"mode": "keep"})
        assert response.status_code == 200 and response.json()["status"] == "paused"
        assert (await client.get("/is_paused")).json() == {"is_paused": True}

        await stream.received(output_tokens(engine))  # what the engine made before the pause
        frozen, text_when_frozen = await generated_tokens(client), stream.text
        await asyncio.sleep(0.5)  # a stretch in which a running engine makes dozens of tokens
        assert await generated_tokens(client) == frozen  # not one token while paused
        assert stream.text == text_when_frozen and not stream.task.done()
        stats = await engine_stats(client)
        assert stats["num_running_reqs"] == 1 and stats["kv_cache_usage"] > 0  # kept, with its KV cache

        waiting = asyncio.create_task(oa.completions.create(**{**GREEDY, "max_tokens": 5}))
        await requests_waiting(client, 1)
        assert not waiting.done()  # a new request waits while paused

        assert (await client.post("/resume")).json() == {"status": "resumed"}
        await stream.task
        assert (stream.text, stream.finish_reason) == (reference, "length")
        assert (await waiting).choices[0].text == reference[: len((await waiting).choices[0].text)]
        assert (await client.get("/is_paused")).json() == {"is_paused": False}


async def test_pause_abort_returns_partial_output_and_holds_new_requests(stories_dir) -> None:
    async with running_server(make_engine(stories_dir)) as (client, base):
        oa = openai_client(base)
        reference = (await oa.completions.create(**GREEDY)).choices[0].text
        stream = Stream(oa, **GREEDY)
        whole = asyncio.create_task(oa.completions.create(**GREEDY))  # not streamed
        await stream.started()
        assert (await client.post("/pause", params={"mode": "abort"})).status_code == 200
        await stream.task
        assert stream.finish_reason == "abort"
        assert stream.text and len(stream.text) < len(reference) and reference.startswith(stream.text)
        partial = (await whole).choices[0]
        assert partial.finish_reason == "abort" and reference.startswith(partial.text)

        held = asyncio.create_task(oa.completions.create(**GREEDY))
        await requests_waiting(client, 1)
        assert not held.done()
        await client.post("/resume")
        assert (await held).choices[0].text == reference


async def test_pause_wait_drains_requests_in_flight_then_holds_new_ones(stories_dir) -> None:
    async with running_server(make_engine(stories_dir)) as (client, base):
        oa = openai_client(base)
        reference = (await oa.completions.create(**GREEDY)).choices[0].text
        stream = Stream(oa, **GREEDY)
        await stream.started()
        assert (await client.post("/pause", params={"mode": "wait"})).status_code == 200
        stats = await engine_stats(client)  # /pause returned once nothing was left in flight
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 0)
        await stream.task
        assert (stream.text, stream.finish_reason) == (reference, "length")

        held = asyncio.create_task(oa.completions.create(**GREEDY))
        await requests_waiting(client, 1)
        assert not held.done()
        await client.post("/resume")
        assert (await held).choices[0].text == reference


async def test_control_routes_are_gated(stories_dir) -> None:
    async with running_server(make_engine(stories_dir)) as (client, _):
        assert (await client.post("/pause", params={"mode": "later"})).status_code == 400
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/collective_rpc")]:
            assert (await client.request(method, path)).status_code == 404, path
    async with running_server(
        make_engine(stories_dir), api_key="sesame", enable_sleep_mode=True, enable_dev_endpoints=True
    ) as (client, _):
        for method, path in [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                             ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/collective_rpc")]:
            assert (await client.request(method, path)).status_code == 401, path
        auth = {"Authorization": "Bearer sesame"}
        rpc = await client.post("/collective_rpc", json={"method": "memory_usage"}, headers=auth)
        assert rpc.status_code == 200
        (usage,) = rpc.json()["results"]
        assert usage["kv_cache_bytes"] > 0 and usage["weights_bytes"] > 0 and usage["rss_bytes"] > 0
        refused = await client.post("/collective_rpc", json={"method": "__init__"}, headers=auth)
        assert refused.status_code == 400 and "not allowed" in refused.json()["error"]["message"]
        # The engine here was built without sleep mode: the route exists, the engine refuses.
        asleep = await client.post("/sleep", headers=auth)
        assert asleep.status_code == 400 and "--enable-sleep-mode" in asleep.json()["error"]["message"]


async def test_reload_weights_between_pause_and_resume(stories_dir) -> None:
    async with running_server(make_engine(stories_dir), enable_dev_endpoints=True) as (client, base):
        oa = openai_client(base)
        reference = (await oa.completions.create(**GREEDY)).choices[0].text
        await client.post("/pause", params={"mode": "wait"})
        rpc = await client.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"model_dir": stories_dir}})
        assert rpc.status_code == 200 and rpc.json()["results"][0]["model"] == stories_dir
        await client.post("/resume")
        assert (await oa.completions.create(**GREEDY)).choices[0].text == reference


def _status(pid: int, field: str) -> int:
    """A size from /proc/PID/status, in bytes (VmRSS: resident; VmSize: mapped)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def test_sleep_frees_the_kv_cache_and_wake_up_serves_the_same_output(server_factory, stories_dir) -> None:
    server = server_factory(["--enable-sleep-mode"])
    base = server.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    request = dict(model="stories260K", prompt="Once upon a time", max_tokens=32, temperature=0)
    before = client.completions.create(**request).choices[0].text
    info = next(
        dict(labels) for (name, labels) in parse_metrics(httpx.get(base + "/metrics").text)
        if name == "vllm:cache_config_info"
    )
    per_block = ModelConfig.from_dir(stories_dir).kv_bytes_per_block(int(info["block_size"]), torch.float16.itemsize)
    kv_bytes = int(info["num_gpu_blocks"]) * per_block
    pid = server.engine_pid()

    for level in (1, 2):
        # The CPU KV cache is an anonymous mapping, resident only where requests wrote: sleeping
        # unmaps all of it, and with it whatever part of it was resident. The engine's other
        # threads may map a little meanwhile (a stack, an allocator's pages): an eighth is allowed.
        awake = _status(pid, "VmSize")
        response = httpx.post(base + "/sleep", params={"level": level}, timeout=60)
        assert response.status_code == 200 and response.json()["level"] == level
        asleep = _status(pid, "VmSize")
        assert awake - asleep >= kv_bytes * 7 // 8, (level, awake, asleep, kv_bytes)
        memory = response.json()["memory"]
        assert memory["before"]["kv_cache_bytes"] == kv_bytes and memory["after"]["kv_cache_bytes"] == 0
        assert memory["after"]["weights_bytes"] == 0
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": True}
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(**request)
        assert refused.value.status_code == 503 and "asleep" in refused.value.message

        woken = httpx.post(base + "/wake_up", timeout=120)
        assert woken.status_code == 200 and woken.json()["memory"]["kv_cache_bytes"] == kv_bytes
        assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": False}
        assert client.completions.create(**request).choices[0].text == before, level


async def test_pause_keep_and_wait_with_an_engine_process(server_factory) -> None:
    """The same pauses through the rings: the engine process replies to /pause only once idle."""
    server = server_factory([])
    oa = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    request = {**GREEDY, "model": "stories260K", "max_tokens": 120}
    reference = (await oa.completions.create(**request)).choices[0].text
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        async def made() -> float:  # tokens the frontend has taken from the engine
            metrics = parse_metrics((await client.get("/metrics")).text)
            return value(metrics, "vllm:generation_tokens_total", model_name="stories260K", engine="0")

        before = await made()
        stream = Stream(oa, **request)
        await stream.started()
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        # Outputs sent before the pause may still be on their way: settled once the stream has
        # every token the frontend took, twice in a row (each read is a trip through its loop).
        seen: list[float] = []

        async def settled() -> bool:
            seen.append(await made() - before)
            return seen[-2:] == [stream.tokens] * 2

        await wait_until(settled, "the stream to receive what the engine made before the pause")
        text_when_frozen = stream.text
        await asyncio.sleep(0.5)  # a stretch in which a running engine makes dozens of tokens
        assert stream.text == text_when_frozen and not stream.task.done()
        await client.post("/resume")
        await stream.task
        assert (stream.text, stream.finish_reason) == (reference, "length")

        stream = Stream(oa, **request)
        await stream.started()
        assert (await client.post("/pause", params={"mode": "wait"})).status_code == 200
        stats = (await client.get("/engine/stats")).json()
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 0)
        await stream.task
        assert stream.text == reference
        await client.post("/resume")


def test_offline_client_pause_wait_steps_the_engine_until_drained(stories_dir) -> None:
    from core.client import InprocClient
    from core.config import EngineArgs
    from core.protocol import EngineCoreRequest, SamplingParams
    from core.utilities import (
        IS_SCHEDULER_PAUSED,
        PAUSE_SCHEDULER,
        RESUME_SCHEDULER,
        Call,
    )

    client = InprocClient(EngineArgs(model=stories_dir, max_model_len=64, max_num_seqs=4).resolve())
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        client.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=[1, 400, 500], sampling_params=params))
        first = client.get_output()
        assert client.call(PAUSE_SCHEDULER(mode="wait")) is True  # steps "a" to its end
        assert not client.engine_core.has_work()
        client.add_request(EngineCoreRequest(request_id="b", prompt_token_ids=[1, 400, 500], sampling_params=params))
        tokens = {"a": [t for o in first.outputs for t in o.new_token_ids], "b": []}
        while len(tokens["a"]) < 8:  # the outputs of the steps the pause drove were kept
            for out in client.get_output().outputs:
                tokens[out.request_id] += out.new_token_ids
        assert tokens["b"] == [] and not client.engine_core.has_work()  # "b" is held
        assert client.call(IS_SCHEDULER_PAUSED()) and client.call(RESUME_SCHEDULER())
        while len(tokens["b"]) < 8:
            for out in client.get_output().outputs:
                tokens[out.request_id] += out.new_token_ids
        assert tokens["b"] == tokens["a"]
        with pytest.raises(ValueError, match="Invalid enum value 'later'"):
            PAUSE_SCHEDULER(mode="later")  # refused before it is sent
        with pytest.raises(RuntimeError, match="unknown pause mode"):  # and by the engine
            client.call(Call(PAUSE_SCHEDULER, msgspec.structs.replace(PAUSE_SCHEDULER().args, mode="later")))
    finally:
        client.shutdown()


@pytest.mark.parametrize("pipelined", [False, True])
def test_scheduler_pause_modes_hold_new_requests_and_keep_outputs_exact(pipelined: bool) -> None:
    from tests.support.scheduler_harness import (
        Harness,
        expected_outputs,
        make_config,
        make_request,
    )

    h = Harness(make_config(), num_blocks=40)
    run = h.run_pipelined if pipelined else h.run
    h.add(make_request("a", 6, max_tokens=12))
    h.add(make_request("b", 5, max_tokens=12))
    for _ in range(3):
        h.step()

    assert h.scheduler.pause("keep") == []
    h.add(make_request("new", 4, max_tokens=3))
    frozen = {r: list(h.results[r].token_ids) for r in ("a", "b")}
    assert not h.scheduler.has_requests()  # nothing to schedule: the engine idles
    assert h.scheduler.make_stats().num_waiting_reqs == 1 and len(h.scheduler.running) == 2
    h.scheduler.pause("wait")  # "a" and "b" may finish, "new" is still held
    run()
    assert {r: h.results[r].token_ids for r in ("a", "b")} == {
        "a": expected_outputs("a", 6, 12), "b": expected_outputs("b", 5, 12)
    }
    assert all(len(frozen[r]) < 12 for r in frozen) and h.results["new"].token_ids == []
    h.scheduler.resume()
    run()
    assert h.results["new"].token_ids == expected_outputs("new", 4, 3)

    h.add(make_request("c", 6, max_tokens=20))
    h.step()
    aborted = h.scheduler.pause("abort")
    h.add(make_request("d", 3, max_tokens=2))  # held, not aborted
    assert [r.request_id for r in aborted] == ["c"] and "c" not in h.scheduler.requests
    run()
    assert h.results["d"].token_ids == []
    h.scheduler.resume()
    run()
    assert h.results["d"].token_ids == expected_outputs("d", 3, 2)
    h.assert_no_leak()


async def test_a_quantized_model_reloads_its_weights_and_sleeps_at_level_2(stories_dir, tmp_path) -> None:
    """Block-format weights are not parameters: a reload must still replace them (checked by
    serving a changed checkpoint, then the original again), sleep level 1 (a copy of the
    float parameters) is refused in OpenAI's error shape, and level 2 drops and reloads them."""
    changed = tmp_path / "changed"
    shutil.copytree(stories_dir, changed)
    tensors = load_file(changed / "model.safetensors")
    for name in tensors:
        if ".mlp." in name:
            tensors[name] = -tensors[name]
    save_file(tensors, changed / "model.safetensors")

    engine = make_engine(stories_dir, quantization="q8_0", enable_sleep_mode=True)
    async with running_server(engine, enable_sleep_mode=True, enable_dev_endpoints=True) as (client, _base):
        oa = openai_client(_base)

        async def greedy() -> str:
            return (await oa.completions.create(**GREEDY)).choices[0].text

        async def reload(model_dir: Path | str) -> None:
            await client.post("/pause", params={"mode": "wait"})
            rpc = await client.post("/collective_rpc", json={"method": "reload_weights",
                                                             "kwargs": {"model_dir": str(model_dir)}})
            assert rpc.status_code == 200, rpc.text
            await client.post("/resume")

        reference = await greedy()
        await reload(changed)
        assert await greedy() != reference
        await reload(stories_dir)
        assert await greedy() == reference

        refused = await client.post("/sleep", params={"level": 1})
        assert refused.status_code == 400 and "use level 2" in refused.json()["error"]["message"]
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        asleep = await client.post("/sleep", params={"level": 2})
        assert asleep.status_code == 200, asleep.text
        memory = asleep.json()["memory"]
        assert memory["before"]["weights_bytes"] > 0 and memory["after"]["weights_bytes"] == 0
        assert (await client.post("/wake_up")).status_code == 200
        assert await greedy() == reference
