"""Turns a SchedulerOutput into one forward pass over a flat, mixed batch, and its tokens.

The runner orchestrates; its parts do the work: the step's layout and device
inputs (core/worker/staging.py), the forward pass (on a CPU the step program of
core/worker/cpu_program.py where it applies), the sampler, and, when they are
on, speculative decoding (core/spec_decode/: drafts proposed after each step
and verified in the next), a pooling model's step in place of sampling
(core/worker/pooler.py) and LoRA adapters (core/worker/lora_adapters.py).
Every part that keeps something per request hears of arrivals, finishes and
preemptions through one interface (core/worker/request_state.py).

One runner serves both devices; on a GPU it differs in what is needed to
keep the GPU busy (all of it switched by the device, in the few methods
under "the GPU's paths" below, never by a copy of the runner):

- inputs are staged in pinned host buffers and copied without blocking
  into persistent device buffers (core/worker/input_buffers.py);
- sampled ids stay on the device; their copy to the host runs on a side
  stream and is waited for only by whoever reads them
  (core/worker/async_output.py), and the next step takes them as inputs
  straight from device memory;
- decode-only steps replay CUDA graphs (core/worker/cuda_graphs.py) unless
  ``enforce_eager``;
- the KV cache gets the GPU memory left after weights and a profiled peak
  step (core/worker/gpu_memory.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial

import numpy as np
import torch

from core import envs
from core.config import EngineConfig
from core.kv.kv_groups import KVCacheGroups
from core.models.loader import load_model, resolve_dtype, resolve_kv_dtype
from core.protocol import LoRARequest, SamplingParams
from core.sched.output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    ModelRunnerOutput,
    SchedulerOutput,
)
from core.spec_decode.speculator import Speculator
from core.worker.async_output import AsyncModelRunnerOutput, DeferredTokens
from core.worker.cpu_program import CpuStepProgram
from core.worker.cuda_graphs import DecodeGraphs, decode_batch_sizes
from core.worker.input_batch import InputBatch
from core.worker.input_buffers import InputBuffers
from core.worker.kv_budget import kv_cache_blocks, mapped_zeros
from core.worker.lora_adapters import LoRAAdapters
from core.worker.pooler import Pooler, PoolingStep
from core.worker.prompt_logprobs import PromptLogprobs
from core.worker.request_state import DroppedOnAnyChange, RequestState
from core.worker.sampler import Sampler
from core.worker.sampling_batch import sampling_metadata
from core.worker.sleep import release_freed_memory
from core.worker.staging import DeviceInputs, Staged, Stager
from core.worker.step_sampler import StepSampler
from kernels.kv_format import row_width
from kernels.linear import all_small
from kernels.metadata import AttentionMetadata
from kernels.settings import configure as kernels_configure

logger = logging.getLogger("ringllm.runner")


def resolve_device(name: str) -> torch.device:
    """The device, with an explicit index on CUDA (streams, events and memory queries want one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        # The kernels' switches, from this process's environment (few_rows_for_one: see load_model).
        kernels_configure(**envs.kernel_settings(), few_rows_for_one=False)
        self.config = config
        self.model_config = config.model_config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            # Triton launches on the current device, whatever the tensors' device.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.kv_dtype = resolve_kv_dtype(config.cache_config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.max_model_len
        self.max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)
        self.kv_groups = KVCacheGroups.of(self.model_config)  # layers by the block tables they read
        max_num_seqs = config.scheduler_config.max_num_seqs
        self.input_batch = InputBatch(
            max_num_seqs, self.max_model_len, self.max_blocks_per_req, self.model_config.vocab_size,
            self.device, processed_logprobs=config.logprobs_mode == "processed_logprobs",
            num_kv_groups=self.kv_groups.num_groups,
        )
        self.prompt_logprobs = PromptLogprobs(self.input_batch, self.device)
        max_tokens = max(config.scheduler_config.max_num_batched_tokens, max_num_seqs)
        self.buffers = InputBuffers(
            max_tokens, max_num_seqs, self.max_blocks_per_req, self.device, self.kv_groups.num_groups
        )
        self.deferred = DeferredTokens()
        self.stager = Stager(
            self.input_batch, self.buffers, self.block_size, self.deferred, max_tokens, self.kv_groups.layer_group
        )
        self.sampler = Sampler()
        # Speculative decoding: n-gram lookup, or a draft model (started with the KV cache).
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config, self.device, self.dtype, self.stager, self.prompt_logprobs)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Drafts are proposed from the sampled ids on the host, at once.
        self.defer_sampled_tokens = self._gpu_defers_sampled_tokens() and self.speculator is None
        copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.step_sampler = StepSampler(
            self.sampler, self.input_batch, self.prompt_logprobs, self.deferred, self.defer_sampled_tokens, copy_stream
        )
        # Set up with the KV cache, which the graphs (and the CPU step program) read in place.
        self.decode_graphs: DecodeGraphs | None = None
        self.cpu_program: CpuStepProgram | None = None
        # A pooling model's step (set with the model): it pools hidden states, never samples.
        self.pooling: PoolingStep | None = None
        self.encoder = self.model_config.encoder  # bidirectional, whole prompts, no KV cache
        # --enable-lora: the loaded adapters, and each step's rows grouped by adapter.
        self.lora: LoRAAdapters | None = None
        if config.lora_config is not None:
            lora = config.lora_config
            self.lora = LoRAAdapters(self.model_config, lora.max_lora_rank, lora.max_cpu_loras, self.device, self.dtype)
        self.request_states = self._request_states()

    def _request_states(self) -> list[RequestState]:
        """The parts told of each request's arrival, finish and preemption (the persistent
        batch aside, which has its own words for them)."""
        states: list[RequestState] = [
            DroppedOnAnyChange(self.deferred.discard), DroppedOnAnyChange(self.prompt_logprobs.forget)
        ]
        if self.speculator is not None:
            states.append(self.speculator)
        if self.pooling is not None:
            states.append(self.pooling.pooler)
        return states

    # ------------------------------------------------ the GPU's paths (tests/support/gpu_paths.py)

    def _gpu_defers_sampled_tokens(self) -> bool:
        """Sampled ids stay on the device, fed to the next step from there (async_output.py)."""
        return self.device.type == "cuda"

    def _gpu_pads_decodes(self) -> bool:
        """Decode-only steps padded to a CUDA graph's batch size, over the static buffers."""
        return self._gpu_captures_graphs()

    def _gpu_captures_graphs(self) -> bool:
        """Decode steps replay CUDA graphs (none with LoRA: a captured graph would replay the
        adapters of the step it recorded; none with a mixture of experts: its torch path
        groups each step's tokens by expert on the host, which a graph cannot record)."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.lora is None
                and self.model_config.moe is None)

    def _runs_cpu_program(self) -> bool:
        """The steps it covers run through the CPU step program (a CPU's, never a GPU's path)."""
        return self.device.type == "cpu"

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        torch.manual_seed(self.config.seed)
        self.model = load_model(self.config, self.device, self.dtype)
        if self.config.pooler_config is not None:
            pooler = Pooler(self.config.pooler_config, self.model)
            self.pooling = PoolingStep(pooler, self.model_config, self.input_batch, self.device)
            self.request_states = self._request_states()
        if self.lora is not None:
            self.lora.attach(self.model)
        if self.device.type == "cpu":
            # One-row float32 products through kernels/cpu's dense kernel too, not numpy's gemv:
            # a lone decode is then one call of the C step program (and verification steps, a
            # few rows, share its thread pool with plain ones). A small model's products stay
            # with numpy on one thread, whose call is cheaper. (bench/README.md, issue 37.)
            kernels_configure(few_rows_for_one=not self.products_are_small())

    def _kv_shape(self) -> tuple[int, int, int]:
        return self.model_config.kv_block_shape(self.block_size, self._kv_row())

    def _kv_row(self) -> int:
        return row_width(self.kv_dtype, self.model_config.head_dim)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block: K and V in every cache tensor (one per layer of a KV cache group)."""
        every_layer = self.model_config.kv_bytes_per_block(self.block_size, self.kv_dtype.itemsize, self._kv_row())
        return every_layer // self.model_config.num_layers * self.kv_groups.num_slots

    def determine_num_blocks(self) -> int:
        """Blocks of the KV cache (core/worker/kv_budget.py)."""
        return kv_cache_blocks(
            self.config, self.kv_groups, self.kv_bytes_per_block(), self.device, self.encoder, self.profile_run
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can send, on dummy inputs: its activation peak.

        ``max_num_batched_tokens`` prompt tokens spread over ``max_num_seqs``
        requests, then logits and top-k/top-p sampling (which sorts the
        vocabulary) for each of them. Every slot is -1, so nothing is written,
        and attention reads a one-block scratch cache instead of the real one,
        which does not exist yet.
        """
        cfg = self.config
        total = min(cfg.scheduler_config.max_num_batched_tokens, cfg.scheduler_config.max_num_seqs * self.max_model_len)
        num_reqs = min(cfg.scheduler_config.max_num_seqs, total)
        counts = np.full(num_reqs, total // num_reqs, dtype=np.int64)
        counts[: total % num_reqs] += 1
        cu = np.cumsum(counts)
        b = self.buffers
        b.wait_for_copies()
        b.input_ids.np[:total] = 0
        b.positions.np[:total] = np.arange(total) - np.repeat(cu - counts, counts)
        for slots, tables in zip(b.group_slots, b.group_tables):
            slots.np[:total] = -1
            tables.np[:num_reqs] = 0
        b.query_start_loc.np[0] = 0
        b.query_start_loc.np[1 : num_reqs + 1] = cu
        b.seq_lens.np[:num_reqs] = counts
        # Speculative decoding: a logits row per draft too (the last tokens of the step stand in).
        num_logits = min(total, num_reqs * ((self.speculator.k if self.speculator else 0) + 1))
        b.logits_indices.np[:num_logits] = np.arange(total - num_logits, total)
        meta = self.stager.metadata(total, num_reqs, max_query_len=int(counts.max()))
        input_ids, positions = b.input_ids.to_device(total), b.positions.to_device(total)
        logits_indices = b.logits_indices.to_device(num_logits)
        b.copies_issued()
        scratch = torch.zeros((1, *self._kv_shape()), dtype=self.kv_dtype, device=self.device)
        caches = [] if self.encoder else [(scratch, scratch)] * self.model_config.num_layers
        hidden = self.model(input_ids, positions, caches, meta)
        if self.pooling is not None:
            return
        logits = self.model.compute_logits(hidden[logits_indices])
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        self.sampler(logits, sampling_metadata([params] * num_logits, logits.shape[-1], device=self.device))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The K and V cache tensors, ``num_blocks`` blocks each: one per layer, or where layers
        fall into several KV cache groups, one per place in a group, each layer using its own."""
        if self.encoder:
            return  # an encoder keeps nothing between steps
        zeros = mapped_zeros if self.device.type == "cpu" else partial(torch.zeros, device=self.device)
        shape = (num_blocks, *self._kv_shape())
        slots = [(zeros(shape, dtype=self.kv_dtype), zeros(shape, dtype=self.kv_dtype))
                 for _ in range(self.kv_groups.num_slots)]
        self.kv_caches = [slots[slot] for slot in self.kv_groups.layer_slot]
        self._build_cpu_program()
        if self.speculator is not None:
            self.speculator.start_proposer(num_blocks)
        if self.pooling is None and self._gpu_pads_decodes():
            scheduler = self.config.scheduler_config
            sizes = decode_batch_sizes(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
            self.decode_graphs = DecodeGraphs(sizes)
            if self._gpu_captures_graphs():
                self.capture_decode_graphs()

    def _build_cpu_program(self) -> None:
        """The CPU step program over the current weights and KV cache (a pooling model's steps
        never sample, so it has none)."""
        if self.kv_caches and self.pooling is None and self._runs_cpu_program():
            self.cpu_program = CpuStepProgram.build(
                self.model, self.kv_caches, self.buffers, self.max_model_len, self.kv_groups.layer_group
            )

    def replace_model(self, model: torch.nn.Module) -> None:
        """Serve ``model`` (same architecture) from the next step on; the CPU step
        program, which holds the old weights' addresses, is rebuilt over the new ones."""
        if self.decode_graphs is not None and self.device.type == "cuda":
            raise RuntimeError("a captured model's weights are replaced in place, not swapped")
        self.cpu_program = None
        self.model = model
        if self.lora is not None:
            self.lora.attach(model)
        release_freed_memory(self.device)
        self._build_cpu_program()

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture every padded decode size over all-filler inputs (which write nothing)."""
        graphs = self.decode_graphs
        assert graphs is not None
        start = time.perf_counter()
        b = self.buffers
        for size in reversed(graphs.sizes):
            b.wait_for_copies()
            b.query_start_loc.np[0] = 0
            b.fill_decode_padding(0, size)
            meta = self.stager.metadata(size, size, max_query_len=1)
            b.input_ids.to_device(size)
            b.positions.to_device(size)
            b.copies_issued()
            graphs.capture(size, lambda size=size, meta=meta: self._decode_forward(size, meta))
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1fs",
            graphs.sizes, time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ step

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        states = self.request_states
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            for state in states:
                state.forget(req_id)
        for req_id in so.preempted_req_ids:
            batch.park_request(req_id)
            for state in states:
                state.reset(req_id)
        for new in so.scheduled_new_reqs:
            for state in states:
                state.add_request(new)
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
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # After the known tokens, where the step's inputs are read from; not counted
            # in num_tokens: the ones accepted are appended as sampled.
            row = batch.req_id_to_index[req_id]
            start = batch.num_tokens[row]
            batch.token_ids[row, start : start + len(drafts)] = drafts

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        start = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        staged = self._stage_inputs(so)
        if self.pooling is not None:
            return self.pooling(self.model, self.kv_caches, staged, self._device_inputs(staged))
        logits = self._logits(staged)
        batch = self.input_batch
        batch.num_computed_tokens[staged.rows] = staged.seq_lens
        if logits is None:  # every chunk ends inside its prompt: nothing to sample
            return ModelRunnerOutput.for_requests(
                staged.req_ids,
                sampled_token_ids=[[] for _ in staged.req_ids],
            )
        sample_rows = staged.rows[staged.sample]
        if staged.num_drafts is not None:
            assert self.speculator is not None
            output = self.speculator.verify(so, staged, sample_rows, logits)
        else:
            output = self.step_sampler(so, staged, sample_rows, logits)
        if self.speculator is not None:
            assert isinstance(output, ModelRunnerOutput)  # drafts need the ids on the host
            self.speculator.after_step(staged, sample_rows, output, start)
        return output

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (each handed out once; None without speculation)."""
        return self.speculator.take_drafts() if self.speculator is not None else None

    def _stage_inputs(self, so: SchedulerOutput) -> Staged:
        """The step's layout, padded to the decode graphs' sizes and grouped by adapter as now set."""
        return self.stager.stage(so, self.decode_graphs, self.lora)

    def _device_inputs(self, staged: Staged) -> DeviceInputs:
        """The staged step's tensors on the device (the current model embeds prompts given as embeddings)."""
        return self.stager.device_inputs(staged, self.model)

    def _logits(self, staged: Staged) -> torch.Tensor | None:
        """The logits of the rows that sample (None when none does): on a CPU, a decode
        step or a lone prefill chunk runs the prepared kernel sequence; every other step
        the model's forward pass (with CUDA graphs for padded decode batches)."""
        program = self.cpu_program
        if program is not None and not program.applies_lora and self.lora is not None and self.lora.batch.groups:
            program = None  # its one C call per step has no place for the adapters' products
        if program is not None and staged.plain_decode:
            return program.run(len(staged.req_ids))
        if program is not None and staged.num_drafts is not None and staged.all_queries_sample:
            counts = staged.counts
            table_rows = np.repeat(self.stager.arange[: counts.size], counts)
            positions = self.buffers.positions.np[: staged.total]
            return program.run_queries(staged.total, table_rows, positions + 1)
        if program is not None and self._program_takes_chunk(staged):
            return program.run_chunk(staged.total, sample=staged.sample.size > 0)
        device_inputs = self._device_inputs(staged)
        if device_inputs.decode_size is not None:
            assert self.decode_graphs is not None
            size, meta = device_inputs.decode_size, device_inputs.meta
            hidden = self.decode_graphs.run(size, lambda: self._decode_forward(size, meta))
        else:
            hidden = self.model(
                device_inputs.input_ids, device_inputs.positions, self.kv_caches, device_inputs.meta,
                inputs_embeds=device_inputs.inputs_embeds,
            )
        if self.input_batch.sampling.num_rows_with["prompt_logprobs"]:
            self.prompt_logprobs.collect(staged, hidden, self.model.compute_logits)
        if device_inputs.logits_indices is None:
            return None
        return self.model.compute_logits(hidden[device_inputs.logits_indices])

    # ------------------------------------------------------------ LoRA adapters

    def add_lora(self, request: LoRARequest, in_use: set[int]) -> bool:
        """Add and load an adapter (ValueError or LoRAAdapterError when it cannot be served);
        False if it was loaded."""
        return self._lora_adapters().add(request, in_use)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_adapters().remove(lora_id)

    def pin_lora(self, lora_id: int, in_use: set[int]) -> bool:
        return self._lora_adapters().pin(lora_id, in_use)

    def lora_name(self, lora_id: int) -> str | None:
        return self._lora_adapters().name(lora_id)

    def list_loras(self) -> list[int]:
        return self._lora_adapters().list()

    def _lora_adapters(self) -> LoRAAdapters:
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start the server with --enable-lora")
        return self.lora

    def products_are_small(self) -> bool:
        """Whether every dense product of the model goes through numpy's BLAS with a
        small weight (kernels.linear.all_small): the engine then runs BLAS on one thread."""
        weights = [m.cpu_weight for m in self.model.modules() if getattr(m, "cpu_weight", None) is not None]
        return all_small(weights)

    def _program_takes_chunk(self, staged: Staged) -> bool:
        """A step that is one request's prefill chunk, of plain token ids, that the C
        kernels attend and whose prompt logprobs nobody asked for (they need every
        token's hidden state, which only the forward pass keeps)."""
        return (
            len(staged.req_ids) == 1 and staged.max_query_len > 1 and not staged.embeds_rows and not self.deferred
            and not self.input_batch.sampling.num_rows_with["prompt_logprobs"]
            and CpuStepProgram.takes_chunk(staged.total, int(staged.seq_lens[0]))
        )

    def _decode_forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """The model over the first ``size`` rows of the static buffers (what a decode graph records)."""
        b = self.buffers
        return self.model(b.input_ids.device[:size], b.positions.device[:size], self.kv_caches, meta)
