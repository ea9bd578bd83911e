"""Persistent per-step input buffers of the model runner: host staging plus device copies.

Each step's inputs (token ids, positions, slot mapping, query_start_loc,
seq_lens, block tables, logits indices) are written by numpy into
preallocated host arrays, then copied into preallocated device tensors.

- On a GPU the host side is pinned memory and the copies are
  ``non_blocking``: the host enqueues them and moves on instead of waiting for
  each transfer. Because the next step refills the *same* host memory, the
  runner must call ``wait_for_copies`` before refilling; it waits on an event
  recorded after the previous step's copies, i.e. until the GPU has started
  that step, which still lets the host prepare step N+1 while step N runs.
- On the CPU host and device are one tensor: nothing is copied, and both
  calls are no-ops.

The device tensors never move, which is what lets a CUDA graph captured on
them (core/worker/cuda_graphs.py) be replayed with new inputs.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedTensor:
    """A host tensor (with a numpy view for filling) and its device twin."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_gpu)
        self.np: np.ndarray = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host

    def to_device(self, n: int) -> torch.Tensor:
        """The first ``n`` rows on the device, copied there first when host and device differ."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class InputBuffers:
    """Every staged input of a step, sized for the largest step the scheduler can send.

    ``max_num_tokens`` bounds the flat token arrays (and padded decode
    batches), ``max_num_reqs`` the per-request ones. Slots and block tables come
    once per KV cache group (core/kv/kv_groups.py); ``slot_mapping`` and
    ``block_tables`` are the first group's.
    """

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.input_ids = StagedTensor((max_num_tokens,), torch.int64, device)
        self.positions = StagedTensor((max_num_tokens,), torch.int64, device)
        self.group_slots = [StagedTensor((max_num_tokens,), torch.int64, device) for _ in range(num_kv_groups)]
        self.group_tables = [
            StagedTensor((max_num_reqs, max_blocks_per_req), torch.int32, device) for _ in range(num_kv_groups)
        ]
        self.slot_mapping, self.block_tables = self.group_slots[0], self.group_tables[0]
        self.query_start_loc = StagedTensor((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = StagedTensor((max_num_reqs,), torch.int32, device)
        # A row per request that samples, or per draft and more when it verifies drafts.
        self.logits_indices = StagedTensor((max_num_tokens,), torch.int64, device)
        # Deferred sampled tokens (core/worker/async_output.py): flat input
        # positions to fill on the device, and where each token sits in its
        # step's sampled-ids tensor.
        self.deferred_dst = StagedTensor((max_num_reqs,), torch.int64, device)
        self.deferred_src = StagedTensor((max_num_reqs,), torch.int64, device)
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None

    def wait_for_copies(self) -> None:
        """Block until the last step's host-to-device copies ran, so its host memory may be refilled."""
        if self._copies_done is not None:
            self._copies_done.synchronize()

    def copies_issued(self) -> None:
        """Mark the end of this step's copies on the current stream."""
        if self._copies_done is not None:
            self._copies_done.record()

    def fill_decode_padding(self, num_reqs: int, padded: int) -> None:
        """Make rows ``num_reqs:padded`` of a decode-only batch harmless fillers.

        Each filler is a one-token request at position 0 whose slot is -1
        (the cache-write kernels skip it) and whose context is one token in
        block 0, so attention reads valid memory and writes only its own,
        discarded, output row. Real decodes have ``query_start_loc[i] == i``
        too, so the fillers continue that sequence.
        """
        if padded == num_reqs:
            return
        self.input_ids.np[num_reqs:padded] = 0
        self.positions.np[num_reqs:padded] = 0
        self.seq_lens.np[num_reqs:padded] = 1
        self.query_start_loc.np[num_reqs + 1 : padded + 1] = np.arange(num_reqs + 1, padded + 1)
        for slots, tables in zip(self.group_slots, self.group_tables):
            slots.np[num_reqs:padded] = -1
            tables.np[num_reqs:padded, 0] = 0
