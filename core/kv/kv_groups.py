"""A model's KV cache groups: which layers share a block table, and which cache tensor each uses.

Layers that read the same span of context can share block tables: the layers that attend
to the whole context, and the layers of each sliding window. A model with one kind of
layer (Llama; Mistral, its window in every layer) has one group of all its layers. Gemma 2
and 3 interleave local layers (a window) with global ones; their layers are cut into
groups of equal size, as vLLM's hybrid allocator does: as many layers as the smallest kind
has (Gemma 3 1B: its 4 global layers are one group, its 22 local ones six groups of 4,
the last of them half empty). Every group has its own block table per request, and all
of them draw blocks from one pool. A block id then names a slot in each of ``num_slots``
cache tensors, and the i-th layer of every group uses tensor i: a block given to a local
group holds those local layers' keys and values, one given to the global group the global
layers'. A local group holds only the blocks of its requests' windows and gives the others
back, so the memory follows what the running requests need: long requests leave most of
the pool to the global layers, short ones to all alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.model_config import ModelConfig
from core.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int, ...]  # each group's sliding window (0: the whole context); whole-context groups first
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's cache tensor: its place in its group
    num_slots: int  # cache tensors: the layers of a group

    @classmethod
    def of(cls, config: ModelConfig) -> KVCacheGroups:
        per_layer = [config.layer_window(i) for i in range(config.num_layers)]
        kinds = {w: [i for i, x in enumerate(per_layer) if x == w] for w in sorted(set(per_layer))}
        size = min(len(layers) for layers in kinds.values())
        windows: list[int] = []
        layer_group, layer_slot = [0] * len(per_layer), [0] * len(per_layer)
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _request_blocks(self, group: int, block_size: int, step_tokens: int, max_blocks_per_req: int) -> int:
        """The most blocks one request holds in ``group`` while a step adds ``step_tokens``: all
        of them, or in a window's group its window, a block either side, and the step's tokens."""
        window = self.windows[group]
        if not window:
            return max_blocks_per_req
        return min(max_blocks_per_req, cdiv(window - 1 + step_tokens, block_size) + 1)

    def least_blocks(self, block_size: int, max_num_batched_tokens: int, max_model_len: int) -> int:
        """The usable blocks (the null one aside) one request needs to run alone to
        ``max_model_len``, over every group. With fewer, a long request could wait forever."""
        whole = cdiv(max_model_len, block_size)
        return sum(self._request_blocks(g, block_size, max_num_batched_tokens, whole) for g in range(self.num_groups))

    def most_blocks(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                    max_blocks_per_req: int) -> int:
        """The blocks (the null one included) the running requests can hold at once: in each
        whole-context group every request's full length, in each window's group every request's
        window and a block either side, plus the step's new tokens. Past that, blocks only keep
        evicted prefixes."""
        total = 1
        for group in range(self.num_groups):
            if self.windows[group]:
                per_request = self._request_blocks(group, block_size, 1, max_blocks_per_req) + 1
                total += min(max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size),
                             max_num_seqs * max_blocks_per_req)
            else:
                total += max_num_seqs * max_blocks_per_req
        return total
