"""The checkpoint's architecture, read once and typed: what models, KV caches and limits are built from.

``ModelConfig.from_dir`` reads a Hugging Face directory's ``config.json`` (and
``generation_config.json`` for the end-of-sequence ids); ``from_hf`` takes
the same dict or a transformers ``PretrainedConfig``. The Llama family
differs only in switches, some of which the configs do not spell out
(``ARCHITECTURES``): Qwen2's q/k/v always carry biases, Qwen3 normalises q
and k per head. An architecture we do not serve is refused here, before
anything is loaded.

A msgspec Struct without torch: it travels inside the EngineConfig to the
engine process, and the frontend reads it too.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import msgspec

# The architectures served (core/models/registry.py maps them to classes), with
# the switches their configs leave implicit.
# A ``...Model`` is the same decoder without its head, as sentence-transformers saves one
# it uses for embeddings (weights without the ``model.`` prefix).
DECODER_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qwen2_biases": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Gemma3ForCausalLM": {"qk_norm": True, "gemma3": True},
    # Mixtures of experts (core/models/moe.py): the Llama family's attention, experts for the MLP.
    "MixtralForCausalLM": {"moe": True},
    "Qwen2MoeForCausalLM": {"qwen2_biases": True, "moe": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": True},
    "LlamaModel": {"headless": True},
    "MistralModel": {"headless": True},
    "Qwen2Model": {"qwen2_biases": True, "headless": True},
    "Qwen3Model": {"qk_norm": True, "headless": True},
}
# Bidirectional encoders (core/models/bert.py): pooling models only. RoBERTa and XLM-RoBERTa
# are BERT with positions counted from after the padding id and their own classification head.
ENCODER_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "BertModel": {},
    "BertForSequenceClassification": {"classifier": True},
    "RobertaModel": {"roberta": True},
    "RobertaForSequenceClassification": {"classifier": True, "roberta": True},
    "XLMRobertaModel": {"roberta": True},
    "XLMRobertaForSequenceClassification": {"classifier": True, "roberta": True},
}
ARCHITECTURES = {**DECODER_ARCHITECTURES, **ENCODER_ARCHITECTURES}
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


class MoEConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A mixture of experts in place of the MLP of ``layers``: a router picks ``top_k`` of
    ``num_experts`` gated MLPs of ``intermediate_size`` per token (softmax over all experts in
    float32, the top k kept and, with ``normalize_top_k``, scaled to sum to one: how
    transformers routes Mixtral, Qwen2-MoE and Qwen3-MoE); Qwen2-MoE adds a shared expert of
    ``shared_intermediate_size`` to every token, scaled by sigmoid(its gate)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    layers: tuple[int, ...]
    shared_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_layers: int, mixtral: bool) -> MoEConfig:
        """``mixtral``: every layer sparse, its experts of ``intermediate_size``, the top k renormalized."""
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"a mixture of experts needs 1 <= num_experts_per_tok ({top_k}) <= its experts ({num_experts})"
            )
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        return cls(
            num_experts=num_experts, top_k=top_k,
            intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
            normalize_top_k=mixtral or bool(cfg.get("norm_topk_prob", False)),
            layers=tuple(i for i in range(num_layers) if mixtral or (i + 1) % step == 0 and i not in dense),
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    hidden_act: str
    # The attention window of windowed layers (all of them unless ``layer_types`` says which).
    sliding_window: int | None
    dtype: str | None = None  # the checkpoint's own (float32, bfloat16...), if it says
    eos_token_ids: tuple[int, ...] = ()  # generation_config.json's, else config.json's
    # A decoder saved without its language-model head (an embedding model's body).
    headless: bool = False
    # BERT family: bidirectional attention, no KV cache; absolute positions, token types,
    # LayerNorm (its epsilon in rms_norm_eps). num_labels: a classification head's outputs.
    encoder: bool = False
    type_vocab_size: int = 0
    num_labels: int = 0
    # RoBERTa: position ids start after the padding id (the table has this many rows more than
    # max_position_embeddings, which counts the positions a prompt can use); its own classifier.
    position_offset: int = 0
    roberta: bool = False
    labels: tuple[str, ...] = ()  # a classifier's label names, by index (config.json's id2label)
    # Matryoshka embeddings: the model was trained so that a prefix of its vector is one too.
    matryoshka: bool = False
    # Each layer's "sliding_attention" or "full_attention" where the config lists them (Gemma 3's
    # interleaved local/global layers, Qwen2's windowed upper layers); Gemma 3's local layers
    # rotate with their own rope base and scaling.
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Attention scales scores by query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Mixtral, Qwen2-MoE, Qwen3-MoE: the layers whose MLP is a mixture of experts, and its shape.
    moe: MoEConfig | None = None

    def layer_window(self, index: int) -> int:
        """Layer ``index``'s sliding window, 0 where it attends to the whole context."""
        if not self.sliding_window or self.layer_types and self.layer_types[index] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def has_lm_head(self) -> bool:
        return not (self.headless or self.encoder)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json``) of a checkpoint directory."""
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        eos = None
        generation = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation):
            with open(generation) as f:
                eos = json.load(f).get("eos_token_id")
        return cls.from_hf(hf, eos_token_id=eos)

    @classmethod
    def from_hf(cls, hf: Any, architecture: str | None = None, eos_token_id: Any = None) -> ModelConfig:
        """From a config.json dict or a transformers ``PretrainedConfig``; ``architecture``
        overrides the config's ``architectures``, ``eos_token_id`` its end-of-sequence ids
        (ValueError for an architecture or activation we do not serve)."""
        cfg: dict[str, Any] = hf if isinstance(hf, dict) else hf.to_dict()
        architecture = architecture or _served_architecture(cfg.get("architectures") or [])
        if architecture in ENCODER_ARCHITECTURES:
            return cls._encoder(cfg, architecture)
        switches = ARCHITECTURES[architecture]
        qwen2_biases = switches.get("qwen2_biases", False)
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        gemma3 = _gemma3_settings(cfg) if switches.get("gemma3") else {}
        theta, scaling = _rope_settings(cfg)
        theta, scaling = gemma3.pop("rope_theta", theta), gemma3.pop("rope_scaling", scaling)
        eos = cfg.get("eos_token_id") if eos_token_id is None else eos_token_id
        # Layer kinds only where some layer is windowed (transformers lists all-global ones too);
        # a config that lists its layers and windows none of them has no window.
        kinds = tuple(cfg.get("layer_types") or ())
        gemma3.setdefault("layer_types", kinds if "sliding_attention" in kinds else ())
        window = None if kinds and "sliding_attention" not in kinds else _sliding_window(cfg)
        return cls(
            **gemma3,
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qwen2_biases or attention_bias,
            o_bias=attention_bias and not qwen2_biases,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=switches.get("qk_norm", False),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", bool(gemma3))),
            hidden_act=act,
            sliding_window=None if switches.get("gemma3") and not gemma3["layer_types"] else window,
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=() if eos is None else ((eos,) if isinstance(eos, int) else tuple(int(i) for i in eos)),
            headless=switches.get("headless", False),
            matryoshka=_matryoshka(cfg),
            moe=MoEConfig.from_hf(cfg, cfg["num_hidden_layers"], architecture == "MixtralForCausalLM")
            if switches.get("moe") else None,
        )

    @classmethod
    def _encoder(cls, cfg: dict[str, Any], architecture: str) -> ModelConfig:
        """A BERT-family config (absolute positions, post-norm layers with biases): BERT, RoBERTa, XLM-R."""
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r}")
        heads = cfg["num_attention_heads"]
        switches = ENCODER_ARCHITECTURES[architecture]
        classifier = switches.get("classifier", False)
        roberta = switches.get("roberta", False)
        offset = int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0
        num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2)) if classifier else 0
        id2label = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
        labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))
        return cls(
            architecture=architecture, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=heads, head_dim=cfg["hidden_size"] // heads, rms_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=cfg.get("max_position_embeddings", 512) - offset, rope_theta=0.0,
            rope_scaling=None,
            qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False, tie_word_embeddings=False, hidden_act=act,
            sliding_window=None, dtype=cfg.get("dtype") or cfg.get("torch_dtype"), encoder=True,
            type_vocab_size=cfg.get("type_vocab_size", 2), num_labels=num_labels, matryoshka=_matryoshka(cfg),
            position_offset=offset, roberta=roberta, labels=labels,
        )

    def kv_block_shape(self, block_size: int, row: int | None = None) -> tuple[int, int, int]:
        """(block_size, kv_heads, row): one KV-cache block of one layer, K or V; a row is one head
        as the cache stores it (head_dim values unless given: kernels/kv_format.py)."""
        return block_size, self.num_kv_heads, self.head_dim if row is None else row

    def kv_bytes_per_block(self, block_size: int, element_size: int, row: int | None = None) -> int:
        """Bytes one KV-cache block takes over all layers (K and V)."""
        return 2 * self.num_layers * math.prod(self.kv_block_shape(block_size, row)) * element_size


def _served_architecture(listed: list[str]) -> str:
    for arch in listed:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported model architecture {listed or '(none listed in config.json)'}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def _matryoshka(cfg: dict[str, Any]) -> bool:
    """Whether config.json declares Matryoshka embeddings (as vLLM reads it)."""
    return bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))


def _gemma3_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields beyond the Llama family's: layer kinds, the two ropes, the score scale
    (ValueError for the soft-capping Gemma 2 had, which Gemma 3 configs leave off)."""
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise ValueError(f"{cap} is not supported")
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    if "sliding_attention" not in types:
        types = []
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer kind
        theta, scaling = _rope_settings({"rope_parameters": params["full_attention"]})
        local_theta, local_scaling = _rope_settings({"rope_parameters": params["sliding_attention"]})
    else:
        theta, scaling = _rope_settings({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", 10000.0)), None
    return dict(
        layer_types=tuple(types), rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
        local_rope_scaling=local_scaling, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
    )


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from transformers-4 or -5 style keys."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    scaling = {**scaling, "rope_type": rope_type}
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return float(theta), scaling


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window when the checkpoint actually uses one.

    Qwen configs always carry ``sliding_window`` but only use it with
    ``use_sliding_window``; Mistral uses it whenever it is set.
    """
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    return cfg.get("sliding_window")
