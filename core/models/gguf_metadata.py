"""A GGUF file's metadata as a Hugging Face directory: config, tokenizer, generation config.

The rest of ringllm (the frontend's tokenizer, ``ModelConfig``) reads a model
from a directory, so a GGUF file's metadata is written once as one, in the
cache (core/models/gguf_checkpoint.py decides where). This module writes it
straight from the header (core/models/gguf_header.py), in milliseconds:

- ``config.json`` from the architecture's fields (llama.cpp's key names);
- the byte-level BPE tokenizers of Llama 3 and Qwen (``tokenizer.ggml.model``
  ``gpt2`` with a pre-tokenizer split named in ``tokenizer.ggml.pre``) as a
  ``tokenizers`` pipeline, as transformers' GGUF conversion builds them
  (tests/equivalence/test_gguf_metadata.py checks the encodings against it);
- the chat template and the special tokens.

A tokenizer it does not know (SentencePiece vocabularies, other splits) is
left to transformers' GGUF reader (``write_tokenizer`` returns False), which
takes seconds to minutes on a large vocabulary and is therefore the fallback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.models.gguf_header import GGUFHeader

# GGUF architecture -> the Hugging Face architecture it is served as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
}
# A ``llama`` file with experts (llama.expert_count) is Mixtral.
MIXTRAL = "MixtralForCausalLM"

# tokenizer.ggml.pre -> how text is split before byte-level BPE (the splits of the vocabularies'
# own tokenizer.json files: Llama 3's, and Qwen2's, which takes digits one at a time).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


class MetadataError(ValueError):
    """Metadata that does not describe a model ringllm can build a config for."""


def _field(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.fields.get(key, default)


def hf_config(header: GGUFHeader, has_output: bool) -> dict[str, Any]:
    """The config.json of the model the header describes (``has_output``: the file has its own
    ``output.weight``; without one the head is the embedding)."""
    arch = _field(header, "general.architecture")
    if arch not in ARCHITECTURES:
        raise MetadataError(f"the architecture {arch!r} is not served; served: {', '.join(ARCHITECTURES)}")

    def need(key: str) -> Any:
        value = _field(header, f"{arch}.{key}")
        if value is None:
            raise MetadataError(f"the metadata has no {arch}.{key}")
        return value

    tokens = _field(header, "tokenizer.ggml.tokens")
    vocab = _field(header, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise MetadataError(f"the metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = _field(header, f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):  # a per-layer array: all equal in the families served
        kv_heads = int(kv_heads[0])
    experts = int(_field(header, f"{arch}.expert_count", 0) or 0)
    mixtral = arch == "llama" and experts > 0
    dense_ffn = _field(header, f"{arch}.feed_forward_length")
    if dense_ffn is None and not experts:
        need("feed_forward_length")
    config: dict[str, Any] = {
        "architectures": [MIXTRAL if mixtral else ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(dense_ffn if dense_ffn is not None else need("expert_feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(_field(header, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(header, f"{arch}.context_length", 2048)),
        "rope_theta": float(_field(header, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
    }
    scaling = _rope_scaling(header, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "gemma3":
        config.update(_gemma3_fields(header, config))
    if experts:
        config.update(_expert_fields(header, arch, experts, mixtral))
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = _field(header, f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    return config


def _expert_fields(header: GGUFHeader, arch: str, experts: int, mixtral: bool) -> dict[str, Any]:
    """A mixture of experts' config.json keys, as transformers names them per family; the top
    k renormalized as llama.cpp does it (qwen3moe and Mixtral: yes; qwen2moe: no)."""
    used = int(_field(header, f"{arch}.expert_used_count", 0) or 0)
    if not 1 <= used <= experts:
        raise MetadataError(f"{arch}.expert_used_count {used} is not between 1 and {arch}.expert_count {experts}")
    fields: dict[str, Any] = {"num_experts_per_tok": used}
    if mixtral:
        return {**fields, "num_local_experts": experts}
    shared = _field(header, f"{arch}.expert_shared_feed_forward_length")
    return {
        **fields, "num_experts": experts, "norm_topk_prob": arch == "qwen3moe",
        "moe_intermediate_size": int(_field(header, f"{arch}.expert_feed_forward_length") or 0)
        or int(_field(header, f"{arch}.feed_forward_length")),
        **({"shared_expert_intermediate_size": int(shared)} if shared else {}),
    }


def _gemma3_fields(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config beyond the Llama family's, as llama.cpp reads the file: local layers
    by ``sliding_window_pattern`` (every sixth layer global unless the file says otherwise),
    local rope base ``rope.freq_base_swa`` (10000), scores scaled by head_dim ** -0.5 (by
    (hidden / heads) ** -0.5 for the 62-layer 27B)."""
    layers, window = config["num_hidden_layers"], _field(header, "gemma3.attention.sliding_window")
    pattern = _field(header, "gemma3.attention.sliding_window_pattern", 6)
    if not window:
        kinds = [False] * layers
    elif isinstance(pattern, list):
        kinds = [bool(p) for p in pattern]
    else:
        kinds = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    full = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    full.update(config.pop("rope_scaling", None) or {})
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh", "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if k else "full_attention" for k in kinds],
        "query_pre_attn_scalar": scalar,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {
                "rope_type": "default", "rope_theta": float(_field(header, "gemma3.rope.freq_base_swa", 10000.0)),
            },
        },
    }


def _rope_scaling(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    kind = _field(header, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_field(header, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _field(header, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor,
                **({"original_max_position_embeddings": int(original)} if original else {})}
    raise MetadataError(f"rope scaling {kind!r} is not served")


def generation_config(header: GGUFHeader) -> dict[str, Any] | None:
    eos = _field(header, "tokenizer.ggml.eos_token_id")
    if eos is None:
        return None
    out = {"eos_token_id": int(eos)}
    bos = _field(header, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    return out


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, as byte-level BPE vocabularies write tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def write_tokenizer(header: GGUFHeader, out: Path) -> bool:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` to
    ``out`` when the header's tokenizer is one built here; False (nothing written) otherwise."""
    if _field(header, "tokenizer.ggml.model") != "gpt2":
        return False
    split = BYTE_LEVEL_SPLITS.get(_field(header, "tokenizer.ggml.pre"))
    tokens, merges = _field(header, "tokenizer.ggml.tokens"), _field(header, "tokenizer.ggml.merges")
    if split is None or tokens is None or merges is None:
        return False
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = set(_byte_alphabet().values())
    spelling = _byte_alphabet()
    names = tokens.tolist()
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in names]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    types = _field(header, "tokenizer.ggml.token_type")
    if types is not None:
        types = types.tolist()
        # Control tokens whole and special; user-defined ones (<think>...) whole but not special. A
        # "control" token spelled outside the byte alphabet is a mislabelled one: left to the BPE.
        tokenizer.add_special_tokens([AddedToken(names[i], normalized=False, special=True)
                                      for i, kind in enumerate(types)
                                      if kind == _CONTROL and set(names[i]) <= alphabet])
        tokenizer.add_tokens([AddedToken(names[i], normalized=False, special=False)
                              for i, kind in enumerate(types) if kind == _USER_DEFINED])

    def token(key: str) -> tuple[str, int] | None:
        index = _field(header, f"tokenizer.ggml.{key}")
        return (names[int(index)], int(index)) if index is not None and 0 <= int(index) < len(names) else None

    def name(key: str) -> str | None:
        found = token(key)
        return found[0] if found else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(_field(header, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_field(header, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    first, last = ([bos[0]] if add_bos else []), ([eos[0]] if add_eos else [])
    single = [*first, "$A", *last]
    pair = [*single, *(f"{t}:1" for t in first), "$B:1", *(f"{t}:1" for t in last)]
    special = [t for t, add in ((bos, add_bos), (eos, add_eos)) if add]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"), "pad_token": name("padding_token_id"),
        "add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    template = _field(header, "tokenizer.chat_template")
    if isinstance(template, str):
        (out / "chat_template.jinja").write_text(template)
    return True


def write_config(header: GGUFHeader, has_output: bool, out: Path) -> None:
    """Writes ``config.json`` and ``generation_config.json`` to ``out``."""
    (out / "config.json").write_text(json.dumps(hf_config(header, has_output), indent=2))
    generation = generation_config(header)
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
