"""End to end: a real `python -m app` process, its EngineCore subprocess, the real
transport (shared-memory rings, and the ZeroMQ baseline: every test runs over
both), and the official openai client."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--kv-cache-dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "256", "--seed", "0"]


TRANSPORTS = ["shm", "zmq"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request, random_model_dir: str, module_server_factory):
    return module_server_factory(
        ["--model", random_model_dir, "--served-model-name", "ringllm-default", *SERVER_ARGS, "--transport", request.param]
    )


def test_models_lists_served_name(server) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["ringllm-default"]


def test_chat_completion_streams(server) -> None:
    stream = server.openai().chat.completions.create(
        model="ringllm-default",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text  # random weights: content is noise, but it is there
    assert all(c.id == chunks[0].id for c in chunks)


def test_completion_streams_and_reports_usage(server) -> None:
    client = server.openai()
    stream = client.completions.create(
        model="ringllm-default",
        prompt="The quick brown fox",
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    full = client.completions.create(
        model="ringllm-default", prompt="The quick brown fox", max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 10
    assert full.choices[0].finish_reason == "length"


def test_greedy_is_deterministic_across_stream_and_non_stream(server) -> None:
    client = server.openai()
    args = dict(model="ringllm-default", prompt="abc", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    a = client.completions.create(**args).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
    assert a == b


def test_bad_requests_get_openai_errors(server) -> None:
    client = server.openai()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="ringllm-default", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="ringllm-default", prompt="x " * 3000, max_tokens=2)
    assert "maximum context length" in str(info.value)


def test_client_disconnect_aborts_request_in_engine(server) -> None:
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={"model": "ringllm-default", "prompt": "hi", "max_tokens": 2000, "stream": True, "ignore_eos": True},
        timeout=30,
    ) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.engine_stats()["num_running_reqs"] == 1
    # The response is closed: the engine must drop the request, well before
    # it could have produced its 2000 tokens.
    def dropped() -> bool:
        stats = server.engine_stats()
        return stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0

    wait_for(dropped, "the engine to drop the request of the closed response")


LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # ~270 byte-level tokens


def _complete(server, prompt: str, max_tokens: int = 6):
    return server.openai().completions.create(
        model="ringllm-default", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )


def test_prefix_cache_hits_are_reported_and_reset_prefix_cache_route(server) -> None:
    httpx.post(server.base_url + "/reset_prefix_cache", timeout=10).raise_for_status()
    before = server.engine_stats()
    first, second = _complete(server, LONG_PROMPT), _complete(server, LONG_PROMPT)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    after = server.engine_stats()
    assert after["prefix_cache_hits"] - before.get("prefix_cache_hits", 0) == cached
    assert after["prefix_cache_queries"] - before.get("prefix_cache_queries", 0) == 2 * first.usage.prompt_tokens

    assert httpx.post(server.base_url + "/reset_prefix_cache", timeout=10).status_code == 200
    third = _complete(server, LONG_PROMPT)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].text == first.choices[0].text


def test_reset_prefix_cache_is_refused_while_a_request_runs_unless_told(server) -> None:
    # Long enough to be still running when the forced reset arrives, however slow the client is.
    body = {"model": "ringllm-default", "prompt": LONG_PROMPT, "max_tokens": 1200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        refused = httpx.post(server.base_url + "/reset_prefix_cache", timeout=10)
        assert refused.status_code == 409
        assert refused.json()["error"]["type"] == "ConflictError"
        bad = httpx.post(server.base_url + "/reset_prefix_cache?reset_running_requests=maybe", timeout=10)
        assert bad.status_code == 400
        forced = httpx.post(server.base_url + "/reset_prefix_cache?reset_running_requests=true", timeout=10)
        assert forced.status_code == 200
        # The request was preempted, recomputed, and still streams to the end.
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2].replace(" ", "")
    assert server.engine_stats()["num_preemptions"] >= 1


def test_async_scheduling_server_matches_the_sync_server(server, random_model_dir: str, server_factory) -> None:
    prompts = ["Once upon a time", "abc " * 40, LONG_PROMPT, "Hello"]
    expected = [_complete(server, p, 16).choices[0].text for p in prompts]
    srv = server_factory(["--model", random_model_dir, "--served-model-name", "ringllm-default",
                          "--async-scheduling", "--keep-alive-on-engine-death", *SERVER_ARGS])

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        results = await asyncio.gather(*(
            client.completions.create(model="ringllm-default", prompt=p, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
            for p in prompts
        ))
        await client.close()
        return [r.choices[0].text for r in results]

    assert asyncio.run(run_all()) == expected
    # SIGTERM to the engine with a request (and so a batch) in flight: it
    # drains, finishing the request, then exits.
    stream = srv.openai().completions.create(
        model="ringllm-default", prompt="x", max_tokens=16, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    engine_pid = srv.engine_pid()
    os.kill(engine_pid, signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    wait_for(lambda: httpx.get(srv.base_url + "/health", timeout=5).status_code != 200,
             "the frontend to notice the engine's exit")
    assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 503
    assert "draining 1 requests" in srv.log() and "fatal error" not in srv.log()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_server_uses_almost_no_cpu(server) -> None:
    def idle() -> bool:  # the previous tests' requests are all done
        stats = server.engine_stats()
        return stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0

    wait_for(idle, "the engine to finish the previous tests' requests")
    pids = [server.proc.pid, server.engine_pid()]
    before = sum(_cpu_seconds(p) for p in pids)
    time.sleep(5.0)
    used = sum(_cpu_seconds(p) for p in pids) - before
    assert used < 0.05 * 5.0, f"idle frontend+engine used {used:.3f} CPU-s in 5 s"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_kill_fails_stream_and_health(random_model_dir: str, server_factory, transport: str) -> None:
    """Kills its own server's engine."""
    srv = server_factory(
        ["--model", random_model_dir, "--served-model-name", "m", *SERVER_ARGS, "--transport", transport,
         "--keep-alive-on-engine-death"]  # to see /health say 503 (by default the server exits 1)
    )
    client = srv.openai()
    stream = client.completions.create(
        model="m", prompt="hello", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    os.kill(srv.engine_pid(), signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in it:
            pass
    assert time.monotonic() - started < 10
    assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 503
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model="m", prompt="x", max_tokens=2)


STORY_PROMPTS = ["Once upon a time", "Lily and Tom went to the", "The little dog was sad because", "One day, a café"]


def _transformers_greedy_texts(model_dir: str, prompts: list[str], max_new: int) -> list[tuple[str, int]]:
    """(continuation text, number of new tokens) per prompt, from transformers itself."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                eos_token_id=tok.eos_token_id, pad_token_id=0,
            )[0].tolist()
        new = out[len(ids):]
        # What a client sees: the full decode minus the prompt's own decode.
        full = tok.decode(out, skip_special_tokens=True)
        results.append((full[len(tok.decode(ids, skip_special_tokens=True)):], len(new)))
    return results


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_stories260k_served_greedy_matches_transformers(
    stories_dir: str, server_factory, transport: str
) -> None:
    """A real trained checkpoint through the whole stack, several requests batched at once."""
    srv = server_factory(
        ["--model", stories_dir, "--served-model-name", "stories", "--max-num-batched-tokens", "16",
         "--transport", transport]
    )
    expected = _transformers_greedy_texts(stories_dir, STORY_PROMPTS, 40)
    client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def complete(prompt: str):
        return await client.completions.create(model="stories", prompt=prompt, max_tokens=40, temperature=0)

    async def stream(prompt: str) -> str:
        chunks = await client.completions.create(
            model="stories", prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    responses = await asyncio.gather(*(complete(p) for p in STORY_PROMPTS))
    streamed = await asyncio.gather(*(stream(p) for p in STORY_PROMPTS))
    for response, text, (want_text, want_tokens) in zip(responses, streamed, expected):
        assert response.choices[0].text == want_text
        assert response.usage.completion_tokens == want_tokens
        assert text == want_text
    assert expected[0][0].startswith(", there was a little girl named Lily.")
    await client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prompt_embeds_match_transformers_inputs_embeds(tiny_llama_dir: str, server_factory, transport: str) -> None:
    """prompt_embeds cross to the engine out of band and replace the token lookup."""
    import base64
    import io

    import torch
    import transformers

    srv = server_factory(
        ["--model", tiny_llama_dir, "--served-model-name", "tiny", "--enable-prompt-embeds",
         "--max-num-batched-tokens", "64", "--transport", transport]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    client = srv.openai()
    for seq_len in (5, 150):  # 150 x 64 floats: out of band, and split over three prefill chunks
        embeds = torch.randn(seq_len, 64, generator=torch.Generator().manual_seed(seq_len))
        with torch.no_grad():
            expected = hf.generate(
                inputs_embeds=embeds[None], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0].tolist()
        buf = io.BytesIO()
        torch.save(embeds, buf)
        response = client.completions.create(
            model="tiny", prompt="", max_tokens=12, temperature=0,
            extra_body={"prompt_embeds": base64.b64encode(buf.getvalue()).decode(), "ignore_eos": True},
        )
        assert response.choices[0].text == tok.decode(expected, skip_special_tokens=True)
        assert response.usage.prompt_tokens == seq_len
        assert response.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="shape"):
        buf = io.BytesIO()
        torch.save(torch.zeros(3, 65), buf)
        client.completions.create(
            model="tiny", prompt="", max_tokens=2,
            extra_body={"prompt_embeds": base64.b64encode(buf.getvalue()).decode()},
        )


def test_logprobs_through_the_transport(server, random_model_dir: str) -> None:
    """Echo with logprobs on a long prompt: its prompt logprobs are large enough to
    cross out of band (the shared pool on shm, an aux frame on zmq), and still equal
    transformers'; streamed n=2 choices carry their logprobs as well."""
    from tests.support.oracle import ATOL, hf_logprobs, load_hf

    prompt = [(i * 37) % 250 + 3 for i in range(400)]
    client = server.openai()
    out = client.completions.create(
        model="ringllm-default", prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
    rows = hf_logprobs(load_hf(random_model_dir), prompt)
    expected = rows[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1 : len(prompt)]), expected, atol=ATOL, rtol=0)
    stream = client.completions.create(
        model="ringllm-default", prompt="Hello", max_tokens=5, n=2, logprobs=1, stream=True, seed=1,
        extra_body={"ignore_eos": True},
    )
    tokens = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            tokens[choice.index] += len(choice.logprobs.tokens)
    assert tokens == {0: 5, 1: 5}
