"""Turns a SchedulerOutput into one forward pass over a flat, mixed batch.

Prefill chunks and decodes are laid out back to back (no padding); every
index computation is vectorised with numpy over the persistent batch so the
per-step host cost grows with the tokens scheduled, not with context length.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from core.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from core.models.loader import load_model
from core.sched.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from core.worker.input_batch import InputBatch
from core.worker.sampler import Sampler, SamplingMetadata
from kernels.metadata import AttentionMetadata

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """float32 on CPU (half precision matmuls are slow and inexact there);
    on a GPU the checkpoint's own dtype, as vLLM does."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return _DTYPES.get(ckpt, torch.bfloat16) if ckpt != "float32" else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.hf_config = config.hf_config()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.block_size = config.block_size
        assert config.max_model_len is not None, "EngineConfig.resolve() first"
        self.max_model_len = config.max_model_len
        self.max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)
        self.input_batch = InputBatch(config.max_num_seqs, self.max_model_len, self.max_blocks_per_req)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        torch.manual_seed(self.config.seed)
        self.model = load_model(self.config, self.device, self.dtype)

    def kv_bytes_per_block(self) -> int:
        hf = self.hf_config
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * hf["num_hidden_layers"] * self.block_size * kv_heads * head_dim * elem

    def determine_num_blocks(self) -> int:
        """Blocks for the KV cache: the override, else the memory budget.

        On CPU the budget is ``kv_cache_memory`` bytes, capped at what
        ``max_num_seqs`` full-length requests could ever use; on a GPU it is
        the share of free memory ``gpu_memory_utilization`` allows.
        """
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
            # Leave room for activations of the largest batch.
            budget -= 2 * self.config.max_num_batched_tokens * self.hf_config["vocab_size"] * 4
        else:
            budget = self.config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_blocks = budget // per_block
        cap = self.config.max_num_seqs * self.max_blocks_per_req + 1
        if self.config.kv_cache_memory is None and self.device.type == "cpu":
            num_blocks = min(num_blocks, cap)
        if num_blocks < self.max_blocks_per_req + 1:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {self.block_size} tokens cannot hold "
                f"one request of max_model_len={self.max_model_len}; raise the memory budget or "
                "lower --max-model-len"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        hf = self.hf_config
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        shape = (num_blocks, self.block_size, kv_heads, head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(hf["num_hidden_layers"])
        ]

    # ------------------------------------------------------------------ step

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            if new.prompt_embeds is not None:
                embeds = new.prompt_embeds.to(self.device, self.dtype)
                new = dataclasses.replace(new, prompt_embeds=embeds)
            batch.add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            batch.append_blocks(req_id, blocks)
            batch.num_computed_tokens[batch.req_id_to_index[req_id]] = computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), np.int64, len(req_ids))
        counts = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(req_ids))

        cu = np.cumsum(counts)
        total = int(cu[-1])
        tok_req = np.repeat(np.arange(len(rows)), counts)
        offsets = np.arange(total) - np.repeat(cu - counts, counts)
        computed = batch.num_computed_tokens[rows]
        positions = computed[tok_req] + offsets
        tok_rows = rows[tok_req]
        input_ids = batch.token_ids[tok_rows, positions]
        bs = self.block_size
        slots = batch.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = computed + counts
        max_seq_len = int(seq_lens.max())
        block_tables = batch.block_table[rows, : math.ceil(max_seq_len / bs)]
        query_start_loc = np.concatenate(([0], cu))

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(dev, non_blocking=True),
            max_query_len=int(counts.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        input_ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        hidden = self.model(
            input_ids_t,
            torch.from_numpy(positions).to(dev, non_blocking=True),
            self.kv_caches,
            meta,
            inputs_embeds=self._inputs_embeds(input_ids_t, rows, computed, counts, cu),
        )
        batch.num_computed_tokens[rows] = seq_lens

        # Sample only where the chunk reached the end of the known tokens.
        sample_mask = seq_lens >= batch.num_tokens[rows]
        sampled: list[list[int]] = [[] for _ in req_ids]
        if sample_mask.any():
            pick = np.nonzero(sample_mask)[0]
            logits = self.model.compute_logits(hidden[torch.from_numpy(cu[pick] - 1).to(dev)])
            sample_rows = rows[pick]
            metadata = SamplingMetadata.from_rows([batch.sampling[r] for r in sample_rows])
            token_ids = self.sampler(logits, metadata).tolist()
            for i, row, tok in zip(pick, sample_rows, token_ids):
                batch.append_token(int(row), tok)
                sampled[i] = [tok]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _inputs_embeds(
        self,
        input_ids: torch.Tensor,
        rows: np.ndarray,
        computed: np.ndarray,
        counts: np.ndarray,
        cu: np.ndarray,
    ) -> torch.Tensor | None:
        """Token embeddings with the prompt rows of embedding prompts swapped in;
        None when no scheduled token comes from a prompt given as embeddings."""
        batch = self.input_batch
        inputs_embeds = None
        for i, row in enumerate(rows.tolist()):
            embeds = batch.prompt_embeds[row]
            if embeds is None or computed[i] >= embeds.shape[0]:
                continue
            if inputs_embeds is None:
                inputs_embeds = self.model.get_input_embeddings()(input_ids)
            # The chunk covers positions computed[i]..; its first `take` are prompt rows.
            start = int(cu[i] - counts[i])
            take = int(min(counts[i], embeds.shape[0] - computed[i]))
            inputs_embeds[start : start + take] = embeds[int(computed[i]) : int(computed[i]) + take]
        return inputs_embeds
