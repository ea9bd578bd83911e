"""The real app over the real engine in this process (``AsyncInprocClient``), served by hypercorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
from hypercorn.asyncio import serve
from hypercorn.config import Config

from app.async_llm import AsyncLLM
from app.server import build_app
from core.config import EngineArgs
from tests.support.waiting import wait_until

MODEL = "stories"
MAX_MODEL_LEN = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_engine(stories_dir: str, chat_template: str | None = CHAT_TEMPLATE, **engine_args) -> AsyncLLM:
    args = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8, "served_model_name": MODEL, **engine_args}
    return AsyncLLM(EngineArgs(model=stories_dir, **args).resolve(), chat_template, in_process=True)


@contextlib.asynccontextmanager
async def running_server(engine: AsyncLLM, api_key: str | None = None, **app_options):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    stop = asyncio.Event()
    app = build_app(
        engine, MODEL, engine.max_model_len, api_key=api_key, chat_template=engine.chat_template, **app_options
    )
    task = asyncio.create_task(serve(app, config, shutdown_trigger=stop.wait))
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            async def listening() -> bool:
                with contextlib.suppress(httpx.ConnectError):
                    await client.get("/health")
                    return True
                return False

            await wait_until(listening, "hypercorn to listen")
            yield client, base
    finally:
        stop.set()
        await task
        engine.shutdown()


def assert_openai_error(response: httpx.Response, status: int, type_: str, needle: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["code"] == status
    assert needle in error["message"], error["message"]
