"""The HTTP layer (server, serving, protocol, CLI) over a scripted fake engine.

The fake engine uses the real InputProcessor and OutputProcessor but invents
its tokens, so these tests need no EngineCore process; the app is served by
a real hypercorn in the test's event loop and driven with httpx and the
official openai client (end-to-end tests with the real engine live in
test_e2e_server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket

import httpx
import msgspec
import openai
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config

from app.cli import build_engine_config, load_chat_template, parse_args, parse_size
from app.input_processor import InputProcessor
from app.output_processor import OutputProcessor, RequestOutput, RequestOutputCollector
from app.server import build_app
from core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    SchedulerStats,
)
from tests.test_detokenizer import build_byte_level_tokenizer

MODEL = "fake-model"
MAX_MODEL_LEN = 64
CONTINUATION = " the cat sat on the mat, 猫咪很可爱 and then it slept."
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_byte_level_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


class FakeEngine:
    """Generates CONTINUATION's tokens over and over, one per step.

    ``die_after`` makes it raise EngineDeadError after that many steps (and
    report itself dead); ``step_delay`` slows it down for disconnect tests.
    """

    def __init__(self, tokenizer, die_after: int | None = None, step_delay: float = 0.0) -> None:
        self.input_processor = InputProcessor(tokenizer, MAX_MODEL_LEN)
        self.output_processor = OutputProcessor(tokenizer)
        self.chat_template = None
        self.script = tokenizer.encode(CONTINUATION, add_special_tokens=False)
        self.die_after = die_after
        self.step_delay = step_delay
        self.is_dead = False
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()

    async def generate(self, request: EngineCoreRequest):
        collector = RequestOutputCollector()
        self.output_processor.add_request(request, collector)
        self.requests.append(request)
        finished = False
        try:
            for step in range(request.sampling_params.max_tokens):
                await asyncio.sleep(self.step_delay)
                if self.die_after is not None and step >= self.die_after:
                    self.is_dead = True
                    self.output_processor.propagate_error(EngineDeadError("the fake engine died"))
                else:
                    last = step == request.sampling_params.max_tokens - 1
                    token = self.script[step % len(self.script)]
                    eco = EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[token],
                        finish_reason=FinishReason.LENGTH if last else None,
                    )
                    for rid in self.output_processor.process_outputs([eco]):
                        self.aborted.append(rid)  # stopped by a stop string
                out = collector.get_nowait()
                if out is not None:
                    finished = out.finished
                    yield out
                    if finished:
                        return
        finally:
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.output_processor.abort_requests([request_id])
        self.aborted.append(request_id)
        self.abort_seen.set()

    async def get_scheduler_stats(self):
        # Over the real wire the struct arrives as a msgpack array.
        return msgspec.msgpack.decode(msgspec.msgpack.encode(SchedulerStats(num_running_reqs=2, step_counter=9)))


@contextlib.asynccontextmanager
async def running_server(engine: FakeEngine, api_key: str | None = None, **app_options):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    stop = asyncio.Event()
    app = build_app(engine, MODEL, MAX_MODEL_LEN, api_key=api_key, **app_options)
    task = asyncio.create_task(serve(app, config, shutdown_trigger=stop.wait))
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for _ in range(200):  # until hypercorn listens
            with contextlib.suppress(httpx.ConnectError):
                await client.get("/health")
                break
            await asyncio.sleep(0.01)
        try:
            yield client, base
        finally:
            stop.set()
            await task


@pytest.fixture
async def fake(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture
async def server(fake):
    async with running_server(fake) as (client, base):
        yield client, base


def expected_text(tokenizer, n: int) -> str:
    script = tokenizer.encode(CONTINUATION, add_special_tokens=False)
    return tokenizer.decode([script[i % len(script)] for i in range(n)])


def assert_openai_error(response: httpx.Response, status: int, type_: str, needle: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["code"] == status
    assert needle in error["message"], error["message"]


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER_X = [{"role": "user", "content": "x"}]


def completion(**fields):
    return {"model": MODEL, "prompt": "x", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": USER_X, **fields}


# ------------------------------------------------------------------ routes


async def test_health_and_models(server, fake) -> None:
    client, _ = server
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    cards = [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]]
    assert cards == [(MODEL, "model", MAX_MODEL_LEN)]
    fake.is_dead = True
    assert (await client.get("/health")).status_code == 503


async def test_completion_non_stream(server, tokenizer) -> None:
    client, _ = server
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 20})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["text"] == expected_text(tokenizer, 20) and choice["finish_reason"] == "length"
    prompt_tokens = len(tokenizer.encode("Once upon"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 20
    assert body["usage"]["total_tokens"] == prompt_tokens + 20


async def test_completion_defaults_and_token_prompts(server, fake, tokenizer) -> None:
    client, _ = server
    ids = tokenizer.encode("Once upon")
    for prompt in (ids, [ids], ["Once upon"]):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 200, r.text
        assert fake.requests[-1].prompt_token_ids == ids
    assert fake.requests[-1].sampling_params.max_tokens == 16  # OpenAI's default for completions
    # Near the end of the context the default shrinks to what fits.
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 3)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_completion_stream_with_openai_client(server, tokenizer) -> None:
    _, base = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=25, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert all(c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(tokenizer, 25)
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25


async def test_stream_ends_with_done(server) -> None:
    client, _ = server
    r = await client.post(COMPLETIONS, json=completion(max_tokens=3, stream=True))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert msgspec.json.decode(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_chat_completion_stream_and_non_stream(server, fake, tokenizer) -> None:
    _, base = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected_text(tokenizer, 12)
    rendered = "<system>Be brief.\n<user>Hello\n<assistant>"
    assert fake.requests[-1].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert full.usage.prompt_tokens == len(fake.requests[-1].prompt_token_ids)

    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_default_max_tokens_fills_the_context(server, fake) -> None:
    client, _ = server
    r = await client.post(CHAT, json=chat())
    assert r.status_code == 200
    request = fake.requests[-1]
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    r = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 2},
    )
    assert r.status_code == 200 and fake.requests[-1].sampling_params.max_tokens == 2


async def test_stop_string_through_the_api(server, fake) -> None:
    client, _ = server
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 40, "stop": "mat", "stream": False}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == " the cat sat on the "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "mat")
    assert fake.aborted == [fake.requests[-1].request_id]  # the engine was told to stop


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("path", "body", "needle", "param"),
    [
        (COMPLETIONS, completion(n=2), "n=1", "n"),
        (COMPLETIONS, completion(logprobs=2), "logprobs are not supported", "logprobs"),
        (COMPLETIONS, completion(echo=True), "echo", "echo"),
        (COMPLETIONS, completion(prompt=["a", "b"]), "Only one prompt", "prompt"),
        (COMPLETIONS, completion(prompt=[]), "empty", "prompt"),
        (COMPLETIONS, completion(prompt=[10**9]), "out of vocabulary", "prompt"),
        (COMPLETIONS, completion(max_tokens="many"), "$.max_tokens", None),
        (COMPLETIONS, {"model": MODEL}, "prompt or prompt_embeds is required", "prompt"),
        (COMPLETIONS, completion(prompt="", prompt_embeds="AAAA"), "--enable-prompt-embeds", "prompt_embeds"),
        (COMPLETIONS, completion(prompt="x", prompt_embeds="AAAA"), "not both", "prompt_embeds"),
        (COMPLETIONS, completion(temperature=-1), "temperature", None),
        (COMPLETIONS, completion(stop=[""]), "stop", None),
        (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream", "stream_options"),
        (COMPLETIONS, completion(presence_penalty=0.5), "presence_penalty", "presence_penalty"),
        (COMPLETIONS, completion(prompt="x " * 80), "maximum context length is 64 tokens", None),
        (COMPLETIONS, completion(max_tokens=100), "maximum context length is 64 tokens", None),
        (CHAT, chat(messages=[]), "messages", "messages"),
        (CHAT, chat(logprobs=True), "logprobs", "logprobs"),
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


async def test_chat_without_any_template_is_400(tokenizer) -> None:
    engine = FakeEngine(build_byte_level_tokenizer())  # this copy has no chat template
    async with running_server(engine) as (client, _):
        r = await client.post(CHAT, json=chat())
        assert_openai_error(r, 400, "BadRequestError", "no chat template")
        r = await client.post(CHAT, json=chat(chat_template=CHAT_TEMPLATE, max_tokens=2))
        assert r.status_code == 200


async def test_api_key(tokenizer) -> None:
    async with running_server(FakeEngine(tokenizer), api_key="sekret") as (client, base):
        assert (await client.get("/health")).status_code == 200
        assert_openai_error(await client.get("/v1/models"), 401, "AuthenticationError", "API key")
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert (await oai.completions.create(model=MODEL, prompt="x", max_tokens=2)).usage.completion_tokens == 2


async def test_engine_stats_route(server) -> None:
    client, _ = server
    stats = (await client.get("/engine/stats")).json()
    assert stats["num_running_reqs"] == 2 and stats["step_counter"] == 9 and stats["num_waiting_reqs"] == 0


# ------------------------------------------------------- engine failure, disconnects


async def test_engine_death_mid_stream_raises_api_error(tokenizer) -> None:
    engine = FakeEngine(tokenizer, die_after=4)
    async with running_server(engine) as (client, base):
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for create in (
            lambda: oai.completions.create(model=MODEL, prompt="x", max_tokens=30, stream=True),
            lambda: oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30, stream=True
            ),
        ):
            engine.is_dead = False
            stream = await create()
            received = []
            with pytest.raises(openai.APIError, match="engine is dead"):
                async for chunk in stream:
                    received.append(chunk)
            assert received  # it failed mid-stream, after some text
        # Once dead: new requests fail fast with a 500 and /health says 503.
        assert (await client.get("/health")).status_code == 503
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert_openai_error(r, 500, "InternalServerError", "dead")


async def test_engine_death_in_non_stream_request_is_500(tokenizer) -> None:
    async with running_server(FakeEngine(tokenizer, die_after=2)) as (client, _):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10})
        assert_openai_error(r, 500, "InternalServerError", "the fake engine died")


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request(tokenizer, stream) -> None:
    engine = FakeEngine(tokenizer, step_delay=0.005)
    async with running_server(engine) as (_, base):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "stream": stream}
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    for _ in range(3):
                        await anext(lines)
            else:
                task = asyncio.create_task(client.post("/v1/completions", json=body))
                while not engine.requests:
                    await asyncio.sleep(0.005)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.wait_for(engine.abort_seen.wait(), timeout=20)
        assert engine.aborted == [engine.requests[0].request_id]
        assert not engine.output_processor.has_unfinished_requests()


# --------------------------------------------------------------------- CLI


def test_cli_builds_engine_config(tmp_path) -> None:
    args = parse_args(
        [
            "--model", "/models/m", "--max-model-len", "1024", "--kv-cache-memory", "512MiB",
            "--no-enable-prefix-caching", "--dtype", "half", "--transport", "zmq", "--port", "0",
        ]
    )
    config = build_engine_config(args)
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
