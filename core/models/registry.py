"""Hugging Face ``architectures`` name -> our model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from core.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    """The first supported entry of the config's ``architectures``."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none listed in config.json)'}; "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )
