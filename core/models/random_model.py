"""A small random-weights Llama built locally, for tests and benchmarks that need its shapes.

Larger than the embedded stories260K (hidden 256, 2048 positions) and with a
byte-level tokenizer, so tests can send any text or token id and benchmarks
get a model of a known size. The directory is a complete Hugging Face
checkpoint (config, generation config, byte-level tokenizer with a ChatML chat
template, safetensors weights), so transformers can load it as well and serve
as the oracle for it. Its weights are seeded random numbers: the text it
writes is noise, which is why it is not the default model.

The directory is built once per cache root, in a temporary sibling that is
renamed into place, so concurrent first starts never see a half-written
model. The name carries a recipe version: changing the recipe builds anew
instead of reusing stale files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from core import envs

RECIPE_VERSION = 1
SEED = 0
INIT_STD = 0.02

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD, IM_START, IM_END = (256 + i for i in range(len(SPECIAL_TOKENS)))

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "dtype": "float32",
    "torch_dtype": "float32",
}

# ChatML; message content may be a string or a list of OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def default_cache_root() -> Path:
    return envs.RINGLLM_CACHE


def ensure_random_model(cache_dir: str | None = None) -> str:
    """Path of the random model under ``cache_dir`` (else $RINGLLM_CACHE or
    ~/.cache/ringllm), building it first if it is not there yet."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"random-model-v{RECIPE_VERSION}"
    if (target / "model.safetensors").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".random-model-build-", dir=root))
    try:
        write_random_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
            # Another process finished first; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def write_random_model(directory: Path) -> None:
    """Write every file of the random model into an existing directory."""
    with open(directory / "config.json", "w") as f:
        json.dump(MODEL_CONFIG, f, indent=2)
    with open(directory / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": [EOS, IM_END], "pad_token_id": PAD}, f, indent=2)
    write_tokenizer(directory)
    save_file(random_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_tokenizer(directory: Path) -> None:
    """The byte-level tokenizer with its chat template, as Hugging Face files.

    Also used by tests to give tiny seeded checkpoints a tokenizer (their
    vocabulary must have at least ``MODEL_CONFIG["vocab_size"]`` entries).
    """
    directory = Path(directory)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    with open(directory / "tokenizer_config.json", "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": MODEL_CONFIG["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )


def byte_to_symbol() -> dict[int, str]:
    """A printable character for every byte, the byte-level BPE convention.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space,
    ...) are shifted to code points from 256 up, so every token of the
    vocabulary is a visible, whitespace-free string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_tokenizer() -> Tokenizer:
    """One token per byte (ids 0-255 in byte order) plus the special tokens."""
    vocab = {symbol: b for b, symbol in byte_to_symbol().items()}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def random_weights() -> dict[str, torch.Tensor]:
    """Seeded N(0, INIT_STD) weights (norm scales 1) under Hugging Face Llama names."""
    c = MODEL_CONFIG
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_size = c["num_attention_heads"] * head_dim
    kv_size = c["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (c["vocab_size"], hidden)}
    gen = torch.Generator().manual_seed(SEED)
    return {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * INIT_STD
        for name, shape in shapes.items()
    }
