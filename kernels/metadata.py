"""Per-step attention metadata shared by every layer of the model.

Tokens of a step are laid out flat: request ``r`` owns rows
``query_start_loc[r]:query_start_loc[r+1]``. Its context after this step is
``seq_lens[r]`` tokens, so its first new token sits at position
``seq_lens[r] - query_len[r]``; a prefill chunk attends causally to the cached
prefix plus itself, a decode (query_len 1) to the whole context.

A model whose layers read different spans of context (Gemma's local and global layers)
keeps a block table per span (core/kv/kv_groups.py): the metadata of the other spans
ride along in ``by_window``, which ``for_window`` picks from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # [num_reqs + 1] int32: prefix sums of query lengths.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: context length of each request including this step's tokens.
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32: physical block ids, padded with 0.
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies for the CPU path, which loops over requests in Python.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # False when no slot is negative (no padding token): the CPU path skips that check.
    may_pad: bool = True
    # The CPU kernels' per-step plans (one per sliding window), built by the first layer that needs one.
    cpu_plan: Any = field(default=None, repr=False)
    # The same step over the block tables of the layers with these sliding windows (a model with
    # layers of more than one kind); a window not listed reads this metadata's tables.
    by_window: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)

    def for_window(self, window: int) -> AttentionMetadata:
        """The metadata a layer with this sliding ``window`` (0: none) reads its cache by."""
        return self.by_window.get(window, self) if self.by_window else self

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
