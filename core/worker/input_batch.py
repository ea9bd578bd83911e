"""The persistent batch: per-request state that lives across steps.

Rebuilding every request's token list and block table each step would cost
time proportional to all context tokens; instead rows are kept in
preallocated numpy arrays and only the scheduler's deltas are applied (new
rows, appended blocks, sampled tokens, removed rows). Removal swaps the last
row into the hole so rows stay dense.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from core.sched.output import NewRequestData
from core.worker.sampling_batch import SamplingBatch


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        device: torch.device | None = None,
        processed_logprobs: bool = False,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Per KV cache group: each row's block table, and how many blocks it holds.
        self.block_tables = [np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32) for _ in range(num_kv_groups)]
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # each row's LoRA adapter (0: none)
        # Sampling parameters and history per row; generators are seeded once
        # per request and survive preemption (see ``park_request``).
        self.sampling = SamplingBatch(max_num_reqs, vocab_size, device or torch.device("cpu"), processed_logprobs)
        # Prompts given as embeddings (None for token prompts), on the model's device.
        self.prompt_embeds: list[torch.Tensor | None] = []
        # Seeded generators of preempted requests, until they resume or finish.
        self.parked_generators: dict[str, torch.Generator] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, new: NewRequestData) -> None:
        if new.req_id in self.req_id_to_index:
            self._drop_row(new.req_id)
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError("persistent batch is full; scheduler exceeded max_num_seqs")
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = new.num_computed_tokens
        for group, block_ids in enumerate(new.block_ids):
            self.block_tables[group][row, : len(block_ids)] = block_ids
            self.num_blocks[group, row] = len(block_ids)
        self.lora_ids[row] = new.lora_int_id
        params = new.sampling_params
        gen = self.parked_generators.pop(new.req_id, None)
        if gen is None and params.seed is not None and not params.greedy:
            gen = torch.Generator().manual_seed(params.seed)
        self.req_ids.append(new.req_id)
        self.req_id_to_index[new.req_id] = row
        num_prompt = n if new.num_prompt_tokens is None else new.num_prompt_tokens
        self.sampling.add(
            row, params, new.token_ids, num_prompt, new.eos_token_id, gen, new.prompt_embeds is not None
        )
        self.prompt_embeds.append(new.prompt_embeds)

    def park_request(self, req_id: str) -> None:
        """Preempted: drop the row but keep its generator, so that the resumed
        request continues its random stream where it stopped instead of
        replaying it from the seed (a seeded request gives the same tokens
        whether or not it was preempted)."""
        row = self.req_id_to_index.get(req_id)
        generator = None if row is None else self.sampling.generators[row]
        self._drop_row(req_id)
        if generator is not None:
            self.parked_generators[req_id] = generator

    def remove_request(self, req_id: str) -> None:
        """Finished or aborted: forget the request, parked generator included."""
        self.parked_generators.pop(req_id, None)
        self._drop_row(req_id)

    def _drop_row(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        self.sampling.remove(row)
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.req_id_to_index[moved] = row
            self.sampling.move(last, row)
            self.prompt_embeds[row] = self.prompt_embeds[last]
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            for group, table in enumerate(self.block_tables):
                nb = self.num_blocks[group, last]
                table[row, :nb] = table[last, :nb]
                self.num_blocks[group, row] = nb
            self.lora_ids[row] = self.lora_ids[last]
        self.req_ids.pop()
        self.prompt_embeds.pop()

    def append_blocks(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """Blocks appended to the request's table in each KV cache group (none: nothing new)."""
        if not block_ids:
            return
        row = self.req_id_to_index[req_id]
        for group, ids in enumerate(block_ids):
            start = self.num_blocks[group, row]
            self.block_tables[group][row, start : start + len(ids)] = ids
            self.num_blocks[group, row] = start + len(ids)

    def append_token(self, row: int, token_id: int) -> bool:
        """Append a sampled token; False (and nothing kept) once the row is at max_model_len."""
        n = self.num_tokens[row]
        if n >= self.max_model_len:
            return False
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        return True
