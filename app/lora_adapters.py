"""The frontend's LoRA adapters: the names requests may use as their ``model``, and the routes that change them.

A request whose ``model`` names an adapter runs with it; the engine loads the
adapter's weights (core/worker/lora_adapters.py). The table starts with
``--lora-modules`` (numbers 1, 2, ..., as the engine numbers them) and, with
``--allow-runtime-lora-updating``, changes through vLLM's routes (app/serving/lora.py):

- ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}``: the
  adapter is checked here from its files' headers (a 400 saying what is wrong)
  and loaded by the engine before the name is served.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": ...}``: the name stops being
  served at once; the engine refuses while requests run or wait with the
  adapter (a 409, and the name is served again), so none loses it halfway.

A reloaded name gets a new number: the prefix cache keys blocks by it, so KV
computed under the old weights is never reused.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from app.errors import BadRequestError, ConflictError, NotFoundError
from app.protocol.common import ModelCard
from core.config import EngineConfig
from core.lora.adapter_spec import LoRAAdapterError, read_adapter_spec
from core.protocol import LoRARequest
from core.utilities import ADD_LORA, REMOVE_LORA, Call

EngineCall = Callable[[Call[Any]], Awaitable[Any]]  # the engine client's ``call``


class LoRARegistry:
    """Adapter names -> what the engine knows them as, and the model each belongs to."""

    def __init__(self, config: EngineConfig | None, served_model_name: str) -> None:
        self.config = config
        self.enabled = config is not None and config.lora_config is not None
        self.served_model_name = served_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        modules = config.lora_config.lora_modules if self.enabled else []
        for module, request in zip(modules, config.lora_config.lora_requests() if self.enabled else []):
            self.adapters[request.lora_name] = request
            self.parents[request.lora_name] = module.base_model_name or served_model_name
        self._numbers = itertools.count(len(self.adapters) + 1)
        self._changing: set[str] = set()  # names being loaded or unloaded right now

    def get(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: it names the base model, or nothing)."""
        if model is None or not self.adapters:
            return None
        return self.adapters.get(model)

    def cards(self, created: int, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(id=name, created=created, max_model_len=max_model_len, root=request.lora_path,
                      parent=self.parents[name])
            for name, request in self.adapters.items()
        ]

    async def load(self, call: EngineCall, name: str, path: str) -> None:
        if not self.enabled:
            raise BadRequestError("LoRA adapters are off: start the server with --enable-lora.")
        if not name or not path:
            raise BadRequestError("Both lora_name and lora_path must be given.", "lora_name" if not name else "lora_path")
        if name in self.adapters or name in self._changing:
            raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name == self.served_model_name:
            raise BadRequestError(f"'{name}' is the base model's name.", "lora_name")
        assert self.config is not None
        try:  # the files' headers only: a bad adapter never reaches the engine
            max_rank = self.config.lora_config.max_lora_rank
            await asyncio.to_thread(read_adapter_spec, path, self.config.model_config, max_rank)
        except LoRAAdapterError as exc:
            raise BadRequestError(str(exc), "lora_path") from None
        request = LoRARequest(name, next(self._numbers), path)
        self._changing.add(name)
        try:
            await call(ADD_LORA(lora_name=name, lora_int_id=request.lora_int_id, lora_path=path))
        except RuntimeError as exc:  # the engine could not load it after all
            raise BadRequestError(_engine_reason(exc), "lora_path") from None
        finally:
            self._changing.discard(name)
        self.adapters[name] = request
        self.parents[name] = self.served_model_name

    async def unload(self, call: EngineCall, name: str, lora_int_id: int | None = None) -> None:
        request = self.adapters.get(name)
        if request is None or (lora_int_id is not None and lora_int_id != request.lora_int_id):
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
        parent = self.parents.pop(name)
        del self.adapters[name]  # no new request gets it from here on
        self._changing.add(name)
        try:
            await call(REMOVE_LORA(lora_id=request.lora_int_id))
        except RuntimeError as exc:  # requests still use it: serve it again
            self.adapters[name], self.parents[name] = request, parent
            raise ConflictError(_engine_reason(exc)) from None
        finally:
            self._changing.discard(name)


def _engine_reason(exc: RuntimeError) -> str:
    """The engine's message without the utility call's prefix."""
    message = str(exc)
    _, sep, reason = message.partition(" failed: ")
    return reason if sep else message
