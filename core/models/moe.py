"""A mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

The router scores every expert for every token; each token goes through its top-k experts'
gated MLPs and sums their outputs, weighted by the router (core/model_config.py's ``MoEConfig``
says how the weights are normalized). Tokens are grouped by expert, so each chosen expert's
weights are read once per step and multiplied with all of its tokens at once, and experts no
token chose are not read at all. On a CPU with the C kernels, that whole step after the router
is one call (kernels/moe.py), the one the C step program runs too; elsewhere torch runs it.

The experts' weights are held as transformers 5 holds them: ``gate_up_proj`` [experts, 2 x
intermediate, hidden] ([gate | up] rows) and ``down_proj`` [experts, hidden, intermediate];
published checkpoints that name each expert's projections (``experts.N.gate_proj`` /
``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``) are copied into them at load
(``expert_part``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.model_config import ModelConfig
from core.models.layers import GatedMLPWeights, Linear, Module, gated_activation
from kernels import cpu
from kernels.linear import CpuWeight
from kernels.moe import ExpertKernel
from kernels.quant import QuantizedMatrix, QuantizedWeight
from kernels.settings import settings

# A published checkpoint's per-expert tensor: (layer prefix, expert, projection).
_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}  # gate, up, down
# A GGUF file's stacked projection of every expert, as gguf's tables name ffn_{gate,up,down}_exps.
_STACKED_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def stacked_experts(name: str) -> tuple[str, int] | None:
    """For a GGUF file's stacked projection of every expert (``experts.gate_proj`` [experts,
    rows, k], as gguf's tables name ``ffn_gate_exps``): (the experts' module, part)."""
    match = _STACKED_TENSOR.match(name)
    return None if match is None else (match.group(1), _PART[match.group(2)])


def expert_part(name: str) -> tuple[str, int, int] | None:
    """For a per-expert checkpoint tensor: (our parameter, expert, part: 0 gate, 1 up, 2 down)."""
    match = _EXPERT_TENSOR.match(name.replace(".block_sparse_moe.", ".mlp."))
    if match is None:
        return None
    prefix, expert, part = match.groups()
    return expert_parameter(prefix, _PART[part]), int(expert), _PART[part]


def expert_parameter(experts: str, part: int) -> str:
    """The stacked parameter of module ``experts`` holding projection ``part`` (0 gate, 1 up, 2 down)."""
    return f"{experts}.{'down_proj' if part == 2 else 'gate_up_proj'}"


class ExpertWeights(Module):
    """Every expert's gated MLP, stacked: float parameters, or (a GGUF file's) block formats, one
    ``QuantizedWeight`` per expert and projection over its rows of the file's stacked tensors."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.quantized: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None

    def set_quantized(self, gate: QuantizedMatrix, up: QuantizedMatrix, down: QuantizedMatrix, name: str) -> None:
        """Serve the experts from stacked block-format matrices (experts x rows rows each)."""
        _, rows, hidden = self.gate_up_proj.shape
        expected = {"gate": (gate, rows // 2, hidden), "up": (up, rows // 2, hidden), "down": (down, hidden, rows // 2)}
        for part, (matrix, expert_rows, k) in expected.items():
            if (matrix.rows, matrix.k) != (self.num_experts * expert_rows, k):
                raise ValueError(f"{name}.{part}: {matrix.rows}x{matrix.k}, expected "
                                 f"{self.num_experts} experts of {expert_rows}x{k}")
        gates, ups, downs = (m.split_rows(self.num_experts) for m in (gate, up, down))
        self.quantized = [(QuantizedWeight([g, u]), QuantizedWeight([d])) for g, u, d in zip(gates, ups, downs)]
        self._drop_floats()

    def convert(self, to_matrix: Callable[[torch.Tensor], QuantizedMatrix]) -> None:
        """Float experts in the kernels' tiles: each projection [rows, k] through ``to_matrix``
        (kept float32: ``QuantizedMatrix.from_floats``; or quantized, ``--quantization``)."""
        inter = self.gate_up_proj.shape[1] // 2
        self.quantized = [
            (QuantizedWeight([to_matrix(gate_up[:inter]), to_matrix(gate_up[inter:])]),
             QuantizedWeight([to_matrix(down)]))
            for gate_up, down in zip(self.gate_up_proj.detach(), self.down_proj.detach())
        ]
        self._drop_floats()

    def _drop_floats(self) -> None:
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return torch.from_numpy(self.quantized[expert][0].matmul(x.float().contiguous().numpy()))
        return F.linear(x, self.gate_up_proj[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return torch.from_numpy(self.quantized[expert][1].matmul(x.float().contiguous().numpy()))
        return F.linear(x, self.down_proj[expert])


class MoEWeights(Module):
    """A layer's router (``gate``), experts, and the shared expert where the family has one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.activation = cfg.hidden_act
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = ExpertWeights(moe.num_experts, cfg.hidden_size, moe.intermediate_size)
        if moe.shared_intermediate_size:
            # Qwen2-MoE's expert that every token goes through: a gated MLP of its own size
            self.shared_expert: GatedMLPWeights | None = GatedMLPWeights(cfg.hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate: Linear | None = Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.kernel: ExpertKernel | None = None  # the C kernel's view of the experts (prepare)

    def prepare(self) -> None:
        """Once the weights are loaded: on a CPU with the C kernels, the experts (and the shared
        expert) as the expert kernel reads them, float32 ones moved into its tiles (a GGUF
        file's are there already)."""
        self.kernel = None
        experts, shared = self.experts, None
        layers = () if self.shared_expert is None or self.shared_expert_gate is None else (
            self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate)
        if not ExpertKernel.takes(self.activation) or any(
                layer.quantized is None and not CpuWeight.usable(layer.weight) for layer in layers):
            return
        if experts.quantized is None:
            weight = experts.gate_up_proj
            if not weight.numel() or not (CpuWeight.usable(weight) and cpu.usable(weight)):
                return  # no weights (asleep), or not float32 on a CPU with the C kernels
            experts.convert(lambda weight: QuantizedMatrix.from_floats(weight.numpy()))
        if layers:
            for layer in layers:
                if layer.quantized is None:  # float32: into the kernels' tiles, the float weight dropped
                    layer.set_quantized([QuantizedMatrix.from_floats(layer.weight.detach().numpy())])
                    layer.prepare()
            shared = tuple(layer.quantized for layer in layers)
        self.kernel = ExpertKernel(experts.quantized, self.top_k, self.normalize, self.activation, shared)

    def route(self, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the logits' dtype, experts [T, k]): softmax over the router's
        logits in float32, its top k, renormalized where the family does."""
        probs = torch.softmax(router.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router.dtype), experts

    def forward(self, x: torch.Tensor, router: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> the mixture's output [T, hidden] (``router``: the router's logits
        of x, where already computed)."""
        if router is None:
            router = self.gate(x)
        if self.kernel is not None and cpu.usable(x, router):  # the shared expert too
            out = torch.empty_like(x)
            self.kernel(x.contiguous().numpy(), router.contiguous().numpy(), out.numpy(),
                        settings.quantize_activations, torch.get_num_threads())
            return out
        out = self._experts_torch(x, router)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert.down_proj(gated_activation(self.activation, self.shared_expert.gate_up_proj(x)))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def _experts_torch(self, x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """The experts' mixture, grouped by expert in torch (GPUs, and CPUs without the C kernels)."""
        weights, experts = self.route(router)
        out = torch.zeros_like(x)
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen, minlength=self.experts.num_experts).tolist()
        tokens, slots = order // self.top_k, order % self.top_k
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue  # nobody chose it: its weights are not read
            rows = tokens[start : start + count]
            picked = slots[start : start + count]
            start += count
            gate_up = self.experts.gate_up(expert, x[rows])
            y = self.experts.down(expert, gated_activation(self.activation, gate_up))
            out.index_add_(0, rows, y * weights[rows, picked, None])
        return out
