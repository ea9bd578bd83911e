"""Draft tokens from a smaller model that shares the target's tokenizer, in the same process.

The draft model keeps its own paged KV cache with its own blocks: the
scheduler's blocks cover only what the target computes, and the draft writes
ahead of it (its own guesses). After each target step, for every request that
sampled, the draft catches up on the tokens it has not seen (the whole prompt
the first time, then the tokens the last verification emitted) and proposes
k tokens, one forward pass each, batched over the requests. Greedy requests
take the draft's argmax; sampled ones draw from the draft's distribution at
their temperature (with their own generator when seeded) and keep it (q),
which the rejection sampler needs to accept with min(1, p/q) and resample
from max(p - q, 0).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from core.config import EngineConfig
from core.models.loader import load_model
from core.spec_decode.proposer import Proposal
from core.utils import cdiv
from core.worker.cpu_program import CpuStepProgram
from core.worker.input_batch import InputBatch
from core.worker.input_buffers import InputBuffers
from core.worker.sampler import exponential_noise
from core.worker.sampling_batch import SamplingBatch
from kernels.metadata import AttentionMetadata

# Catch-ups of at most this many tokens (and every decode round) run through the CPU step program.
PROGRAM_MIN_TOKENS = 64


class DraftModelProposer:
    """A Proposer that runs a draft model: per request it keeps its blocks of the draft's cache
    and how many of the request's tokens they hold."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, num_target_blocks: int) -> None:
        speculative = config.speculative_config
        assert speculative is not None and speculative.model is not None and config.draft_model_config is not None
        self.k = speculative.num_speculative_tokens
        self.device = device
        draft = msgspec.structs.replace(
            config, model=speculative.model, model_config=config.draft_model_config, load_format="auto",
            quantization=None, speculative_config=None, draft_model_config=None,
        )
        self.model = load_model(draft, device, dtype)
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.max_model_len
        # As many blocks as the target's, and room for every request's drafts beyond them.
        per_request = cdiv(self.k + 1, self.block_size) + 1
        num_blocks = num_target_blocks + config.scheduler_config.max_num_seqs * per_request
        shape = (num_blocks, *config.draft_model_config.kv_block_shape(self.block_size))
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.draft_model_config.num_layers)
        ]
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0: never handed out
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # tokens of each request whose KV the draft cache holds
        self.max_blocks = cdiv(self.max_model_len, self.block_size)
        # On a CPU the draft's small steps run as the target's do, through a step program over
        # buffers of its own; longer catch-ups (a new request's prompt) through its forward pass.
        self.program_tokens = max(PROGRAM_MIN_TOKENS, config.scheduler_config.max_num_seqs * (self.k + 1))
        self.buffers = InputBuffers(self.program_tokens, config.scheduler_config.max_num_seqs, self.max_blocks, device)
        self.program = (
            CpuStepProgram.build(self.model, self.kv_caches, self.buffers, self.max_model_len)
            if device.type == "cpu" else None
        )

    def forget(self, req_id: str) -> None:
        """A finished or preempted request: its blocks go back."""
        self.free_blocks.extend(self.blocks.pop(req_id, ()))
        self.computed.pop(req_id, None)

    def _ensure_blocks(self, req_id: str, num_tokens: int) -> list[int] | None:
        blocks = self.blocks.setdefault(req_id, [])
        need = cdiv(num_tokens, self.block_size) - len(blocks)
        if need > len(self.free_blocks):
            return None
        for _ in range(max(need, 0)):
            blocks.append(self.free_blocks.pop())
        return blocks

    @torch.inference_mode()
    def draft(self, req_ids: list[str], rows: list[int], batch: InputBatch, budgets: list[int]) -> dict[str, Proposal]:
        """Drafts (up to ``budgets[i]``) for requests ``req_ids`` at batch ``rows``, whose known
        tokens are ``batch.token_ids[row, :batch.num_tokens[row]]``."""
        token_ids, num_tokens, sampling = batch.token_ids, batch.num_tokens, batch.sampling
        # Drafts must end before max_model_len; requests the cache cannot hold take none this time.
        chosen: list[tuple[str, int, int, int]] = []  # (req_id, row, start, k)
        for req_id, row, budget in zip(req_ids, rows, budgets):
            length = int(num_tokens[row])
            k = min(budget, self.max_model_len - length)
            if k <= 0 or self._ensure_blocks(req_id, length + k - 1) is None:
                continue
            chosen.append((req_id, row, min(self.computed.get(req_id, 0), length - 1), k))
        if not chosen:
            return {}
        k_max = max(k for *_, k in chosen)
        greedy = sampling.greedy[[row for _, row, _, _ in chosen]]
        drafts = np.zeros((len(chosen), k_max), np.int64)
        probs: list[list[torch.Tensor]] = [[] for _ in chosen]
        # Round 0 catches up (a chunk per request), then one token per request and round.
        inputs = [token_ids[row, start : int(num_tokens[row])] for _, row, start, _ in chosen]
        starts = [start for _, _, start, _ in chosen]
        for j in range(k_max):
            active = [i for i, (*_, k) in enumerate(chosen) if k > j]
            logits = self._forward(
                [chosen[i][0] for i in active], [inputs[i] for i in active], [starts[i] for i in active]
            )
            for i in active:
                starts[i] += len(inputs[i])
            picked = self._pick(logits, [chosen[i][1] for i in active], greedy[active], sampling)
            for n, i in enumerate(active):
                token, q = picked[n]
                drafts[i, j] = token
                if q is not None:
                    probs[i].append(q)
                inputs[i] = np.array([token], np.int64)
        proposals = {}
        for i, (req_id, row, _, k) in enumerate(chosen):
            self.computed[req_id] = int(num_tokens[row])  # its own guesses are redone once known
            proposals[req_id] = Proposal(drafts[i, :k].tolist(), torch.stack(probs[i]) if probs[i] else None)
        return proposals

    def _forward(self, req_ids: list[str], inputs: list[np.ndarray], starts: list[int]) -> torch.Tensor:
        """The draft model over each request's ``inputs`` (at positions from ``starts``): the
        logits of each request's last input."""
        counts = np.array([len(x) for x in inputs], np.int64)
        cu = np.concatenate(([0], np.cumsum(counts)))
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        tables = np.zeros((len(req_ids), self.max_blocks), np.int32)
        for i, req_id in enumerate(req_ids):
            blocks = self.blocks[req_id]
            tables[i, : len(blocks)] = blocks
        owner = np.repeat(np.arange(len(req_ids)), counts)
        bs = self.block_size
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = np.array(starts, np.int64) + counts
        total = int(cu[-1])
        program = self.program
        if program is not None and total <= self.program_tokens:
            b = self.buffers
            b.input_ids.np[:total] = np.concatenate(inputs)
            b.positions.np[:total] = positions
            b.slot_mapping.np[:total] = slots
            b.block_tables.np[: len(req_ids)] = tables
            b.seq_lens.np[: len(req_ids)] = seq_lens
            if total == len(req_ids):  # one token each: a decode step
                return program.run(total)
            return program.run_queries(total, owner, positions + 1)[torch.from_numpy(cu[1:] - 1)]
        dev = self.device

        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(dev, dtype)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(cu, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            may_pad=False,
        )
        hidden = self.model(
            tensor(np.concatenate(inputs), torch.int64), tensor(positions, torch.int64), self.kv_caches, meta
        )
        return self.model.compute_logits(hidden[tensor(cu[1:] - 1, torch.int64)]).float()

    @staticmethod
    def _pick(
        logits: torch.Tensor, rows: list[int], greedy: np.ndarray, sampling: SamplingBatch
    ) -> list[tuple[int, torch.Tensor | None]]:
        """Each request's draft: the argmax (greedy), or a draw from the draft's distribution at
        the request's temperature (kept as q)."""
        argmax = logits.argmax(-1).tolist()
        if greedy.all():
            return [(t, None) for t in argmax]
        temperature = torch.from_numpy(sampling.temperature[rows]).to(logits.device)
        probs = (logits / temperature[:, None]).softmax(-1)
        generators = [sampling.generators[row] for row in rows]
        drawn = (probs / exponential_noise(probs, generators)).argmax(-1).tolist()
        return [(argmax[n], None) if greedy[n] else (drawn[n], probs[n]) for n in range(len(rows))]

