"""Per-step attention metadata shared by every layer of the model.

Tokens of a step are laid out flat: request ``r`` owns rows
``query_start_loc[r]:query_start_loc[r+1]``. Its context after this step is
``seq_lens[r]`` tokens, so its first new token sits at position
``seq_lens[r] - query_len[r]``; a prefill chunk attends causally to the cached
prefix plus itself, a decode (query_len 1) to the whole context.

A model whose layers read different spans of context (Gemma's local and global layers)
keeps a block table per group of layers (core/kv/kv_groups.py): each layer's metadata,
the same step over its group's slots and tables, rides along in ``by_layer``.
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
    # Each layer's metadata where its KV cache group has slots and tables of its own (a model
    # with more than one group); None: every layer reads this one.
    by_layer: list[AttentionMetadata] | None = field(default=None, repr=False)

    def for_layer(self, index: int) -> AttentionMetadata:
        """The metadata layer ``index`` writes and reads its cache by."""
        return self if self.by_layer is None else self.by_layer[index]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
