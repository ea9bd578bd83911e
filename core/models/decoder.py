"""The decoder-only causal LM every family shares: weights, loading, and the forward pass that
runs the family's recipe (core/models/recipe.py).

A family subclasses ``CausalDecoder`` with its layer module (whose ``ops()`` lists
what the layer runs) and, where it has them, an embedding scale and the offset its
norms are stored with (Gemma keeps ``w`` for a ``(1 + w)`` scale). Everything else —
the embedding and head (tied or not, float or GGUF block formats), the Hugging Face
names of the fused q/k/v and gate/up products, the checks that a checkpoint fills
the model exactly — is here once. The forward pass takes a flat batch of tokens (no
batch dimension, no padding): prefill chunks and decodes of many requests side by
side, their K/V going to and coming from the paged cache that ``AttentionMetadata``
describes.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

import kernels
from core.model_config import ModelConfig
from core.models.layers import Embedding, Linear, Module, RMSNorm
from core.models.moe import ExpertWeights, MoEWeights, expert_parameter, expert_part, stacked_experts
from core.models.recipe import Recipe, ResidualNorm, TorchStep
from kernels.metadata import AttentionMetadata
from kernels.quant import QuantizedMatrix

KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionWeights(Module):
    """A layer's attention weights under their Hugging Face names: fused q/k/v, output
    projection, and the per-head q and k norms of the families that have them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None


class DecoderModel(nn.Module):
    """The ``model.`` prefix of Hugging Face checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        # Given its tensor, nn.Embedding skips its random init, which on the meta
        # device would import torch's compiler stack (seconds of start-up).
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# HF name fragment -> (our fused parameter fragment, shard index within it).
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class CausalDecoder(nn.Module, metaclass=ABCMeta):
    """A causal LM over a paged KV cache whose layers a family describes (``make_layer``)."""

    # Gemma scales the embedding by sqrt(hidden) and stores norm weights as offsets from 1.
    scales_embedding = False
    norm_offset = 0.0

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        """``max_positions``: the longest context the model will see (the rotary
        tables' size); the checkpoint's ``max_position_embeddings`` by default."""
        super().__init__()
        self.config = cfg
        positions = max_positions or cfg.max_position_embeddings
        self.model = DecoderModel(cfg, [self.make_layer(cfg, i, positions) for i in range(cfg.num_layers)])
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # The modules' parameters may be replaced (loading, to_empty, a weight reload); the
        # operations hold the modules, so the recipe stays valid.
        self._recipe = Recipe(
            config=cfg, embedding=self.model.embed_tokens,
            embed_scale=cfg.hidden_size**0.5 if self.scales_embedding else None,
            layers=tuple(layer.ops() for layer in self.model.layers),
            final_norm=ResidualNorm(self.model.norm), lm_head=self.lm_head,
        )

    @abstractmethod
    def make_layer(self, cfg: ModelConfig, index: int, max_positions: int) -> nn.Module:
        """Layer ``index``: a module whose ``ops()`` is its recipe (each family defines it)."""

    def recipe(self) -> Recipe:
        return self._recipe

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

    def prepare_for_inference(self) -> None:
        """Call once the weights are in place (and again if they are replaced):
        the dense layers make their CPU fast-path views of the weights."""
        for module in self.modules():
            if isinstance(module, (Linear, MoEWeights)):
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

        Every layer writes its new K/V into ``kv_caches[layer]`` at its
        ``attn_metadata.for_layer(layer).slot_mapping`` before attending.
        """
        recipe = self._recipe
        hidden = recipe.embedding(input_ids) if inputs_embeds is None else inputs_embeds
        if recipe.embed_scale is not None:
            hidden = _scaled(hidden, recipe.embed_scale, inputs_embeds is not None)
        step = TorchStep(hidden, positions, attn_metadata)
        for index, (ops, kv_cache) in enumerate(zip(recipe.layers, kv_caches, strict=True)):
            step.kv_cache = kv_cache
            step.meta = attn_metadata.for_layer(index)  # its KV cache group's slots and tables
            for op in ops:
                op.run(step)
        recipe.final_norm.run(step)
        return step.normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    # -- loading ------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], norms_shifted: bool = False) -> set[str]:
        """Copy Hugging Face named tensors into the (partly fused) parameters.

        Returns the names of our parameters that were filled; raises on a
        tensor with no home or a shape mismatch, so a wrong checkpoint fails
        loudly instead of serving garbage. ``norms_shifted``: the norm weights
        already include the family's ``norm_offset`` (llama.cpp's Gemma files).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        blocks: dict[str, dict[int, QuantizedMatrix]] = {}  # block-format weights, by parameter and shard
        expert_parts: dict[str, set[tuple[int, int]]] = {}  # per-expert tensors copied, by parameter
        expert_blocks: dict[str, dict[int, QuantizedMatrix]] = {}  # stacked experts in block formats
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's published name
            stacked = stacked_experts(name)  # a GGUF file's experts: one tensor per projection
            if stacked is not None and isinstance(tensor, QuantizedMatrix):
                expert_blocks.setdefault(stacked[0], {})[stacked[1]] = tensor
                continue
            part = expert_part(name)
            if part is not None or stacked is not None:  # experts in floats: into the stacked parameters
                slices = [(*part, tensor)] if part is not None else [
                    (expert_parameter(stacked[0], stacked[1]), expert, stacked[1], matrix)
                    for expert, matrix in enumerate(tensor)
                ]
                for target, expert, part_index, matrix in slices:
                    self._load_expert(params, target, expert, part_index, matrix)
                    expert_parts.setdefault(target, set()).add((expert, part_index))
                continue
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
            if self.norm_offset and not norms_shifted and name.endswith("norm.weight"):
                tensor = tensor + self.norm_offset  # the scale the norm multiplies by
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
                if tensor.dim() == 1 and param.shape == (1, tensor.shape[0]):
                    tensor = tensor[None]  # a one-output gate stored as a vector (Qwen2-MoE's shared expert's)
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        for target, parts in expert_parts.items():  # a stacked parameter is loaded when every expert is
            experts, shards = params[target].shape[0], 1 if target.endswith(".down_proj") else 2
            if len(parts) == experts * shards:
                loaded.add(target)
        self._use_blocks(blocks)
        self._use_expert_blocks(expert_blocks, loaded)
        return loaded

    def _use_expert_blocks(self, expert_blocks: dict[str, dict[int, QuantizedMatrix]], loaded: set[str]) -> None:
        """Serve the experts whose stacked weights came in block formats from those blocks."""
        for target, parts in expert_blocks.items():
            if sorted(parts) != [0, 1, 2]:
                raise ValueError(f"{target}: some of its projections are in a block format and some are not")
            experts = self.get_submodule(target)
            assert isinstance(experts, ExpertWeights)
            experts.set_quantized(parts[0], parts[1], parts[2], target)
            loaded |= {f"{target}.gate_up_proj", f"{target}.down_proj"}

    @staticmethod
    def _load_expert(
        params: dict[str, nn.Parameter], target: str, expert: int, part: int, tensor: torch.Tensor
    ) -> None:
        """One expert's gate (0), up (1) or down (2) projection into its stacked parameter."""
        stacked = CausalDecoder._param(params, target).data
        if expert >= stacked.shape[0]:
            raise ValueError(f"{target}: expert {expert} of a layer of {stacked.shape[0]}")
        if part == 2:
            destination = stacked[expert]
        else:  # gate_up rows: [gate | up]
            half = stacked.shape[1] // 2
            destination = stacked[expert, part * half : (part + 1) * half]
        if tensor.shape != destination.shape:
            raise ValueError(
                f"{target}: expert {expert}'s tensor is {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
            )
        destination.copy_(tensor)

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
        half = self.get_submodule(target.rsplit(".", 1)[0]).out_features // 2  # a shared expert's own size
        return [half, half]

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


def _scaled(hidden: torch.Tensor, factor: float, borrowed: bool) -> torch.Tensor:
    """The embeddings times ``factor`` (in place unless they are the caller's ``inputs_embeds``)."""
    return kernels.scale_rows(hidden.clone() if borrowed else hidden, factor)
