"""Architecture name -> our model class (the names core/model_config.py serves)."""

from __future__ import annotations

from torch import nn

from core.model_config import DECODER_ARCHITECTURES, ENCODER_ARCHITECTURES, ModelConfig
from core.models.bert import BertModel
from core.models.gemma3 import Gemma3ForCausalLM
from core.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 and Qwen3 are one recipe: their differences are ModelConfig switches;
# so are BERT's two heads (none, or a classifier). Gemma 3 is a recipe of its own.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    **{arch: LlamaForCausalLM for arch in DECODER_ARCHITECTURES},
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    **{arch: BertModel for arch in ENCODER_ARCHITECTURES},
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_REGISTRY[config.architecture]
