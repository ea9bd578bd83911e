"""CUDA graphs for decode-only steps (every request computes one token).

A decode step of a small model is dominated by kernel launches: about ten
per layer, each a few microseconds of host time, while the GPU work per
kernel is tiny. A CUDA graph records the whole forward pass once and replays
it with a single launch. Replays reuse the recorded shapes and addresses, so
(as in vLLM and nano-vllm):

- graphs are captured for a list of batch sizes, and a batch of n decodes
  runs as the smallest captured size B >= n, rows n..B-1 being harmless
  fillers (``InputBuffers.fill_decode_padding``: slot -1, one token of
  context in block 0);
- every input is read in place from the runner's persistent device buffers
  (``InputBuffers``), so a step only refills them before ``replay()``; the
  attention metadata's host-side values (B requests, query length 1) are
  fixed per graph, and the kernels read lengths and block tables from
  device memory;
- the output hidden states are the graph's own static tensor, valid until
  the next replay of any graph (they share one memory pool).

The padding is separate from capture: without ``capture`` (the CPU, in
tests) ``run`` executes the very same padded forward eagerly, which is how a
CPU test shows that padded decode batches give exactly the tokens of
unpadded ones. Capture and replay themselves need a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


def decode_batch_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to the largest decode batch the scheduler can form."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


class DecodeGraphs:
    """Padded decode batch sizes, and a captured graph per size once ``capture`` ran."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(set(sizes))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest size that holds ``num_reqs`` decodes; None when none does."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self, size: int, forward: Callable[[], torch.Tensor]) -> None:
        """Record ``forward`` (the model over the static buffers' first ``size`` rows).

        Capture the largest size first: later, smaller graphs then fit in the
        memory the first one reserved in the shared pool. One eager run first
        compiles the Triton kernels for this grid and settles lazy state
        (e.g. device copies of RoPE tables) outside the capture.
        """
        forward()
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        self._graphs[size] = graph
        self._outputs[size] = output

    def run(self, size: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Hidden states [size, hidden]: the graph's replay if captured, else ``forward()``."""
        graph = self._graphs.get(size)
        if graph is None:
            return forward()
        graph.replay()
        return self._outputs[size]
