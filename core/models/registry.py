"""Architecture name -> our model class (the names core/model_config.py serves)."""

from __future__ import annotations

from torch import nn

from core.model_config import ARCHITECTURES, ModelConfig
from core.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 and Qwen3 are one class: their differences are ModelConfig switches.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in ARCHITECTURES}


def model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_REGISTRY[config.architecture]
