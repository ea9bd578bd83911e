"""Turns a SchedulerOutput into one forward pass over a flat, mixed batch.

Prefill chunks and decodes are laid out back to back (no padding); every
index computation is vectorised with numpy over the persistent batch so the
per-step host cost grows with the tokens scheduled, not with context length.

One runner serves both devices; on a GPU it differs in what is needed to
keep the GPU busy (all of it switched by the device, never by a copy of the
runner):

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

With speculative decoding the runner also proposes the next step's drafts
(core/worker/ngram_proposer.py) from the tokens it just appended, and a
request whose scheduled tokens run past its known ones is verifying drafts:
it gets a logits row for its last known token and one per draft, and the
rejection sampler (core/worker/rejection_sampler.py) decides what it emits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from core import envs
from core.config import CPU_KV_CACHE_MEMORY, CPU_KV_CACHE_MIN_MEMORY, EngineConfig
from core.models.loader import load_model, resolve_dtype, resolve_kv_dtype
from core.protocol import LogprobsArrays, LoRARequest, SamplingParams
from core.sched.output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    ModelRunnerOutput,
    SchedulerOutput,
)
from core.worker.async_output import (
    PLACEHOLDER_TOKEN_ID,
    AsyncModelRunnerOutput,
    DeferredTokens,
    SampledTokens,
)
from core.worker.cpu_program import CpuStepProgram
from core.worker.cuda_graphs import DecodeGraphs, decode_batch_sizes
from core.worker.draft_proposer import DraftModelProposer
from core.worker.gpu_memory import gpu_kv_cache_budget
from core.worker.input_batch import InputBatch
from core.worker.input_buffers import InputBuffers
from core.worker.logprobs import gather_logprobs
from core.worker.lora_adapters import LoRAAdapters
from core.worker.ngram_proposer import NgramProposer
from core.worker.pooler import Pooler
from core.worker.prompt_logprobs import PromptLogprobs
from core.worker.rejection_sampler import VerifiedTokens, rejection_sample
from core.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    target_distribution,
)
from core.worker.sampling_batch import sampling_metadata
from core.worker.sleep import release_freed_memory
from core.worker.spec_gate import SpeculationGate
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


@dataclass
class _Staged:
    """One step's host-side layout, its inputs written to the runner's host buffers."""

    req_ids: list[str]
    rows: np.ndarray  # persistent-batch row of each scheduled request
    counts: np.ndarray  # tokens scheduled per request
    cu: np.ndarray  # their prefix sums
    starts: np.ndarray  # first flat token of each request
    computed: np.ndarray  # tokens in the KV cache before this step
    seq_lens: np.ndarray  # context length of each request after this step
    sample: np.ndarray  # indices into req_ids of the requests that sample a token
    # Drafts each of them verifies (None: no request verifies drafts this step). A request
    # with k drafts has k + 1 logits rows.
    num_drafts: np.ndarray | None
    total: int  # tokens scheduled
    max_query_len: int
    embeds_rows: list[tuple[int, int]]  # requests whose chunk covers prompt embeddings
    decode_size: int | None  # padded batch size of a decode-only step (CUDA graphs), None otherwise

    @property
    def plain_decode(self) -> bool:
        """One token per request, every one sampled, no embeddings, no padding."""
        return (
            self.max_query_len == 1 and self.sample.size == len(self.req_ids) and not self.embeds_rows
            and self.decode_size is None
        )

    @property
    def num_logits(self) -> int:
        return self.sample.size if self.num_drafts is None else int(self.num_drafts.sum()) + self.sample.size

    @property
    def all_queries_sample(self) -> bool:
        """Every token of the step is a logits row (a verification step): no prefill chunk."""
        return self.num_logits == self.total and not self.embeds_rows and self.decode_size is None


@dataclass
class _StepInputs:
    """One step's inputs on the device (the forward pass's; its layout is the _Staged's)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    inputs_embeds: torch.Tensor | None
    logits_indices: torch.Tensor | None  # hidden-state row of each request that samples
    decode_size: int | None  # padded batch size of a decode-only step, None otherwise


def _mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous mapping of its own: the kernel's zero pages,
    made resident only as the KV cache fills (no memset of gigabytes at start-up, no memory
    held that no request uses), and unmapped whole when the tensor goes (sleep mode)."""
    count = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, max(count * dtype.itemsize, 1)), dtype=dtype, count=count).view(shape)


def default_cpu_kv_budget() -> int:
    """The CPU KV cache's default size: CPU_KV_CACHE_MEMORY (vLLM's CPU default), at most a
    quarter of the memory the system has available now (the weights are loaded by then, and
    the rest is left to other processes and the page cache), at least CPU_KV_CACHE_MIN_MEMORY."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: the minimum
        return CPU_KV_CACHE_MIN_MEMORY
    return max(CPU_KV_CACHE_MIN_MEMORY, min(CPU_KV_CACHE_MEMORY, available // 4))


class ModelRunner:
    # Tests switch this on to run the GPU path's padded decode batches (without
    # capture) and deferred sampled tokens on the CPU; on a GPU they are always on.
    emulate_gpu_paths = False

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
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)
        self.input_batch = InputBatch(
            config.max_num_seqs, self.max_model_len, self.max_blocks_per_req, self.model_config.vocab_size,
            self.device, processed_logprobs=config.logprobs_mode == "processed_logprobs",
        )
        self.prompt_logprobs = PromptLogprobs(self.input_batch, self.device)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self._arange = np.arange(max_tokens + 1, dtype=np.int64)  # sliced, never written
        self._ones = np.ones(max_tokens, dtype=np.int64)
        self.buffers = InputBuffers(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs,
            self.max_blocks_per_req,
            self.device,
        )
        self.sampler = Sampler()
        speculative = config.speculative_config
        # Speculative decoding: n-gram lookup, or a draft model (built with the KV cache, whose
        # size it follows).
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if speculative is not None and speculative.method == "ngram":
            self.proposer = NgramProposer(speculative)
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        self._draft_probs: dict[str, torch.Tensor] = {}  # a draft model's q of each request's drafts
        self.spec_pause_batch_size = (speculative.disable_by_batch_size if speculative else None) or 2**31
        self._drafts: DraftTokenIds | None = None  # proposed after the last step, until taken
        # Drafts a request may be given next: one after a verification that accepted none
        # (its drafts are not to be trusted), num_speculative_tokens after one that accepted any.
        self._draft_budget: dict[str, int] = {}
        self.spec_gate = SpeculationGate(enabled=envs.RINGLLM_SPEC_DECODE_GATE)
        self._proposal_seconds = 0.0  # what proposing the drafts of the next step cost
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        on_gpu = self.device.type == "cuda"
        # Drafts are proposed from the sampled ids on the host, at once.
        self.defer_sampled_tokens = (on_gpu or self.emulate_gpu_paths) and speculative is None
        self.deferred = DeferredTokens()
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        # Set up with the KV cache, which the graphs (and the CPU step program) read in place.
        self.decode_graphs: DecodeGraphs | None = None
        self.cpu_program: CpuStepProgram | None = None
        # A pooling model's pooler (set with the model): its steps pool hidden states, never sample.
        self.pooler: Pooler | None = None
        self.encoder = self.model_config.encoder  # bidirectional, whole prompts, no KV cache
        # --enable-lora: the loaded adapters, and each step's rows grouped by adapter.
        self.lora: LoRAAdapters | None = None
        if config.enable_lora:
            self.lora = LoRAAdapters(
                self.model_config, config.max_lora_rank, config.max_cpu_loras, self.device, self.dtype
            )

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        torch.manual_seed(self.config.seed)
        self.model = load_model(self.config, self.device, self.dtype)
        if self.config.pooler_config is not None:
            self.pooler = Pooler(self.config.pooler_config, self.model)
        if self.lora is not None:
            self.lora.attach(self.model)
        if self.config.speculative_config is not None and self.device.type == "cpu":
            # Verification steps (a few rows) and plain ones (one row) through one kernel and its
            # thread pool: switching pools at every step costs more than a step of a large model.
            # A small model's products run on one thread either way, and numpy's call is cheaper.
            kernels_configure(few_rows_for_one=not self.products_are_small())

    def _kv_shape(self) -> tuple[int, int, int]:
        return self.model_config.kv_block_shape(self.block_size)

    def kv_bytes_per_block(self) -> int:
        return self.model_config.kv_bytes_per_block(self.block_size, self.kv_dtype.itemsize)

    def determine_num_blocks(self) -> int:
        """Blocks for the KV cache: the override, else the memory budget.

        The budget is ``kv_cache_memory`` bytes when given. Otherwise, on CPU
        it is ``default_cpu_kv_budget()`` (or one full-length request, if more)
        capped at what ``max_num_seqs`` full-length requests could ever use; on a GPU it is what
        ``gpu_memory_utilization`` leaves after the weights and the profiled
        peak of the largest step (core/worker/gpu_memory.py). Data-parallel
        engines on one host take one share each (the budget, or the GPU's
        fraction, divided by their number).
        """
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.encoder:  # blocks count the step's tokens only: no memory behind them
            return self.config.max_num_seqs * self.max_blocks_per_req + 1
        per_block = self.kv_bytes_per_block()
        share = self.config.engines_on_this_host  # data-parallel engines split the budget
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory // share
        elif self.device.type == "cuda":
            utilization = self.config.gpu_memory_utilization / share
            budget = gpu_kv_cache_budget(self.device, utilization, self.profile_run)
        else:
            # Never less than one request of max_model_len: a model whose context is long (a
            # GGUF file's, 32k and more) serves out of the box, one full-length request at a time.
            budget = max(default_cpu_kv_budget() // share, (self.max_blocks_per_req + 1) * per_block)
        num_blocks = max(budget, 0) // per_block
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
        total = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * self.max_model_len)
        num_reqs = min(cfg.max_num_seqs, total)
        counts = np.full(num_reqs, total // num_reqs, dtype=np.int64)
        counts[: total % num_reqs] += 1
        cu = np.cumsum(counts)
        b = self.buffers
        b.wait_for_copies()
        b.input_ids.np[:total] = 0
        b.positions.np[:total] = np.arange(total) - np.repeat(cu - counts, counts)
        b.slot_mapping.np[:total] = -1
        b.query_start_loc.np[0] = 0
        b.query_start_loc.np[1 : num_reqs + 1] = cu
        b.seq_lens.np[:num_reqs] = counts
        b.block_tables.np[:num_reqs] = 0
        # Speculative decoding: a logits row per draft too (the last tokens of the step stand in).
        num_logits = min(total, num_reqs * (self.num_speculative_tokens + 1))
        b.logits_indices.np[:num_logits] = np.arange(total - num_logits, total)
        meta = self._metadata(total, num_reqs, max_query_len=int(counts.max()))
        input_ids, positions = b.input_ids.to_device(total), b.positions.to_device(total)
        logits_indices = b.logits_indices.to_device(num_logits)
        b.copies_issued()
        scratch = torch.zeros((1, *self._kv_shape()), dtype=self.kv_dtype, device=self.device)
        caches = [] if self.encoder else [(scratch, scratch)] * self.model_config.num_layers
        hidden = self.model(input_ids, positions, caches, meta)
        if self.pooler is not None:
            return
        logits = self.model.compute_logits(hidden[logits_indices])
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        self.sampler(logits, sampling_metadata([params] * num_logits, logits.shape[-1]))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.encoder:
            return  # an encoder keeps nothing between steps
        shape = (num_blocks, *self._kv_shape())
        zeros = _mapped_zeros if self.device.type == "cpu" else partial(torch.zeros, device=self.device)
        self.kv_caches = [
            (zeros(shape, dtype=self.kv_dtype), zeros(shape, dtype=self.kv_dtype))
            for _ in range(self.model_config.num_layers)
        ]
        if self.device.type == "cpu" and not self.emulate_gpu_paths and self.pooler is None:
            self.cpu_program = CpuStepProgram.build(self.model, self.kv_caches, self.buffers, self.max_model_len)
        speculative = self.config.speculative_config
        if speculative is not None and speculative.method == "draft_model" and self.proposer is None:
            self.proposer = DraftModelProposer(self.config, self.device, self.dtype, num_blocks)
        # A captured graph would replay the adapters of the step it recorded: none with LoRA.
        capture = self.device.type == "cuda" and not self.config.enforce_eager and self.pooler is None \
            and self.lora is None
        if capture or (self.emulate_gpu_paths and self.pooler is None):
            sizes = decode_batch_sizes(self.config.max_num_seqs, self.config.max_num_batched_tokens)
            self.decode_graphs = DecodeGraphs(sizes)
        if capture:
            self.capture_decode_graphs()

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
        if self.kv_caches and self.device.type == "cpu" and not self.emulate_gpu_paths:
            self.cpu_program = CpuStepProgram.build(self.model, self.kv_caches, self.buffers, self.max_model_len)

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
            meta = self._metadata(size, size, max_query_len=1)
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
        deferred = self.deferred
        prompt_logprobs = self.prompt_logprobs
        pooler = self.pooler
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            deferred.discard(req_id)
            prompt_logprobs.forget(req_id)
            self._forget_drafts(req_id)
            if pooler is not None:
                pooler.forget(req_id)
        for req_id in so.preempted_req_ids:
            batch.park_request(req_id)
            deferred.discard(req_id)
            prompt_logprobs.forget(req_id)
            self._forget_drafts(req_id)
            if pooler is not None:
                pooler.reset(req_id)
        for new in so.scheduled_new_reqs:
            if pooler is not None:
                pooler.add(new.req_id, new.pooling_params)
            if new.prompt_embeds is not None:
                embeds = new.prompt_embeds.to(self.device, self.dtype)
                new = dataclasses.replace(new, prompt_embeds=embeds)
            batch.add_request(new)
            deferred.discard(new.req_id)
            prompt_logprobs.forget(new.req_id)
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
        if self.pooler is not None:
            return self._pool(staged)
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
            output = self._verify_drafts(so, staged, sample_rows, logits)
        else:
            if so.grammar_bitmask is not None:
                self._apply_grammar(so, staged.req_ids, staged.sample, logits)
            metadata = batch.sampling.metadata(sample_rows, batch.num_tokens, batch.token_ids)
            output = self._sampled_output(staged, sample_rows, self.sampler(logits, metadata))
        if self.num_speculative_tokens:
            now = time.perf_counter()
            if staged.sample.size == len(staged.req_ids) and staged.total == staged.num_logits:  # decodes only
                # A verification's cost includes proposing its drafts (the step before).
                verified = staged.num_drafts is not None
                seconds = now - start + (self._proposal_seconds if verified else 0.0)
                self.spec_gate.observe(verified, sum(map(len, output.sampled_token_ids)), seconds)
            proposed = self._propose_drafts(staged.req_ids, staged.sample, sample_rows)
            self._proposal_seconds = time.perf_counter() - now if proposed else 0.0
        return output

    def _pool(self, staged: _Staged) -> ModelRunnerOutput:
        """A pooling model's step: the forward pass, then the pooled output of every request
        whose prompt ends in this step (the others gathered what their chunk gives)."""
        assert self.pooler is not None
        step = self._device_inputs(staged)
        extra = {}
        if self.encoder and self.model_config.type_vocab_size > 1:  # RoBERTa's one type needs no ids
            types = self.pooler.token_type_ids(staged.req_ids, staged.computed, staged.counts, self.device)
            if types is not None:
                extra["token_type_ids"] = types
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, **extra)
        batch = self.input_batch
        batch.num_computed_tokens[staged.rows] = staged.seq_lens
        num_prompt_tokens = batch.num_tokens[staged.rows]  # nothing is sampled: all of them are prompt
        pooled = self.pooler(
            hidden, staged.req_ids, staged.starts, staged.counts, staged.computed, num_prompt_tokens,
            finishing=staged.seq_lens >= num_prompt_tokens,
        )
        return ModelRunnerOutput.for_requests(
            staged.req_ids, sampled_token_ids=[[] for _ in staged.req_ids], pooler_output=pooled
        )

    def _verify_drafts(
        self, so: SchedulerOutput, step: _Staged, sample_rows: np.ndarray, logits: torch.Tensor
    ) -> ModelRunnerOutput:
        """Sample a step in which some requests verify drafts: each request's logits rows
        (one, or one per draft and one more) under its constraints, then the rejection
        sampler; the tokens it emits are appended and reported, a list per request."""
        assert step.num_drafts is not None
        batch = self.input_batch
        sampling = batch.sampling
        num_rows = step.num_drafts + 1
        starts, drafts_before = self._segments(num_rows)
        logits_rows = np.repeat(sample_rows, num_rows)  # each logits row's batch row
        if so.grammar_bitmask is not None:  # a row per logits row of the requests under a grammar
            self._apply_grammar(so, step.req_ids, step.sample, logits, starts)
        md = sampling.metadata(logits_rows, batch.num_tokens, batch.token_ids, drafts_before)
        target = target_distribution(logits, md)
        # The draft each row checks: the token after the ones it follows (-1 on the last row).
        draft_ids = batch.token_ids[logits_rows, batch.num_tokens[logits_rows] + drafts_before]
        draft_ids[starts + step.num_drafts] = -1
        verified = rejection_sample(
            target, md, starts, step.num_drafts, draft_ids, self._draft_probs_rows(step, starts, logits)
        )

        sampled: list[list[int]] = [[] for _ in step.req_ids]
        longest = 0
        budget = self._draft_budget
        limit = self.num_speculative_tokens
        for i, row, tokens, drafts in zip(
            step.sample.tolist(), sample_rows.tolist(), verified.token_ids, step.num_drafts.tolist()
        ):
            for tok in tokens:
                batch.append_token(row, tok)
            sampled[i] = tokens
            longest = max(longest, len(tokens))
            if drafts:
                budget[step.req_ids[i]] = limit if len(tokens) > 1 else 1
        lengths = np.fromiter(map(len, verified.token_ids), np.int64, len(verified.token_ids))
        if sampling.num_rows_with["penalties"]:
            for k in range(longest):  # penalties fold the emitted tokens in order
                emitted = np.flatnonzero(lengths > k)
                sampling.record_sampled(
                    sample_rows[emitted],
                    torch.tensor([verified.token_ids[e][k] for e in emitted.tolist()], device=logits.device),
                )
        arrays, rows = None, None
        if md.logprob_rows is not None:
            arrays, rows = self._verified_logprobs(step, sample_rows, verified, lengths, target.described(logits, md), md)
        return ModelRunnerOutput.for_requests(
            step.req_ids,
            sampled_token_ids=sampled,
            logprobs=arrays,
            logprobs_rows=rows,
            prompt_logprobs=self.prompt_logprobs.finished(step.req_ids, step.sample, sample_rows),
        )

    def _verified_logprobs(
        self, step: _Staged, sample_rows: np.ndarray, verified: VerifiedTokens, lengths: np.ndarray,
        described: torch.Tensor, md: SamplingMetadata,
    ) -> tuple[LogprobsArrays, list[int]]:
        """The logprobs of every emitted token of the requests that asked, each from the
        logits row it was sampled from, in request order; and each request's first row."""
        asked = np.flatnonzero(self.input_batch.sampling.num_logprobs[sample_rows] >= 0)
        out_start = np.cumsum(lengths) - lengths
        picked = np.concatenate([verified.rows[out_start[a] : out_start[a] + lengths[a]] for a in asked])
        ids = torch.tensor([t for a in asked.tolist() for t in verified.token_ids[a]], device=described.device)
        rows_t = torch.from_numpy(picked).to(described.device)
        arrays = LogprobsArrays(*gather_logprobs(described[rows_t], ids, md.num_logprobs).to_numpy())
        rows = [-1] * len(step.req_ids)
        first = np.cumsum(lengths[asked]) - lengths[asked]
        for a, start in zip(asked.tolist(), first.tolist()):
            rows[int(step.sample[a])] = start
        return arrays, rows

    def _forget_drafts(self, req_id: str) -> None:
        self._draft_budget.pop(req_id, None)
        self._draft_probs.pop(req_id, None)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.forget(req_id)

    def _segments(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Back-to-back segments of these lengths: where each starts, and each element's
        offset in its own segment."""
        starts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        return starts, self._arange[:total] - np.repeat(starts, lengths)

    def _draft_probs_rows(self, step: _Staged, starts: np.ndarray, logits: torch.Tensor) -> torch.Tensor | None:
        """A draft model's q of each logits row's draft (zeros elsewhere), for the sampled
        requests that verify drafts; None when there are none (n-gram drafts: point masses)."""
        if not self._draft_probs:
            return None
        assert step.num_drafts is not None
        rows: torch.Tensor | None = None
        for i, start, k in zip(step.sample.tolist(), starts.tolist(), step.num_drafts.tolist()):
            q = self._draft_probs.pop(step.req_ids[i], None)
            if q is None or not k:
                continue
            if rows is None:
                rows = torch.zeros_like(logits)
            rows[start : start + k] = q[:k]
        return rows

    def _propose_drafts(self, req_ids: list[str], sample: np.ndarray, sample_rows: np.ndarray) -> bool:
        """Drafts for the requests that just sampled, from their known tokens (none while
        the batch is as large as disable_by_batch_size, or while the gate finds that they
        cost more than they save); whether there are any."""
        proposer = self.proposer
        assert proposer is not None
        batch = self.input_batch
        if batch.num_reqs >= self.spec_pause_batch_size or not self.spec_gate.open:
            return False
        ids: list[str] = []
        drafts: list[list[int]] = []
        sampled_ids = [req_ids[i] for i in sample.tolist()]
        budgets = [self._draft_budget.get(r, self.num_speculative_tokens) for r in sampled_ids]
        if isinstance(proposer, DraftModelProposer):
            proposals = proposer.propose(
                sampled_ids, sample_rows.tolist(), batch.token_ids, batch.num_tokens, batch.sampling, budgets
            )
            for req_id, proposal in proposals.items():
                ids.append(req_id)
                drafts.append(proposal.token_ids)
                if proposal.probs is not None:
                    self._draft_probs[req_id] = proposal.probs
        else:
            for req_id, row, k in zip(sampled_ids, sample_rows.tolist(), budgets):
                proposal = proposer.propose(batch.token_ids[row, : batch.num_tokens[row]], k)
                if proposal.size:
                    ids.append(req_id)
                    drafts.append(proposal.tolist())
        if ids:
            self._drafts = DraftTokenIds(ids, drafts)
        return bool(ids)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (each handed out once)."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def _logits(self, staged: _Staged) -> torch.Tensor | None:
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
            table_rows = np.repeat(self._arange[: counts.size], counts)
            positions = self.buffers.positions.np[: staged.total]
            return program.run_queries(staged.total, table_rows, positions + 1)
        if program is not None and self._program_takes_chunk(staged):
            return program.run_chunk(staged.total, sample=staged.sample.size > 0)
        step = self._device_inputs(staged)
        if step.decode_size is not None:
            assert self.decode_graphs is not None
            size, meta = step.decode_size, step.meta
            hidden = self.decode_graphs.run(size, lambda: self._decode_forward(size, meta))
        else:
            hidden = self.model(
                step.input_ids, step.positions, self.kv_caches, step.meta, inputs_embeds=step.inputs_embeds
            )
        if self.input_batch.sampling.num_rows_with["prompt_logprobs"]:
            self.prompt_logprobs.collect(staged, hidden, self.model.compute_logits)
        if step.logits_indices is None:
            return None
        return self.model.compute_logits(hidden[step.logits_indices])

    # ------------------------------------------------------------ LoRA adapters

    def add_lora(self, request: LoRARequest, in_use: set[int]) -> bool:
        """Load an adapter (LoRAAdapterError when it cannot be served); False if it was loaded."""
        return self._lora_adapters().add(request, in_use)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_adapters().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora_adapters().pin(lora_id)

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

    def _program_takes_chunk(self, staged: _Staged) -> bool:
        """A step that is one request's prefill chunk, of plain token ids, that the C
        kernels attend and whose prompt logprobs nobody asked for (they need every
        token's hidden state, which only the forward pass keeps)."""
        return (
            len(staged.req_ids) == 1 and staged.max_query_len > 1 and not staged.embeds_rows and not self.deferred
            and not self.input_batch.sampling.num_rows_with["prompt_logprobs"]
            and CpuStepProgram.takes_chunk(staged.total, int(staged.seq_lens[0]))
        )

    @staticmethod
    def _apply_grammar(
        so: SchedulerOutput, req_ids: list[str], sample: np.ndarray, logits: torch.Tensor,
        logits_rows: np.ndarray | None = None,
    ) -> None:
        """Mask, in place, the logits of the rows under a grammar (structured outputs)
        with the bitmask the scheduler computed for them; other rows are untouched.
        ``logits_rows[k]`` is the logits row of ``sample[k]`` (default: k)."""
        from core.structured.xgrammar_backend import apply_token_bitmask

        assert so.grammar_bitmask is not None
        positions = range(sample.size) if logits_rows is None else logits_rows.tolist()
        row_of = {req_ids[i]: k for i, k in zip(sample.tolist(), positions)}
        # A request verifying drafts is listed once per row: its rows follow one another.
        rows: list[int] = []
        seen: dict[str, int] = {}
        for req_id in so.grammar_req_ids:
            first = row_of.get(req_id, -1)
            nth = seen[req_id] = seen.get(req_id, -1) + 1
            rows.append(-1 if first < 0 else first + nth)
        bitmask = so.grammar_bitmask
        if -1 in rows:  # not sampled this step after all: its mask has no row to go to
            keep = [k for k, row in enumerate(rows) if row >= 0]
            rows, bitmask = [rows[k] for k in keep], bitmask[keep]
        if rows:
            apply_token_bitmask(logits, bitmask, rows)

    def _decode_forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """The model over the first ``size`` rows of the static buffers (what a decode graph records)."""
        b = self.buffers
        return self.model(b.input_ids.device[:size], b.positions.device[:size], self.kv_caches, meta)

    def _sampled_output(
        self, step: _Staged, sample_rows: np.ndarray, out: SamplerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Append the sampled tokens to the persistent batch and report them,
        with the logprobs their requests asked for.

        With deferred tokens the batch gets placeholders and the output is
        materialised later (core/worker/async_output.py), except for rows
        whose sampling reads their own history on the host (multi-token bad
        words), which wait for their ids; otherwise the ids are read now.
        """
        batch = self.input_batch
        sampling = batch.sampling
        req_ids = step.req_ids
        token_ids = out.token_ids
        sampling.record_sampled(sample_rows, token_ids)
        prompt_logprobs = self.prompt_logprobs.finished(step.req_ids, step.sample, sample_rows)

        def logprobs() -> tuple[LogprobsArrays | None, list[int] | None]:
            if out.logprobs is None:
                return None, None
            return LogprobsArrays(*out.logprobs.to_numpy()), self._logprobs_rows(step, sample_rows)

        if not self.defer_sampled_tokens:
            sampled: list[list[int]] = [[] for _ in req_ids]
            for i, row, tok in zip(step.sample.tolist(), sample_rows.tolist(), token_ids.tolist()):
                batch.append_token(row, tok)
                sampled[i] = [tok]
            arrays, rows = logprobs()
            return ModelRunnerOutput.for_requests(
                req_ids,
                sampled_token_ids=sampled,
                logprobs=arrays,
                logprobs_rows=rows,
                prompt_logprobs=prompt_logprobs,
            )
        tokens = SampledTokens(token_ids, self._copy_stream)
        on_host = sampling.num_rows_with["bad_words"] > 0
        for k, (i, row) in enumerate(zip(step.sample.tolist(), sample_rows.tolist())):
            if on_host and sampling.needs_host_tokens(row):
                batch.append_token(row, tokens.tolist()[k])
                continue
            position = int(batch.num_tokens[row])
            if batch.append_token(row, PLACEHOLDER_TOKEN_ID):
                self.deferred.add(req_ids[i], tokens, k, position)
        extras = None
        if out.logprobs is not None or prompt_logprobs is not None:
            extras = lambda: (*logprobs(), prompt_logprobs)  # noqa: E731 - read on the engine thread
        return AsyncModelRunnerOutput(req_ids, step.sample.tolist(), tokens, extras)

    def _logprobs_rows(self, step: _Staged, sample_rows: np.ndarray) -> list[int]:
        """Row of the sampler's logprobs of each scheduled request (-1: it asked for none)."""
        rows = np.full(len(step.req_ids), -1, np.int64)
        asked = np.flatnonzero(self.input_batch.sampling.num_logprobs[sample_rows] >= 0)
        rows[step.sample[asked]] = np.arange(asked.size)
        return rows.tolist()

    def _stage_inputs(self, so: SchedulerOutput) -> _Staged:
        """Lay the step out and write its inputs to the host buffers (numpy only)."""
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), np.int64, num_reqs)
        computed = batch.num_computed_tokens[rows]
        b = self.buffers
        b.wait_for_copies()
        bs = self.block_size
        if so.total_num_scheduled_tokens == num_reqs:  # decodes only: one token each, at its position
            total, max_query_len = num_reqs, 1
            counts = self._ones[:num_reqs]
            cu = self._arange[1 : num_reqs + 1]
            starts = self._arange[:num_reqs]
            seq_lens = computed + 1
            positions = b.positions.np[:total]
            positions[:] = computed
            tok_rows = rows
        else:
            counts = np.fromiter(so.num_scheduled_tokens.values(), np.int64, num_reqs)
            cu = np.cumsum(counts)
            total = int(cu[-1])
            starts = cu - counts
            tok_req = np.repeat(self._arange[:num_reqs], counts)
            seq_lens = computed + counts
            max_query_len = int(counts.max())
            positions = b.positions.np[:total]
            np.add(computed[tok_req], self._arange[:total] - starts[tok_req], out=positions)
            tok_rows = rows[tok_req]
        # Sample only where the chunk reaches the end of the known tokens; a request whose
        # tokens run past it is verifying that many drafts.
        past_end = seq_lens - batch.num_tokens[rows]
        sample = np.nonzero(past_end >= 0)[0]
        num_drafts = past_end[sample] if total > num_reqs and past_end.max() > 0 else None
        embeds_rows = self._prompt_embeds_rows(rows, computed)
        decode_size = None
        if max_query_len == 1 and not embeds_rows and self.decode_graphs is not None:
            decode_size = self.decode_graphs.padded_size(num_reqs)

        if self.lora is not None:
            self.lora.stage(batch.lora_ids[rows], starts, counts, decode_only=total == num_reqs)
        b.input_ids.np[:total] = batch.token_ids[tok_rows, positions]
        b.slot_mapping.np[:total] = batch.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        b.query_start_loc.np[0] = 0
        b.query_start_loc.np[1 : num_reqs + 1] = cu
        b.seq_lens.np[:num_reqs] = seq_lens
        np.take(batch.block_table, rows, axis=0, out=b.block_tables.np[:num_reqs])
        if decode_size is not None:
            b.fill_decode_padding(num_reqs, decode_size)
        if num_drafts is None:
            b.logits_indices.np[: sample.size] = cu[sample] - 1
        else:  # the last 1 + k tokens of a request verifying k drafts
            num_rows = num_drafts + 1
            _, offsets = self._segments(num_rows)
            first = cu[sample] - num_rows
            b.logits_indices.np[: offsets.size] = np.repeat(first, num_rows) + offsets
        return _Staged(
            req_ids, rows, counts, cu, starts, computed, seq_lens, sample, num_drafts, total, max_query_len,
            embeds_rows, decode_size,
        )

    def _device_inputs(self, st: _Staged) -> _StepInputs:
        """The staged step's tensors on the device and its attention metadata."""
        b = self.buffers
        num_tokens = num_padded_reqs = st.decode_size or st.total
        if st.decode_size is None:
            num_padded_reqs = len(st.req_ids)
        meta = self._metadata(num_tokens, num_padded_reqs, st.max_query_len, may_pad=num_tokens != st.total)
        input_ids = b.input_ids.to_device(num_tokens)
        positions_t = b.positions.to_device(num_tokens)
        logits_indices = b.logits_indices.to_device(st.num_logits) if st.sample.size else None
        if self.deferred:
            self._fill_deferred_inputs(input_ids, st.req_ids, st.computed, st.counts, st.starts)
        b.copies_issued()
        return _StepInputs(
            input_ids=input_ids,
            positions=positions_t,
            meta=meta,
            inputs_embeds=self._inputs_embeds(input_ids, st.embeds_rows, st.computed, st.counts, st.starts),
            logits_indices=logits_indices,
            decode_size=st.decode_size,
        )

    def _metadata(self, num_tokens: int, num_reqs: int, max_query_len: int, may_pad: bool = True) -> AttentionMetadata:
        """Attention metadata over the first rows of the (already filled) buffers;
        ``may_pad=False`` promises that no slot is negative (no filler rows)."""
        b = self.buffers
        seq_lens_cpu = b.seq_lens.np[:num_reqs].tolist()
        return AttentionMetadata(
            slot_mapping=b.slot_mapping.to_device(num_tokens),
            query_start_loc=b.query_start_loc.to_device(num_reqs + 1),
            seq_lens=b.seq_lens.to_device(num_reqs),
            block_tables=b.block_tables.to_device(num_reqs),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=b.query_start_loc.np[: num_reqs + 1].tolist(),
            seq_lens_cpu=seq_lens_cpu,
            may_pad=may_pad,
        )

    def _fill_deferred_inputs(
        self,
        input_ids: torch.Tensor,
        req_ids: list[str],
        computed: np.ndarray,
        counts: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        """Overwrite placeholder inputs with their sampled ids, device to device."""
        b = self.buffers
        used = 0
        for tokens, dst, src in self.deferred.take_inputs(req_ids, computed, counts, starts):
            n = len(dst)
            b.deferred_dst.np[used : used + n] = dst
            b.deferred_src.np[used : used + n] = src
            dst_t = b.deferred_dst.to_device(used + n)[used:]
            src_t = b.deferred_src.to_device(used + n)[used:]
            input_ids.index_copy_(0, dst_t, tokens.device_ids.index_select(0, src_t))
            used += n

    def _prompt_embeds_rows(self, rows: np.ndarray, computed: np.ndarray) -> list[tuple[int, int]]:
        """(index, row) of the scheduled requests whose chunk still covers prompt embeddings."""
        embeds = self.input_batch.prompt_embeds
        return [
            (i, row)
            for i, row in enumerate(rows.tolist())
            if embeds[row] is not None and computed[i] < embeds[row].shape[0]
        ]

    def _inputs_embeds(
        self,
        input_ids: torch.Tensor,
        embeds_rows: list[tuple[int, int]],
        computed: np.ndarray,
        counts: np.ndarray,
        starts: np.ndarray,
    ) -> torch.Tensor | None:
        """Token embeddings with the prompt rows of embedding prompts swapped in;
        None when no scheduled token comes from a prompt given as embeddings."""
        if not embeds_rows:
            return None
        inputs_embeds = self.model.get_input_embeddings()(input_ids)
        for i, row in embeds_rows:
            embeds = self.input_batch.prompt_embeds[row]
            # The chunk covers positions computed[i]..; its first `take` are prompt rows.
            start = int(starts[i])
            take = int(min(counts[i], embeds.shape[0] - computed[i]))
            inputs_embeds[start : start + take] = embeds[int(computed[i]) : int(computed[i]) + take]
        return inputs_embeds
