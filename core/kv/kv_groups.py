"""A model's KV cache groups: which layers share a block table, and how many blocks each gets.

Layers that read the same span of context share one group: the layers that attend to
the whole context (group 0 when there are any), and the layers of each sliding window.
A model with one kind of layer (Llama; Mistral, its window in every layer) has one
group. Gemma 2 and 3 interleave local layers (a window) with global ones: the local
layers' group only ever holds the blocks of its requests' windows, so its pool, and
the memory behind it, is sized to what those windows can hold, and the rest of the
budget goes to the layers that keep everything. (vLLM's hybrid allocator shares one
pool between groups of equal layer counts instead; separate pools here keep each
layer's cache a plain tensor of its own.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.model_config import ModelConfig
from core.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int, ...]  # each group's sliding window (0: the whole context), 0 first
    layer_group: tuple[int, ...]  # each layer's group

    @classmethod
    def of(cls, config: ModelConfig) -> KVCacheGroups:
        per_layer = [config.layer_window(i) for i in range(config.num_layers)]
        windows = tuple(sorted(set(per_layer))) or (0,)
        return cls(windows, tuple(windows.index(w) for w in per_layer))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def layers_in(self, group: int) -> int:
        return self.layer_group.count(group)

    def most_blocks(self, group: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                    max_blocks_per_req: int) -> int:
        """The blocks (the null one included) that group's running requests can hold at once: a
        whole-context group, each request's full length; a window's group, each request's window
        and a block either side of it, plus the step's new tokens. Past that a window's group
        runs out only in odd schedules (many requests whose last chunk was long), where the
        scheduler preempts, as it does when any pool runs short."""
        whole = max_num_seqs * max_blocks_per_req + 1
        window = self.windows[group]
        if not window:
            return whole
        in_windows = max_num_seqs * (cdiv(window - 1, block_size) + 2) + cdiv(max_num_batched_tokens, block_size) + 1
        return min(whole, in_windows)

    def least_blocks(self, group: int, block_size: int, max_num_batched_tokens: int, max_model_len: int) -> int:
        """The usable blocks (the null one aside) that group needs for one request to run alone
        to ``max_model_len``: all of its blocks, or in a window's group its window and a step's
        tokens. With fewer, a long request could wait forever."""
        whole = cdiv(max_model_len, block_size)
        window = self.windows[group]
        return min(whole, cdiv(window - 1 + max_num_batched_tokens, block_size) + 1) if window else whole

    def split(self, layer_blocks: int, least: Sequence[int], most: Sequence[int | None]) -> tuple[int, ...]:
        """Blocks per group from ``layer_blocks`` (blocks of one layer the budget holds): an
        equal share per layer, except that a group takes no more than ``most[g]`` (None: no
        bound), the memory it leaves going to the others, and no less than ``least[g]``, taken
        from the others (a long context's whole-context layers at a tight budget). The sum
        may exceed the budget when the least of every group does: the caller refuses that."""
        pinned: dict[int, int] = {}
        while len(pinned) < self.num_groups:
            open_groups = [g for g in range(self.num_groups) if g not in pinned]
            left = layer_blocks - sum(count * self.layers_in(g) for g, count in pinned.items())
            share = max(left, 0) // sum(self.layers_in(g) for g in open_groups)
            capped = {g: most[g] for g in open_groups if most[g] is not None and most[g] <= share}
            short = {} if capped else {g: least[g] for g in open_groups if share < least[g]}
            if not capped and not short:
                pinned.update((g, share) for g in open_groups)
            pinned.update(capped or short)
        return tuple(pinned[g] for g in range(self.num_groups))

    def layer_blocks(self, blocks: Sequence[int]) -> int:
        """Blocks of one layer that ``blocks`` per group take in all."""
        return sum(count * self.layers_in(g) for g, count in enumerate(blocks))
