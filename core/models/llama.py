"""The Llama family's recipe: Llama, Mistral, Qwen2 and Qwen3, and their mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE), whose sparse layers run a ``MixtureOfExperts`` for the MLP.

They differ only in switches of their ModelConfig: q/k/v biases (Qwen2 always,
Llama when ``attention_bias``), a per-head RMSNorm on q and k (Qwen3), an
explicit ``head_dim``, tied embeddings, the RoPE variant, and Mistral's sliding
window (every layer attends to the last ``sliding_window`` positions).
"""

from __future__ import annotations

from core.model_config import ModelConfig
from core.models.decoder import AttentionWeights, CausalDecoder
from core.models.layers import GatedMLPWeights, Module, RMSNorm, RotaryEmbedding
from core.models.moe import MoEWeights
from core.models.recipe import (
    ACT, ATTN, GATE_UP, NORMED, PROJ, QKV, ROUTER, Attention, GatedActivation, HeadNorms, LayerOp, MixtureOfExperts,
    Product, ResidualNorm,
)


class LlamaLayer(Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.config, self.rotary = cfg, rotary
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = AttentionWeights(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        experts = cfg.moe is not None and index in cfg.moe.layers
        self.mlp: GatedMLPWeights | MoEWeights = (
            MoEWeights(cfg) if experts else GatedMLPWeights(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        )

    def ops(self) -> tuple[LayerOp, ...]:
        cfg, attn, mlp = self.config, self.self_attn, self.mlp
        shape = dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        head_norms = () if attn.q_norm is None else (HeadNorms(attn.q_norm, attn.k_norm, **shape),)
        if isinstance(mlp, MoEWeights):
            feed_forward: tuple[LayerOp, ...] = (Product("router", mlp.gate, NORMED, ROUTER), MixtureOfExperts(mlp))
        else:
            feed_forward = (
                Product("gate_up", mlp.gate_up_proj, NORMED, GATE_UP),
                GatedActivation(cfg.hidden_act),
                Product("down", mlp.down_proj, ACT, PROJ),
            )
        return (
            ResidualNorm(self.input_layernorm),
            Product("qkv", attn.qkv_proj, NORMED, QKV),
            *head_norms,
            Attention(self.rotary, scale=cfg.head_dim**-0.5, window=cfg.sliding_window or 0, **shape),
            Product("o", attn.o_proj, ATTN, PROJ),
            ResidualNorm(self.post_attention_layernorm),
            *feed_forward,
        )


class LlamaForCausalLM(CausalDecoder):
    """Llama-family causal LM (the architectures' differences are switches of its ModelConfig)."""

    def make_layer(self, cfg: ModelConfig, index: int, max_positions: int) -> LlamaLayer:
        if index == 0:  # one rotary table for every layer
            self._rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        return LlamaLayer(cfg, self._rotary, index)
