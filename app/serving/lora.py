"""vLLM's routes that change the served LoRA adapters (app/lora_adapters.py holds the table).

Only with ``--allow-runtime-lora-updating``; both answer vLLM's plain-text
success message, and errors in OpenAI's format.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from app.lora_adapters import LoRARegistry
from app.serving.base import EngineClient, decode_request

Endpoint = Callable[[Request], Awaitable[Response]]


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's optional check of the number


def lora_routes(engine: EngineClient, registry: LoRARegistry, wrap: Callable[[Endpoint], Endpoint]) -> list[Route]:
    """vLLM's two routes that change the served adapters, each wrapped by ``wrap`` (auth, errors)."""

    async def load(request: Request) -> Response:
        body: LoadLoRAAdapterRequest = decode_request(await request.body(), LoadLoRAAdapterRequest)
        await registry.load(engine.call, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        body: UnloadLoRAAdapterRequest = decode_request(await request.body(), UnloadLoRAAdapterRequest)
        await registry.unload(engine.call, body.lora_name, body.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return [
        Route("/v1/load_lora_adapter", wrap(load), methods=["POST"]),
        Route("/v1/unload_lora_adapter", wrap(unload), methods=["POST"]),
    ]
