"""Gemma 3's text decoder as a recipe.

What sets it apart from the Llama family: the embedding is scaled by sqrt(hidden);
every block's output is normed before it joins the residual stream (four norms a
layer), and all norms scale by ``1 + w`` (the loader adds the 1 once, so the
kernels are the usual RMSNorm); the MLP is GeGLU (tanh-approximated GELU); q and k
are normed per head; attention scales by ``query_pre_attn_scalar ** -0.5``; and
layers alternate between local ones (a sliding window, their own rope base) and
global ones (the whole context, the model's rope base and scaling), as
``layer_types`` lists them.
"""

from __future__ import annotations

from core.model_config import ModelConfig
from core.models.decoder import AttentionWeights, CausalDecoder
from core.models.layers import GatedMLPWeights, Module, RMSNorm, RotaryEmbedding
from core.models.recipe import (
    ACT, ATTN, GATE_UP, NORMED, PROJ, QKV, Attention, GatedActivation, HeadNorms, LayerOp, Norm, Product,
    ResidualNorm,
)


class Gemma3Layer(Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, window: int) -> None:
        super().__init__()
        self.config, self.rotary, self.window = cfg, rotary, window
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = AttentionWeights(cfg)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = GatedMLPWeights(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def ops(self) -> tuple[LayerOp, ...]:
        cfg, attn, mlp = self.config, self.self_attn, self.mlp
        shape = dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        return (
            ResidualNorm(self.input_layernorm),
            Product("qkv", attn.qkv_proj, NORMED, QKV),
            HeadNorms(attn.q_norm, attn.k_norm, **shape),
            Attention(self.rotary, scale=cfg.query_pre_attn_scalar**-0.5, window=self.window, **shape),
            Product("o", attn.o_proj, ATTN, PROJ),
            Norm(self.post_attention_layernorm),
            ResidualNorm(self.pre_feedforward_layernorm),
            Product("gate_up", mlp.gate_up_proj, NORMED, GATE_UP),
            GatedActivation(cfg.hidden_act),
            Product("down", mlp.down_proj, ACT, PROJ),
            Norm(self.post_feedforward_layernorm),
        )


class Gemma3ForCausalLM(CausalDecoder):
    scales_embedding = True
    norm_offset = 1.0

    def make_layer(self, cfg: ModelConfig, index: int, max_positions: int) -> Gemma3Layer:
        if index == 0:  # one rotary table per layer kind
            self._global_rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
            self._local_rotary = RotaryEmbedding(
                cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling, max_positions
            )
        window = cfg.layer_window(index)
        return Gemma3Layer(cfg, self._local_rotary if window else self._global_rotary, window)
