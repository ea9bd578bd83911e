"""GGUF files for tests, written with the gguf package (llama.cpp's own writer and tables).

``write_gguf`` turns a small Hugging Face checkpoint into a GGUF file as
llama.cpp's converter does: metadata under llama.cpp's keys, the tokenizer
from SentencePiece's tokenizer.model (or tokenizer.json), tensor names from gguf's own
table, Llama's q/k rows interleaved for llama.cpp's rotary, Gemma 3's norms stored as
1 + w, and every matrix
whose rows hold whole blocks quantized by gguf's reference quantizer (the
rest in float32, as the converter falls back). ``with_block_format`` swaps
chosen matrices for valid random blocks of a format gguf cannot quantize
(the K formats): what the file says they hold is then the truth that
transformers' GGUF loader, the oracle, reads back.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

from core import envs
from core.models.default_model import DEFAULT_MODEL_DIR


def private_cache(folder: Path) -> Path:
    """``folder`` made a cache of a test's own (for $RINGLLM_CACHE: the GGUF files' configs,
    tokenizers and packed weights), its compiled kernels linked to this environment's cache:
    the library is keyed by its sources and this CPU, so the servers a test starts load the
    build already made rather than compile it again."""
    folder.mkdir(parents=True, exist_ok=True)
    shared = Path(envs.RINGLLM_CACHE) / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(shared, target_is_directory=True)
    return folder


ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Gemma3ForCausalLM": "gemma3", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
         "Qwen3MoeForCausalLM": "qwen3moe"}
_EXPERT = re.compile(
    r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$"
)
_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Experts as llama.cpp's converter writes them: one [experts, rows, k] tensor per projection
    (``mlp.experts.gate_proj``, gguf's ``ffn_gate_exps``), from either checkpoint layout."""
    out: dict[str, np.ndarray] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT.match(name)
        if match is not None:
            prefix, expert, projection = match.groups()
            parts.setdefault(f"{prefix}.mlp.experts.{_PROJECTION.get(projection, projection)}", {})[int(expert)] = value
        elif name.endswith(".mlp.experts.gate_up_proj"):  # transformers 5's stacked [gate | up]
            gate, up = np.split(value, 2, axis=1)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = value
    for name, experts in parts.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return {(f"{name}.weight" if ".mlp.experts." in name and not name.endswith(".weight") else name): value
            for name, value in out.items()}
QUANTIZABLE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
               "q5_0": gguf.GGMLQuantizationType.Q5_0}


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's two rotary halves interleaved, row by row."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def _vocabulary(hf_dir: Path) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and types as llama.cpp's converter takes them: from SentencePiece's
    tokenizer.model where there is one (its merge scores are what llama.cpp tokenizes by),
    else from tokenizer.json (gguf's LlamaHfVocab)."""
    model_file = hf_dir / "tokenizer.model"
    if model_file.is_file():
        from transformers.utils import sentencepiece_model_pb2_new as sentencepiece_model

        proto = sentencepiece_model.ModelProto()
        proto.ParseFromString(model_file.read_bytes())
        # SentencePiece's piece types are GGUF's token types (normal 1 ... byte 6).
        return ([p.piece.encode() for p in proto.pieces], [p.score for p in proto.pieces],
                [p.type for p in proto.pieces])
    tokens, scores, types = zip(*gguf.vocab.LlamaHfVocab(hf_dir).all_tokens())
    return list(tokens), list(scores), list(types)


def write_gguf(hf_dir: str | Path, out: str | Path, qtype: str = "q8_0",
               block_overrides: dict[str, np.ndarray] | None = None, expert_used_count: int | None = None,
               expert_count: int | None = None, leave_out: tuple[str, ...] = ()) -> Path:
    """``hf_dir`` as a GGUF file at ``out``: matrices in ``qtype`` (q8_0, q4_0, q5_0, f32) where
    their rows allow; ``block_overrides``: GGUF tensor name -> raw block data to store instead
    (its type given by ``block_type_of``); ``expert_used_count``, ``expert_count``: a mixture of
    experts' k and size in place of the config's, and ``leave_out``: GGUF tensor names not
    written (to write bad files)."""
    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]

    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(hf_dir.name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    if arch == "gemma3":  # the global layers' rope, the window, the local layers' rope base
        rope = rope["full_attention"]
        writer.add_sliding_window(config["sliding_window"])
        writer.add_rope_freq_base_swa(config["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.ALL_F32)
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # a mixture of experts, under llama.cpp's keys
        writer.add_expert_count(expert_count or experts)
        writer.add_expert_used_count(expert_used_count or config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])

    tokens, scores, types = _vocabulary(hf_dir)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    gguf.SpecialVocab(hf_dir, load_merges=False, n_vocab=len(tokens)).add_to_gguf(writer)

    names = gguf.get_tensor_name_map(arch_enum, layers)
    overrides = block_overrides or {}
    for hf_name, value in _stack_experts(load_file(hf_dir / "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if name in leave_out:
            continue
        value = value.astype(np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _permute(value, heads if "q_proj" in hf_name else kv_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            value = value + np.float32(1)  # llama.cpp stores Gemma's norms as the scale, 1 + w
        if name in overrides:
            data, block_type = overrides[name]
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=block_type)
            continue
        block_type = QUANTIZABLE.get(qtype)
        if value.ndim >= 2 and block_type is not None and value.shape[-1] % gguf.GGML_QUANT_SIZES[block_type][0] == 0:
            writer.add_tensor(name, gguf.quants.quantize(value, block_type), raw_dtype=block_type)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gemma3_checkpoint(path: Path) -> Path:
    """A small seeded Gemma 3 inside llama.cpp's assumptions (five local layers to one global,
    query_pre_attn_scalar = head_dim, local rope base 10000) with stories260K's vocabulary."""
    layers = 6
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    )
    config.architectures = ["Gemma3ForCausalLM"]
    model = transformers.Gemma3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from their zero init
            p.copy_((0.3 if "norm" in name else 0.08) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.model", path / "tokenizer.model")
    return path


def moe_checkpoint(path: Path, family: str) -> Path:
    """A small seeded Qwen3-MoE or Mixtral (8 experts, 2 a token, routers sharp enough that a
    token's top two are clear choices) with stories260K's vocabulary and tokenizer, for
    llama.cpp's converter."""
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=2, norm_topk_prob=True, head_dim=32)
        model = transformers.Qwen3MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.08) * torch.randn(p.shape, generator=gen))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    model.eval().save_pretrained(path)
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.model", path / "tokenizer.model")
    return path


def qwen_dir(path: Path, arch: str, hidden: int, intermediate: int, heads: int, kv_heads: int, seed: int,
             head_dim: int | None = None) -> Path:
    """A small seeded Qwen checkpoint with stories260K's tokenizer (a llama vocabulary of 512)."""
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    config = cls[0](vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                    rms_norm_eps=1e-6, tie_word_embeddings=arch == "qwen3", bos_token_id=1, eos_token_id=2,
                    **({"head_dim": head_dim} if head_dim else {}))
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # biases and norms away from their trivial inits
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name else 0.08 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path
