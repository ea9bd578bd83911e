"""A PEFT LoRA adapter directory, read and checked against the base model without its weights.

PEFT saves an adapter as ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``use_rslora``, the target modules) and ``adapter_model.safetensors``, whose
tensors are named after the module they adapt:
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in])
and ``...lora_B.weight`` ([out, r]). The adapted layer computes
``W x + scaling * B (A x)`` with ``scaling = alpha / r`` (``alpha / sqrt(r)``
under rsLoRA).

Everything that can be wrong with an adapter is found here, from the config
and the safetensors header alone: a missing file, a rank above
``--max-lora-rank``, a module the model does not have or that ringllm does not
adapt, PEFT features whose output would differ from plain LoRA (DoRA, trained
biases, extra saved modules, per-module ranks), and shapes of another base
model. The frontend runs it before asking the engine to load an adapter (a 400),
the start-up checks run it on ``--lora-modules`` (exit 2), and the engine runs it
again before reading the weights: no process trusts another's files.

No torch here: the frontend imports it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

from safetensors import safe_open

from core.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their Hugging Face names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.weight)?$")
# A tensor of an expert or a router (published checkpoints' names, Mixtral's too).
_EXPERT_TENSOR = re.compile(r"(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts|gate|shared_expert)\b")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served, and why (shown to the user as it is)."""


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter is, checked: its rank and scaling, and for each (layer, target
    module) the names of its A and B tensors in the weights file."""

    path: str
    rank: int
    scaling: float
    base_model_name_or_path: str | None
    tensors: dict[tuple[int, str], tuple[str, str]] = field(repr=False)

    @property
    def weights_file(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.tensors}, key=TARGET_MODULES.index)


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of one of the base model's projections."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }[module]


def read_adapter_spec(path: str, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    """The adapter in directory ``path``, checked against the base model ``cfg``
    (LoRAAdapterError naming the problem)."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no such directory")
    if not os.path.isfile(config_path):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is missing")
    if not os.path.isfile(weights_path):
        other = " (only adapter_model.bin is there: save the adapter with safe_serialization)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is missing{other}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    rank, scaling, base = _check_config(path, config, max_rank)
    try:
        with safe_open(weights_path, framework="numpy") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is unreadable: {exc}") from None
    tensors = _check_tensors(path, shapes, cfg, rank, base)
    return AdapterSpec(path=path, rank=rank, scaling=scaling, base_model_name_or_path=base, tensors=tensors)


def _check_config(path: str, config: dict, max_rank: int) -> tuple[int, float, str | None]:
    """(rank, scaling, base model name) from adapter_config.json, or LoRAAdapterError."""
    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {path!r}: {why}")

    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise refuse(f"peft_type is {peft_type!r}; only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"its rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": "DoRA is", "rank_pattern": "per-module ranks (rank_pattern) are",
        "alpha_pattern": "per-module alphas (alpha_pattern) are",
        "modules_to_save": "fully trained modules (modules_to_save) are",
        "fan_in_fan_out": "fan_in_fan_out weights are", "layer_replication": "layer_replication is",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise refuse(f"{what} not supported")
    if config.get("bias", "none") != "none":
        raise refuse(f"trained biases (bias={config['bias']!r}) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            leaf = str(name).rsplit(".", 1)[-1]
            if leaf not in TARGET_MODULES:
                raise refuse(
                    f"target module {name!r} is not one ringllm adapts (it adapts {', '.join(TARGET_MODULES)})"
                )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    base = config.get("base_model_name_or_path")
    return rank, float(scaling), base if isinstance(base, str) else None


def _check_tensors(
    path: str, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, rank: int, base: str | None
) -> dict[tuple[int, str], tuple[str, str]]:
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for name, shape in shapes.items():
        match = _TENSOR.search(name)
        if match is None and _EXPERT_TENSOR.search(name):
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: tensor {name!r} adapts an expert; adapters on a mixture of experts' "
                f"experts or router are not supported (its attention projections may be adapted)"
            )
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A or B matrix of a decoder layer's "
                f"projection (embedding and head adapters are not supported)"
            )
        layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES or _PARENT[module] != parent:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: the model has no module {parent}.{module} to adapt "
                f"(ringllm adapts {', '.join(TARGET_MODULES)})"
            )
        mismatch = f"LoRA adapter {path!r} does not fit this model (it was trained on {base or 'another model'}): "
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(mismatch + f"it adapts layer {layer}, the model has {cfg.num_layers}")
        if parent == "mlp" and cfg.moe is not None and layer in cfg.moe.layers:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: it adapts layer {layer}'s {module}, but that layer's MLP is a mixture of "
                f"experts; adapters on experts are not supported (its attention projections may be adapted)"
            )
        features_in, features_out = module_shape(cfg, module)
        expected = (rank, features_in) if half == "A" else (features_out, rank)
        if shape != expected:
            raise LoRAAdapterError(
                mismatch + f"layer {layer} {module} lora_{half} is {list(shape)}, this model needs {list(expected)}"
            )
        halves.setdefault((layer, module), {})[half] = name
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    tensors = {}
    for key, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise LoRAAdapterError(f"LoRA adapter {path!r}: layer {key[0]} {key[1]} has no lora_{missing}")
        tensors[key] = (pair["A"], pair["B"])
    return tensors
