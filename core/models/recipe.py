"""A decoder layer described once, as the operations it runs: what every executor runs.

A model family (core/models/llama.py, core/models/gemma3.py) builds its
layers' weights and lists each layer's operations in order; the operations
name the modules holding their weights and the activation buffers they read
and write. Three executors run the same list:

- the forward pass (``CausalDecoder.forward``, core/models/decoder.py), with
  torch tensors, on any device (on a GPU inside CUDA graphs), each
  operation's ``run`` below;
- the CPU step program (core/worker/cpu_program.py), calling the C kernels
  through ctypes into fixed numpy buffers;
- the one-call C step program (kernels/cpu/step_program.c), which gets the
  list emitted as opcodes.

So a family is written once, and a new kind of layer costs one new
operation (its ``run`` and one kernel call per executor), not a new copy of
the decoder. The buffers are the ones every executor keeps per step:

- ``HIDDEN``: the residual stream; ``NORMED``: the last norm's output;
- ``QKV``: the fused q/k/v rows; ``ATTN``: attention's output;
- ``PROJ``: a block's output (attention's or the MLP's projection), added
  to the residual stream by the next ``ResidualNorm``;
- ``GATE_UP``: the fused gate/up rows; ``ACT``: the gated activation;
- ``ROUTER``: a mixture of experts' router logits.

A mixture of experts is its router (a ``Product`` from ``NORMED`` to ``ROUTER``) and one
``MixtureOfExperts`` operation from ``NORMED`` and ``ROUTER`` to ``PROJ``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kernels
from core.models.layers import Linear, RMSNorm, RotaryEmbedding, gated_activation
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from core.model_config import ModelConfig
    from core.models.layers import Embedding
    from core.models.moe import MoEWeights

HIDDEN, NORMED, QKV, ATTN, PROJ, GATE_UP, ACT = "hidden", "normed", "qkv", "attn", "proj", "gate_up", "act"
ROUTER = "router"
BUFFERS = (HIDDEN, NORMED, QKV, ATTN, PROJ, GATE_UP, ACT, ROUTER)
# The gated activations: act(gate) * up.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


class TorchStep:
    """The forward pass's buffers for one step: one attribute per buffer name (``proj`` is None
    until a block has produced an output the residual stream has not taken yet)."""

    __slots__ = (*BUFFERS, "positions", "meta", "kv_cache")

    def __init__(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        self.hidden = hidden
        self.proj: torch.Tensor | None = None
        self.positions, self.meta = positions, meta


@dataclass(frozen=True, slots=True)
class ResidualNorm:
    """The residual stream takes ``PROJ`` (nothing before the first layer), then
    ``NORMED = norm(stream)``: the residual add fused with the norm after it."""

    norm: RMSNorm

    def run(self, s: TorchStep) -> None:
        if s.proj is None:
            s.normed = self.norm(s.hidden)
        else:
            s.normed, s.hidden = self.norm(s.proj, s.hidden)
            s.proj = None


@dataclass(frozen=True, slots=True)
class Norm:
    """``PROJ = norm(PROJ)``: a block's output normed before it joins the stream (Gemma)."""

    norm: RMSNorm

    def run(self, s: TorchStep) -> None:
        s.proj = self.norm(s.proj)


@dataclass(frozen=True, slots=True)
class Product:
    """``out = src @ Wᵀ (+ bias)``, plus the step's LoRA deltas where the product has adapters.
    ``name`` is what adapters know the product by (qkv, o, gate_up, down)."""

    name: str
    linear: Linear
    src: str
    out: str

    def run(self, s: TorchStep) -> None:
        setattr(s, self.out, self.linear(getattr(s, self.src)))


@dataclass(frozen=True, slots=True)
class HeadNorms:
    """RMSNorm of each query head and each key head inside ``QKV``, in place (Qwen3, Gemma 3)."""

    q_norm: RMSNorm
    k_norm: RMSNorm
    heads: int
    kv_heads: int
    head_dim: int

    def run(self, s: TorchStep) -> None:
        qkv, heads, kv_heads = s.qkv, self.heads, self.kv_heads
        view = qkv.view(qkv.shape[0], -1, self.head_dim)
        view[:, :heads] = self.q_norm(view[:, :heads])
        view[:, heads : heads + kv_heads] = self.k_norm(view[:, heads : heads + kv_heads])


@dataclass(frozen=True, slots=True)
class Attention:
    """q and k of ``QKV`` rotated by ``rotary`` at the step's positions, this step's K/V
    written to the layer's cache, then ``ATTN`` = paged causal attention, seeing the last
    ``window`` positions where the layer has a sliding window (0: all of them)."""

    rotary: RotaryEmbedding
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int

    def run(self, s: TorchStep) -> None:
        qkv, heads, kv_heads = s.qkv, self.heads, self.kv_heads
        tokens = qkv.shape[0]
        qkv = qkv.view(tokens, heads + 2 * kv_heads, self.head_dim)
        kernels.rotary(qkv, heads + kv_heads, *self.rotary.tables(qkv.device, qkv.dtype), s.positions)
        k_cache, v_cache = s.kv_cache
        kernels.write_kv_cache(
            qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :], k_cache, v_cache, s.meta.slot_mapping,
            s.meta.may_pad,
        )
        out = kernels.paged_attention(qkv[:, :heads], k_cache, v_cache, s.meta, self.scale, window=self.window)
        s.attn = out.view(tokens, heads * self.head_dim)


@dataclass(frozen=True, slots=True)
class GatedActivation:
    """``ACT = act(gate) * up`` over ``GATE_UP`` = [gate | up] rows."""

    kind: str  # one of ACTIVATIONS

    def run(self, s: TorchStep) -> None:
        s.act = gated_activation(self.kind, s.gate_up)


@dataclass(frozen=True, slots=True)
class MixtureOfExperts:
    """``PROJ`` = the mixture of experts over ``NORMED`` routed by ``ROUTER`` (core/models/moe.py):
    each token's top-k experts' gated MLPs weighted by the router, plus the shared expert where
    there is one (on a CPU one C operation: kernels/moe.py)."""

    moe: MoEWeights

    def run(self, s: TorchStep) -> None:
        s.proj = self.moe(s.normed, s.router)


LayerOp = ResidualNorm | Norm | Product | HeadNorms | Attention | GatedActivation | MixtureOfExperts


@dataclass(frozen=True)
class Recipe:
    """A whole model as its executors run it: the embedding (scaled by ``embed_scale`` where
    the family scales it), each layer's operations, the final ``ResidualNorm`` and the head."""

    config: ModelConfig
    embedding: Embedding
    embed_scale: float | None
    layers: tuple[tuple[LayerOp, ...], ...]
    final_norm: ResidualNorm
    lm_head: Linear

    def products(self) -> list[Linear]:
        """Every product's layer, in the order the layers run them, then the head."""
        return [op.linear for ops in self.layers for op in ops if isinstance(op, Product)] + [self.lm_head]
