"""A mixture-of-experts layer's experts as the C kernel runs them (kernels/cpu/moe_kernels.c).

``ExpertKernel`` describes a layer's experts once, as the kernel reads them: the routing
(top k, renormalized or not), the gated activation, and each expert's gate/up and down
weights in kernels/quant.py's tiled formats. Called with a step's normed rows and router
logits, it routes every token, runs each chosen expert once over all of its tokens and
writes the weighted sums: the forward pass calls it, and the C step program runs the same
function as one of its operations, so both give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels import cpu
from kernels.quant import QuantizedWeight

# The gated activations the kernel computes, by its codes.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


class ExpertKernel:
    """A layer's experts: ``experts[e]`` = (gate/up weight [2 x intermediate, hidden], its
    rows [gate | up]; down weight [hidden, intermediate]); ``shared``: Qwen2-MoE's shared expert
    (gate/up, down, and its gate [1, hidden]), which every token goes through, weighted by the
    sigmoid of its gate."""

    def __init__(self, experts: Sequence[tuple[QuantizedWeight, QuantizedWeight]], top_k: int, normalize: bool,
                 activation: str, shared: tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight] | None = None,
                 block_rows: int = 0) -> None:
        gate_up, down = experts[0]
        self.num_experts, self.top_k = len(experts), top_k
        self.hidden, self.intermediate = gate_up.in_features, down.in_features
        shapes = {(g.out_features, g.in_features, d.out_features, d.in_features) for g, d in experts}
        if shapes != {(2 * self.intermediate, self.hidden, self.hidden, self.intermediate)}:
            raise ValueError(f"experts of different shapes: {sorted(shapes)}")
        if not 0 < top_k <= len(experts):
            raise ValueError(f"{top_k} experts per token of {len(experts)}")
        shared_size = 0
        if shared is not None:
            gate_up, down, gate = shared
            shared_size = down.in_features
            if (gate_up.out_features, gate_up.in_features, down.out_features, gate.out_features, gate.in_features) != (
                    2 * shared_size, self.hidden, self.hidden, 1, self.hidden):
                raise ValueError("the shared expert's weights do not fit the experts' hidden size")
        self._experts = (list(experts), shared)  # what the description points into, kept alive
        # block_rows: tokens routed and run at a time (0: as many as 16 MiB of expert outputs hold)
        header = [len(experts), top_k, int(normalize), ACTIVATIONS[activation], self.hidden, self.intermediate,
                  block_rows, shared_size]
        tail = [] if shared is None else [w.desc_address for w in shared]
        self._desc = np.array(
            header + [g.desc_address for g, _ in experts] + [d.desc_address for _, d in experts] + tail, np.int64
        )
        self.desc_address = self._desc.ctypes.data

    @staticmethod
    def takes(activation: str) -> bool:
        return activation in ACTIVATIONS and cpu.load() is not None

    def scratch_bytes(self, rows: int, threads: int) -> int:
        """The scratch the program's operation needs for steps of up to ``rows`` tokens."""
        return int(cpu.load().moe_scratch_bytes(self.desc_address, rows, threads))

    def __call__(self, x: np.ndarray, router: np.ndarray, out: np.ndarray, quantize: bool, threads: int) -> None:
        """out [n, hidden] = the experts' mixture of x [n, hidden] routed by ``router`` [n,
        experts] (float32, C-contiguous)."""
        n = x.shape[0]
        assert x.shape == (n, self.hidden) and router.shape == (n, self.num_experts) and out.shape == x.shape
        assert x.flags.c_contiguous and router.flags.c_contiguous and out.flags.c_contiguous
        cpu.load().moe_experts(self.desc_address, x.ctypes.data, router.ctypes.data, n, out.ctypes.data,
                               int(quantize), threads)
