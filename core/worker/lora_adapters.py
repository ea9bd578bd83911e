"""The runner's LoRA adapters: loaded, evicted, pinned, and laid out over each step's rows.

Every adapted product of the model (each layer's q/k/v, o, gate/up and down,
as the model's recipe names its products, core/models/recipe.py) gets a ``LoRASlot`` reading one shared
``LoRABatch`` (kernels/lora.py); ``stage`` fills that batch before each step
from the adapter of each request's row. At most ``max_cpu_loras`` adapters
stay loaded: loading one more evicts the least recently used that is neither
pinned nor named by a request the engine holds (the engine says which are,
``in_use``); an evicted adapter is read again from its directory when a
request needs it. The scheduler keeps the adapters of one step to
``max_loras``; on a GPU every loaded adapter lives in device memory.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from core.lora.adapter_spec import read_adapter_spec
from core.lora.weights import LoRAWeights, load_lora_weights
from core.model_config import ModelConfig
from core.models.recipe import Product
from core.protocol import LoRARequest
from kernels.lora import LoRABatch, LoRAGroup, LoRASlot, group_rows

# The layers' products an adapter may adapt, by the name the recipe gives them.
ADAPTED_PRODUCTS = ("qkv", "o", "gate_up", "down")


class LoRAAdapters:
    def __init__(
        self, model_config: ModelConfig, max_lora_rank: int, max_cpu_loras: int, device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.capacity = max_cpu_loras
        self.device, self.dtype = device, dtype
        # Room for every loaded adapter in one step (the scheduler keeps it to max_loras).
        self.batch = LoRABatch(capacity=max_cpu_loras + 1, native=device.type == "cpu" and dtype == torch.float32)
        # The engine's one registry of adapters: every adapter added (by a call, --lora-modules or
        # a request naming it) by number, loaded or evicted, so that an evicted one is read again
        # from its directory when a request or a pin needs it.
        self.added: dict[int, LoRARequest] = {}
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()

    def attach(self, model: torch.nn.Module) -> None:
        """Give every adapted product of ``model`` its slot (again after a weight reload)."""
        describe = getattr(model, "recipe", None)
        if describe is None:
            raise ValueError(f"{type(model).__name__} cannot take LoRA adapters")
        for i, ops in enumerate(describe().layers):
            for op in ops:
                if isinstance(op, Product) and op.name in ADAPTED_PRODUCTS:
                    op.linear.adapters = LoRASlot(self.batch, (i, op.name))

    # ----------------------------------------------------------------- adapters

    def add(self, request: LoRARequest, in_use: frozenset[int] | set[int] = frozenset()) -> bool:
        """Add ``request``'s adapter and load it unless it is loaded (ValueError when its number
        names another adapter, LoRAAdapterError if it cannot be served); False when it was."""
        lora_id = request.lora_int_id
        known = self.added.get(lora_id)
        if lora_id < 1 or (known is not None and known != request):
            raise ValueError(f"LoRA adapter number {lora_id} is taken or invalid")
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)
            return False
        spec = read_adapter_spec(request.lora_path, self.model_config, self.max_lora_rank)
        weights = load_lora_weights(spec, self.model_config, lora_id, request.lora_name, self.dtype, self.device)
        self._make_room(in_use)
        self.loaded[lora_id] = weights
        self.added[lora_id] = request
        return True

    def _make_room(self, in_use: frozenset[int] | set[int]) -> None:
        """Evict least recently used adapters, neither pinned nor in use, until one more fits.
        When every loaded adapter is pinned or in use, the cache holds one more than its
        capacity until some are free again."""
        for lora_id in list(self.loaded):
            if len(self.loaded) < self.capacity:
                return
            if lora_id not in self.pinned and lora_id not in in_use:
                del self.loaded[lora_id]

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter, loaded or evicted; False when none had that number."""
        self.pinned.discard(lora_id)
        known = self.added.pop(lora_id, None)
        return self.loaded.pop(lora_id, None) is not None or known is not None

    def pin(self, lora_id: int, in_use: frozenset[int] | set[int] = frozenset()) -> bool:
        """Keep an added adapter loaded whatever the load of others, reading it again if it was
        evicted (False: no adapter has that number)."""
        known = self.added.get(lora_id)
        if known is None:
            return False
        self.add(known, in_use)
        self.pinned.add(lora_id)
        return True

    def name(self, lora_id: int) -> str | None:
        known = self.added.get(lora_id)
        return None if known is None else known.lora_name

    def list(self) -> list[int]:
        return sorted(self.loaded)

    # -------------------------------------------------------------------- steps

    def stage(self, lora_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, decode_only: bool) -> None:
        """Group the step's token rows by adapter: request i (adapter ``lora_ids[i]``, 0 for the
        base model) owns rows ``starts[i] : starts[i] + counts[i]``."""
        groups: list[LoRAGroup] = []
        if lora_ids.any():
            for lora_id in np.unique(lora_ids[lora_ids > 0]).tolist():
                weights = self.loaded[lora_id]
                self.loaded.move_to_end(lora_id)
                requests = np.flatnonzero(lora_ids == lora_id)
                if decode_only:
                    rows = requests
                else:
                    rows = np.concatenate([np.arange(s, s + c) for s, c in zip(starts[requests], counts[requests])])
                grouped = group_rows(rows)
                rows_t = None if isinstance(grouped, slice) else torch.from_numpy(grouped).to(self.device)
                groups.append(LoRAGroup(weights.products, grouped, rows_t))
        self.batch.groups = groups
