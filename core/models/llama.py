"""One decoder-only transformer covering the Llama family.

Llama, Mistral, Qwen2 and Qwen3 differ only in switches: q/k/v biases
(Qwen2 always, Llama when ``attention_bias``), a per-head RMSNorm on q and k
(Qwen3), an explicit ``head_dim``, tied embeddings and the RoPE variant. The
forward pass takes a flat batch of tokens (no batch dimension, no padding):
prefill chunks and decodes of many requests side by side, their K/V going
to and coming from the paged cache described by ``AttentionMetadata``.

q/k/v and gate/up projections are fused into one matmul each (fewer kernel
launches and one read of the activations); ``load_weights`` slices the
Hugging Face tensors into the fused parameters. The layers are written for
few calls per step (core/models/layers.py says why).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from core.model_config import ModelConfig
from core.models.layers import Embedding, Linear, Module, RMSNorm, RotaryEmbedding
from kernels.linear import DenseRows
from kernels.metadata import AttentionMetadata
from kernels.quant import QuantizedMatrix

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # cos table, sin± table, the step's positions

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Attention(Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv[:, :heads] = self.q_norm(qkv[:, :heads])
            qkv[:, heads : heads + kv_heads] = self.k_norm(qkv[:, heads : heads + kv_heads])
        kernels.rotary(qkv, heads + kv_heads, *rope)  # q and k together, in place
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        k_cache, v_cache = kv_cache
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, meta.may_pad)
        out = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = None if cfg.hidden_act == "silu" else _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is None:
            return self.down_proj(kernels.silu_mul(gate_up))
        size = self.intermediate_size
        return self.down_proj(self.act(gate_up[:, :size]) * gate_up[:, size:])


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's weights in the order its forward pass uses them: input norm,
    fused q/k/v (then per-head q and k norms, if any; rotary; KV write; attention),
    output projection, the residual add fused with the post-attention norm, fused
    gate/up, the activation, down projection. What the CPU step program runs."""

    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class DecoderParts:
    """The whole model as the CPU step program runs it (core/worker/cpu_program.py):
    described here, by the model, so that the two never disagree on what a layer is."""

    config: ModelConfig
    embedding: DenseRows | QuantizedMatrix  # looked up by id (take_rows)
    rotary: RotaryEmbedding
    layers: list[LayerParts]
    final_norm: torch.Tensor
    lm_head: Linear


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def parts(self) -> LayerParts:
        attn, mlp = self.self_attn, self.mlp
        return LayerParts(
            input_norm=self.input_layernorm.weight, qkv=attn.qkv_proj,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            o=attn.o_proj, post_norm=self.post_attention_layernorm.weight,
            gate_up=mlp.gate_up_proj, down=mlp.down_proj,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately, so that each residual add
        is fused into the norm after it: (this layer's MLP output, the stream
        before it). The first layer gets ``residual=None``."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """The ``model.`` prefix of Hugging Face checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Given its tensor, nn.Embedding skips its random init, which on the meta
        # device would import torch's compiler stack (seconds of start-up).
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# HF name fragment -> (our fused parameter fragment, shard index within it).
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (the architectures' differences
    are switches of its ModelConfig)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        """``max_positions``: the longest context the model will see (the rotary
        table's size); the checkpoint's ``max_position_embeddings`` by default."""
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head when the checkpoint says so.

        Call again after ``to_empty``/``_apply``, which replace parameters one
        module at a time and so undo the sharing.
        """
        if self.head_is_embedding:
            embedding = self.model.embed_tokens
            if embedding.quantized is not None:
                self.lm_head.set_quantized([embedding.quantized])
            else:
                self.lm_head.weight = embedding.weight

    @property
    def head_is_embedding(self) -> bool:
        """The head shares the embedding's weights: tied, or (a headless checkpoint, served
        for pooling only) standing in for a head that was never saved."""
        return self.config.tie_word_embeddings or self.config.headless

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def parts(self) -> DecoderParts:
        """The model described for the CPU step program (the same tensors the forward pass uses)."""
        model = self.model
        return DecoderParts(
            config=self.config, embedding=model.embed_tokens.table(), rotary=model.rotary,
            layers=[layer.parts() for layer in model.layers], final_norm=model.norm.weight, lm_head=self.lm_head,
        )

    def prepare_for_inference(self) -> None:
        """Call once the weights are in place (and again if they are replaced):
        the dense layers make their CPU fast-path views of the weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flat tokens [T] at ``positions`` [T] -> final hidden states [T, hidden].

        Every layer writes its new K/V into ``kv_caches[layer]`` at
        ``attn_metadata.slot_mapping`` before attending.
        """
        model = self.model
        hidden = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = (*model.rotary.tables(hidden.device, hidden.dtype), positions)
        residual = None
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        return model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face named tensors into the (partly fused) parameters.

        Returns the names of our parameters that were filled; raises on a
        tensor with no home or a shape mismatch, so a wrong checkpoint fails
        loudly instead of serving garbage.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        blocks: dict[str, dict[int, QuantizedMatrix]] = {}  # block-format weights, by parameter and shard
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.head_is_embedding:
                continue  # the embedding is the head
            if self.config.headless and not name.startswith("model."):
                name = f"model.{name}"  # a headless checkpoint names the body's tensors bare
            if isinstance(tensor, QuantizedMatrix):
                target, shard = self._fused_target(name)
                self._param(params, target)
                blocks.setdefault(target, {})[shard] = tensor
                loaded.add(f"{target}#{shard}" if target != name else name)
                continue
            for hf_part, (our_part, shard) in _FUSED.items():
                if hf_part in name:
                    target = name.replace(hf_part, our_part)
                    self._param(params, target).data[self._shard_rows(target, shard)].copy_(
                        self._checked(target, tensor, self._shard_len(target, shard))
                    )
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                param = self._param(params, name)
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        self._use_blocks(blocks)
        return loaded

    @staticmethod
    def _fused_target(name: str) -> tuple[str, int]:
        """Our parameter holding Hugging Face tensor ``name``, and its shard there (0 unfused)."""
        for hf_part, (our_part, shard) in _FUSED.items():
            if hf_part in name:
                return name.replace(hf_part, our_part), shard
        return name, 0

    def _use_blocks(self, blocks: dict[str, dict[int, QuantizedMatrix]]) -> None:
        """Serve the layers whose weights came in block formats from those blocks."""
        modules = dict(self.named_modules())
        for target, shards in blocks.items():
            module = modules[target.rsplit(".", 1)[0]]
            count = len(self._shard_sizes(target)) if ".qkv_proj." in target or ".gate_up_proj." in target else 1
            if sorted(shards) != list(range(count)):
                raise ValueError(f"{target}: some of its parts are in a block format and some are not")
            if target.endswith(".bias"):
                raise ValueError(f"{target}: a bias in a block format")
            if isinstance(module, Embedding):
                rows, columns = [module.num_embeddings], module.embedding_dim
            else:
                rows = self._shard_sizes(target) if count > 1 else [module.out_features]
                columns = module.in_features
            for i, matrix in shards.items():
                if (matrix.rows, matrix.k) != (rows[i], columns):
                    raise ValueError(f"{target}: checkpoint part {i} is {matrix.rows}x{matrix.k}, expected {rows[i]}x{columns}")
            if isinstance(module, Embedding):
                module.set_quantized(shards[0])
            else:
                module.set_quantized([shards[i] for i in range(count)])
        self.tie_weights()

    def expected_weights(self) -> set[str]:
        """What ``load_weights`` must have filled for the model to be complete."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():  # tied parameters are listed once
            if name == "lm_head.weight" and self.head_is_embedding:
                continue  # the embedding's (a separate, empty one when the head is in a block format)
            if ".qkv_proj." in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(name)
        return expected

    # -- helpers for fused parameters ------------------------------------------------

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        try:
            return params[name]
        except KeyError:
            raise ValueError(f"checkpoint tensor {name!r} matches no model parameter") from None

    def _shard_sizes(self, target: str) -> list[int]:
        cfg = self.config
        if ".qkv_proj." in target:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [q, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def _shard_len(self, target: str, shard: int) -> int:
        return self._shard_sizes(target)[shard]

    def _shard_rows(self, target: str, shard: int) -> slice:
        sizes = self._shard_sizes(target)
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    @staticmethod
    def _checked(target: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        if tensor.shape[0] != rows:
            raise ValueError(f"{target}: checkpoint shard has {tensor.shape[0]} rows, expected {rows}")
        return tensor
