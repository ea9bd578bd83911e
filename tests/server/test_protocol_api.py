"""The HTTP layer (server, serving, protocol, CLI) over the real engine, in process.

The engine is the real AsyncLLM with its EngineCore stepped on the test's
event loop (``AsyncInprocClient``: everything but the IPC, which
test_e2e_server.py covers with a spawned engine process). The model is
stories260K, so every expected text comes from transformers' own greedy
generation on the same checkpoint. The app is served by a real hypercorn and
driven with httpx and the official openai client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil

import httpx
import msgspec
import openai
import pytest
import torch

from app.async_llm import AsyncLLM
from app.cli import build_engine_args, load_chat_template, parse_args, parse_size
from app.output_processor import RequestOutput
from core.worker.faults import FAULT_ENV
from tests.support.http import (
    CHAT_TEMPLATE,
    MAX_MODEL_LEN,
    MODEL,
    assert_openai_error,
    make_engine,
    running_server,
)
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def oracle(stories_dir):
    """transformers' greedy continuation of a token prompt, as text and as ids."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)

    def greedy(prompt_ids: list[int], n: int) -> tuple[str, list[int]]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        ids = out[0, len(prompt_ids):].tolist()
        return tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):], ids

    greedy.tokenizer = tokenizer
    return greedy


@pytest.fixture
def tokenizer(oracle):
    return oracle.tokenizer


@pytest.fixture
async def engine(stories_dir):
    return make_engine(stories_dir)


@pytest.fixture
async def server(engine):
    async with running_server(engine) as (client, base):
        yield client, base


async def engine_idle(engine: AsyncLLM) -> None:
    """Wait until the EngineCore holds no request (finished or aborted)."""
    scheduler = engine.engine_core.engine_core.scheduler
    await wait_until(lambda: not scheduler.has_unfinished_requests(), "the engine to hold no request")


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER_X = [{"role": "user", "content": "x"}]


def completion(**fields):
    return {"model": MODEL, "prompt": "x", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": USER_X, **fields}


# ------------------------------------------------------------------ routes


async def test_health_and_models(server) -> None:
    client, _ = server
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    cards = [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]]
    assert cards == [(MODEL, "model", MAX_MODEL_LEN)]


async def test_completion_non_stream(server, oracle, tokenizer) -> None:
    client, _ = server
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    prompt_ids = tokenizer.encode("Once upon")
    assert choice["text"] == oracle(prompt_ids, 20)[0] and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 20
    assert body["usage"]["total_tokens"] == len(prompt_ids) + 20


async def test_completion_defaults_and_token_prompts(server, oracle, tokenizer) -> None:
    client, _ = server
    ids = tokenizer.encode("Once upon")
    expected = oracle(ids, 16)[0]  # 16: OpenAI's default max_tokens for completions
    for prompt in (ids, [ids], ["Once upon"]):
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 16)
        assert r.json()["choices"][0]["text"] == expected
    # Near the end of the context the default shrinks to what fits.
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 3), "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_completion_stream_with_openai_client(server, oracle, tokenizer) -> None:
    _, base = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=25, stream=True, stream_options={"include_usage": True},
        temperature=0, extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert all(c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == oracle(tokenizer.encode("Once upon"), 25)[0]
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25


async def test_stream_ends_with_done(server) -> None:
    client, _ = server
    r = await client.post(COMPLETIONS, json=completion(max_tokens=3, stream=True, ignore_eos=True))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert msgspec.json.decode(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_chat_completion_stream_and_non_stream(server, oracle, tokenizer) -> None:
    _, base = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    greedy = dict(temperature=0, extra_body={"ignore_eos": True})
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **greedy)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    rendered = tokenizer.encode("<system>Be brief.\n<user>Hello\n<assistant>", add_special_tokens=False)
    assert full.choices[0].message.content == oracle(rendered, 12)[0]
    assert full.usage.prompt_tokens == len(rendered)

    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True, **greedy
    )
    chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_default_max_tokens_fills_the_context(server) -> None:
    client, _ = server
    r = await client.post(CHAT, json=chat(ignore_eos=True))
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    r = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 2,
              "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_stop_string_through_the_api(server, engine, oracle, tokenizer) -> None:
    client, _ = server
    text, _ = oracle(tokenizer.encode("Once upon a time"), 40)
    stop = "Lily"
    assert stop in text and text.index(stop) > 0
    r = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "stop": stop, "temperature": 0,
              "ignore_eos": True},
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    # The engine was told to stop: it holds no request, although 40 tokens were asked for.
    assert not engine.engine_core.engine_core.scheduler.has_unfinished_requests()


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("path", "body", "needle", "param"),
    [
        (COMPLETIONS, completion(n=0), "n must be", "n"),
        (COMPLETIONS, completion(logprobs=21), "logprobs must be in [0, 20]", "logprobs"),
        (COMPLETIONS, completion(best_of=2), "best_of is not supported", "best_of"),
        (COMPLETIONS, completion(prompt=["a", [5]]), "a list of either", "prompt"),
        (COMPLETIONS, completion(prompt=[]), "empty", "prompt"),
        (COMPLETIONS, completion(prompt=[10**9]), "out of vocabulary", "prompt"),
        (COMPLETIONS, completion(max_tokens="many"), "$.max_tokens", None),
        (COMPLETIONS, {"model": MODEL}, "prompt or prompt_embeds is required", "prompt"),
        (COMPLETIONS, completion(prompt="", prompt_embeds="AAAA"), "--enable-prompt-embeds", "prompt_embeds"),
        (COMPLETIONS, completion(prompt="x", prompt_embeds="AAAA"), "not both", "prompt_embeds"),
        (COMPLETIONS, completion(temperature=-1), "temperature", "temperature"),
        (COMPLETIONS, completion(stop=[""]), "stop", "stop"),
        (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream", "stream_options"),
        (COMPLETIONS, completion(presence_penalty=2.5), "presence_penalty must be in [-2, 2]", "presence_penalty"),
        (COMPLETIONS, completion(logit_bias={"5": 101}), "logit_bias values", "logit_bias"),
        (COMPLETIONS, completion(logit_bias={"x": 1}), "token ids", "logit_bias"),
        (COMPLETIONS, completion(allowed_token_ids=[10**6]), "allowed_token_ids is out of vocabulary", "allowed_token_ids"),
        (COMPLETIONS, completion(min_p=1.5), "min_p", "min_p"),
        (COMPLETIONS, completion(response_format={"type": "json_schema"}), "json_schema.schema", "response_format"),
        (COMPLETIONS, completion(guided_regex="a+"), "use structured_outputs", "guided_regex"),
        (COMPLETIONS, completion(structured_outputs={"regex": "a", "choice": ["b"]}), "exactly one", "structured_outputs"),
        (COMPLETIONS, completion(prompt="x " * 80), "maximum context length is 64 tokens", None),
        (COMPLETIONS, completion(max_tokens=100), "maximum context length is 64 tokens", None),
        (CHAT, chat(messages=[]), "messages", "messages"),
        (CHAT, chat(top_logprobs=2), "needs logprobs", "top_logprobs"),
        (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs must be", "top_logprobs"),
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "text content", "messages"),
        (CHAT, chat(chat_template="{{ raise_exception('nope') }}"), "nope", "messages"),
    ],
)
async def test_bad_requests_are_400_with_openai_shape(server, path, body, needle, param) -> None:
    client, _ = server
    r = await client.post(path, json=body)
    assert_openai_error(r, 400, "BadRequestError", needle)
    assert r.json()["error"]["param"] == param


async def test_invalid_json_is_400(server) -> None:
    client, _ = server
    r = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "BadRequestError", "not valid JSON")


async def test_unknown_model_is_404_and_openai_raises_not_found(server) -> None:
    client, base = server
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert_openai_error(r, 404, "NotFoundError", "The model `nope` does not exist.")
    oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await oai.completions.create(model=MODEL, prompt="x " * 80)


async def test_unknown_route_and_method(server) -> None:
    client, _ = server
    assert_openai_error(await client.get("/v2/nothing"), 404, "NotFoundError", "/v2/nothing")
    assert_openai_error(await client.get("/v1/completions"), 405, "MethodNotAllowedError", "GET")


async def test_chat_without_any_template_is_400(stories_dir, tmp_path) -> None:
    bare = tmp_path / "stories-without-template"  # the checkpoint as published: a base model, no template
    shutil.copytree(stories_dir, bare, ignore=shutil.ignore_patterns("chat_template.jinja", "ringllm.json"))
    engine = make_engine(str(bare), chat_template=None)
    async with running_server(engine) as (client, _):
        r = await client.post(CHAT, json=chat())
        assert_openai_error(r, 400, "BadRequestError", "no chat template")
        r = await client.post(CHAT, json=chat(chat_template=CHAT_TEMPLATE, max_tokens=2))
        assert r.status_code == 200


async def test_api_key(engine) -> None:
    async with running_server(engine, api_key="sekret") as (client, base):
        assert (await client.get("/health")).status_code == 200
        assert_openai_error(await client.get("/v1/models"), 401, "AuthenticationError", "API key")
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        completion = await oai.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 2


async def test_engine_stats_route(server) -> None:
    client, _ = server
    stats = (await client.get("/engine/stats")).json()
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"], stats["step_counter"]) == (0, 0, 0)
    r = await client.post(COMPLETIONS, json=completion(max_tokens=5, ignore_eos=True))
    assert r.status_code == 200
    stats = (await client.get("/engine/stats")).json()
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 0)
    assert stats["step_counter"] >= 5  # one step per token, at least
    assert stats["prefix_cache_queries"] == r.json()["usage"]["prompt_tokens"]


# ------------------------------------------------------- engine failure, disconnects


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_engine_death_mid_stream_raises_api_error(stories_dir, monkeypatch, route) -> None:
    monkeypatch.setenv(FAULT_ENV, "step:5")  # the real engine's 5th forward step raises
    async with running_server(make_engine(stories_dir)) as (client, base):
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        if route == "completions":
            stream = await oai.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=30, stream=True, extra_body={"ignore_eos": True}
            )
        else:
            stream = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30, stream=True,
                extra_body={"ignore_eos": True},
            )
        received = []
        with pytest.raises(openai.APIError, match="engine is dead"):
            async for chunk in stream:
                received.append(chunk)
        assert received  # it failed mid-stream, after some text
        # Once dead: new requests fail fast with a 500 and /health says 503.
        assert (await client.get("/health")).status_code == 503
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert_openai_error(r, 500, "InternalServerError", "dead")


async def test_engine_death_in_non_stream_request_is_500(stories_dir, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "step:3")
    async with running_server(make_engine(stories_dir)) as (client, _):
        r = await client.post("/v1/completions", json=completion(max_tokens=10, ignore_eos=True))
        assert_openai_error(r, 500, "InternalServerError", f"fault injected at model step 3 ({FAULT_ENV})")


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request(stories_dir, stream) -> None:
    max_tokens = 400
    engine = make_engine(stories_dir, max_model_len=512)
    core = engine.engine_core.engine_core
    async with running_server(engine) as (_, base):
        body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    for _ in range(3):
                        await anext(lines)
            else:
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                while not core.scheduler.has_unfinished_requests():
                    await asyncio.sleep(0.002)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await engine_idle(engine)
        assert core.step_counter < max_tokens  # aborted, not run to the end
        assert not engine.output_processor.has_unfinished_requests()


# --------------------------------------------------------------------- CLI


def test_cli_builds_engine_config(tmp_path) -> None:
    args = parse_args(
        [
            "--model", "/models/m", "--max-model-len", "1024", "--kv-cache-memory", "512MiB",
            "--no-enable-prefix-caching", "--dtype", "half", "--transport", "zmq", "--port", "0",
        ]
    )
    config = build_engine_args(args)
    assert (config.model, config.max_model_len, config.kv_cache_memory) == ("/models/m", 1024, 512 * 2**20)
    assert (config.enable_prefix_caching, config.dtype, config.transport) == (False, "float16", "zmq")
    assert config.block_size == 16 and config.max_num_seqs == 64  # unset: EngineConfig's defaults
    assert (args.host, args.port, args.api_key is None or isinstance(args.api_key, str)) == ("127.0.0.1", 0, True)
    assert parse_size("2G") == 2 * 10**9 and parse_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")
    template = tmp_path / "t.jinja"
    template.write_text(CHAT_TEMPLATE)
    assert load_chat_template(str(template)) == CHAT_TEMPLATE == load_chat_template(CHAT_TEMPLATE)
    with pytest.raises(ValueError):
        load_chat_template("no/such/file.jinja")


def test_request_output_is_a_delta_record() -> None:
    out = RequestOutput("r", [1], "a", [2])
    assert (out.finished, out.finish_reason, out.stop_reason, out.num_output_tokens) == (False, None, None, 0)
