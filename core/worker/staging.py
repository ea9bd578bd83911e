"""One scheduler step laid out as a flat, mixed batch: host buffers first, then device tensors.

Prefill chunks and decodes are laid out back to back (no padding); every
index computation is vectorised with numpy over the persistent batch so the
per-step host cost grows with the tokens scheduled, not with context length.
A request whose scheduled tokens run past its known ones is verifying drafts
(speculative decoding): it gets a logits row for its last known token and one
per draft. On a GPU a decode-only step is padded to a CUDA graph's batch size,
and inputs still on the device as sampled ids (core/worker/async_output.py)
are copied into place there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from core.sched.output import SchedulerOutput
from core.worker.async_output import DeferredTokens
from core.worker.cuda_graphs import DecodeGraphs
from core.worker.input_batch import InputBatch
from core.worker.input_buffers import InputBuffers
from core.worker.lora_adapters import LoRAAdapters
from kernels.metadata import AttentionMetadata


@dataclass
class Staged:
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

    @property
    def decodes_only(self) -> bool:
        """Every request at its last token (with or without drafts): nothing of a prompt."""
        return self.sample.size == len(self.req_ids) and self.total == self.num_logits


@dataclass
class DeviceInputs:
    """One step's inputs on the device (the forward pass's; its layout is the Staged's)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    inputs_embeds: torch.Tensor | None
    logits_indices: torch.Tensor | None  # hidden-state row of each request that samples
    decode_size: int | None  # padded batch size of a decode-only step, None otherwise


class Stager:
    """Writes each step's layout into the runner's buffers and hands its device tensors out."""

    def __init__(
        self, batch: InputBatch, buffers: InputBuffers, block_size: int, deferred: DeferredTokens, max_tokens: int,
        layer_group: tuple[int, ...] = (),
    ) -> None:
        self.batch = batch
        self.buffers = buffers
        self.layer_group = layer_group  # each layer's KV cache group, where there are several
        self.block_size = block_size
        self.deferred = deferred
        self.arange = np.arange(max_tokens + 1, dtype=np.int64)  # sliced, never written
        self._ones = np.ones(max_tokens, dtype=np.int64)

    def segments(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Back-to-back segments of these lengths: where each starts, and each element's
        offset in its own segment."""
        starts = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        return starts, self.arange[:total] - np.repeat(starts, lengths)

    def stage(self, so: SchedulerOutput, decode_graphs: DecodeGraphs | None, lora: LoRAAdapters | None) -> Staged:
        """Lay the step out and write its inputs to the host buffers (numpy only); a decode-only
        step is padded to one of ``decode_graphs``' sizes, and ``lora`` groups its rows."""
        batch = self.batch
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
            cu = self.arange[1 : num_reqs + 1]
            starts = self.arange[:num_reqs]
            seq_lens = computed + 1
            positions = b.positions.np[:total]
            positions[:] = computed
            tok_rows = rows
        else:
            counts = np.fromiter(so.num_scheduled_tokens.values(), np.int64, num_reqs)
            cu = np.cumsum(counts)
            total = int(cu[-1])
            starts = cu - counts
            tok_req = np.repeat(self.arange[:num_reqs], counts)
            seq_lens = computed + counts
            max_query_len = int(counts.max())
            positions = b.positions.np[:total]
            np.add(computed[tok_req], self.arange[:total] - starts[tok_req], out=positions)
            tok_rows = rows[tok_req]
        # Sample only where the chunk reaches the end of the known tokens; a request whose
        # tokens run past it is verifying that many drafts.
        past_end = seq_lens - batch.num_tokens[rows]
        sample = np.nonzero(past_end >= 0)[0]
        num_drafts = past_end[sample] if total > num_reqs and past_end.max() > 0 else None
        embeds_rows = self._prompt_embeds_rows(rows, computed)
        decode_size = None
        if max_query_len == 1 and not embeds_rows and decode_graphs is not None:
            decode_size = decode_graphs.padded_size(num_reqs)

        if lora is not None:
            lora.stage(batch.lora_ids[rows], starts, counts, decode_only=total == num_reqs)
        b.input_ids.np[:total] = batch.token_ids[tok_rows, positions]
        block_index, offsets = positions // bs, positions % bs
        for table, slots, staged_tables in zip(batch.block_tables, b.group_slots, b.group_tables):
            np.add(table[tok_rows, block_index].astype(np.int64) * bs, offsets, out=slots.np[:total])
            np.take(table, rows, axis=0, out=staged_tables.np[:num_reqs])
        b.query_start_loc.np[0] = 0
        b.query_start_loc.np[1 : num_reqs + 1] = cu
        b.seq_lens.np[:num_reqs] = seq_lens
        if decode_size is not None:
            b.fill_decode_padding(num_reqs, decode_size)
        if num_drafts is None:
            b.logits_indices.np[: sample.size] = cu[sample] - 1
        else:  # the last 1 + k tokens of a request verifying k drafts
            num_rows = num_drafts + 1
            _, offsets = self.segments(num_rows)
            first = cu[sample] - num_rows
            b.logits_indices.np[: offsets.size] = np.repeat(first, num_rows) + offsets
        return Staged(
            req_ids, rows, counts, cu, starts, computed, seq_lens, sample, num_drafts, total, max_query_len,
            embeds_rows, decode_size,
        )

    def device_inputs(self, staged: Staged, model: torch.nn.Module) -> DeviceInputs:
        """The staged step's tensors on the device and its attention metadata (``model``
        embeds the tokens when some prompt came as embeddings)."""
        b = self.buffers
        num_tokens = num_padded_reqs = staged.decode_size or staged.total
        if staged.decode_size is None:
            num_padded_reqs = len(staged.req_ids)
        meta = self.metadata(num_tokens, num_padded_reqs, staged.max_query_len, may_pad=num_tokens != staged.total)
        input_ids = b.input_ids.to_device(num_tokens)
        positions = b.positions.to_device(num_tokens)
        logits_indices = b.logits_indices.to_device(staged.num_logits) if staged.sample.size else None
        if self.deferred:
            self._fill_deferred_inputs(input_ids, staged)
        b.copies_issued()
        return DeviceInputs(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            inputs_embeds=self._inputs_embeds(model, input_ids, staged),
            logits_indices=logits_indices,
            decode_size=staged.decode_size,
        )

    def metadata(self, num_tokens: int, num_reqs: int, max_query_len: int, may_pad: bool = True) -> AttentionMetadata:
        """Attention metadata over the first rows of the (already filled) buffers;
        ``may_pad=False`` promises that no slot is negative (no filler rows)."""
        b = self.buffers
        seq_lens_cpu = b.seq_lens.np[:num_reqs].tolist()
        meta = AttentionMetadata(
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
        if len(b.group_slots) > 1:
            groups = [meta] + [
                dataclasses.replace(
                    meta, slot_mapping=slots.to_device(num_tokens), block_tables=tables.to_device(num_reqs)
                )
                for slots, tables in zip(b.group_slots[1:], b.group_tables[1:])
            ]
            meta.by_layer = [groups[group] for group in self.layer_group]
        return meta

    def _fill_deferred_inputs(self, input_ids: torch.Tensor, staged: Staged) -> None:
        """Overwrite placeholder inputs with their sampled ids, device to device."""
        b = self.buffers
        used = 0
        groups = self.deferred.take_inputs(staged.req_ids, staged.computed, staged.counts, staged.starts)
        for tokens, dst, src in groups:
            n = len(dst)
            b.deferred_dst.np[used : used + n] = dst
            b.deferred_src.np[used : used + n] = src
            dst_t = b.deferred_dst.to_device(used + n)[used:]
            src_t = b.deferred_src.to_device(used + n)[used:]
            input_ids.index_copy_(0, dst_t, tokens.device_ids.index_select(0, src_t))
            used += n

    def _prompt_embeds_rows(self, rows: np.ndarray, computed: np.ndarray) -> list[tuple[int, int]]:
        """(index, row) of the scheduled requests whose chunk still covers prompt embeddings."""
        embeds = self.batch.prompt_embeds
        return [
            (i, row)
            for i, row in enumerate(rows.tolist())
            if embeds[row] is not None and computed[i] < embeds[row].shape[0]
        ]

    def _inputs_embeds(self, model: torch.nn.Module, input_ids: torch.Tensor, staged: Staged) -> torch.Tensor | None:
        """Token embeddings with the prompt rows of embedding prompts swapped in;
        None when no scheduled token comes from a prompt given as embeddings."""
        if not staged.embeds_rows:
            return None
        computed, counts, starts = staged.computed, staged.counts, staged.starts
        inputs_embeds = model.get_input_embeddings()(input_ids)
        for i, row in staged.embeds_rows:
            embeds = self.batch.prompt_embeds[row]
            # The chunk covers positions computed[i]..; its first `take` are prompt rows.
            start = int(starts[i])
            take = int(min(counts[i], embeds.shape[0] - computed[i]))
            inputs_embeds[start : start + take] = embeds[int(computed[i]) : int(computed[i]) + take]
        return inputs_embeds


def apply_grammar(
    so: SchedulerOutput, staged: Staged, logits: torch.Tensor, logits_rows: np.ndarray | None = None
) -> None:
    """Mask, in place, the logits of the rows under a grammar (structured outputs) with the
    bitmask the scheduler computed for them; other rows are untouched. ``logits_rows[k]`` is
    the first logits row of ``staged.sample[k]`` (default: k)."""
    from core.structured.xgrammar_backend import apply_token_bitmask

    assert so.grammar_bitmask is not None
    row_of = _first_logits_rows(staged, logits_rows)
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


def force_tokens(
    so: SchedulerOutput, staged: Staged, logits: torch.Tensor, logits_rows: np.ndarray | None = None
) -> None:
    """Leave, in place, only the forced token to the rows a reasoning budget forces
    (``so.forced_token_ids``): its logit is kept, every other one is -inf, as a grammar
    allowing that one token would leave the row."""
    row_of = _first_logits_rows(staged, logits_rows)
    rows: list[int] = []
    token_ids: list[int] = []
    for req_id, nth, token_id in so.forced_token_ids:
        first = row_of.get(req_id)
        if first is not None:  # else not sampled this step after all
            rows.append(first + nth)
            token_ids.append(token_id)
    if not rows:
        return
    rows_t = torch.tensor(rows, device=logits.device)
    token_ids_t = torch.tensor(token_ids, device=logits.device)
    kept = logits[rows_t, token_ids_t]
    logits[rows_t] = float("-inf")
    logits[rows_t, token_ids_t] = kept


def _first_logits_rows(staged: Staged, logits_rows: np.ndarray | None) -> dict[str, int]:
    """The first logits row of each request that samples (``logits_rows[k]`` that of
    ``staged.sample[k]``; default: k)."""
    sample = staged.sample
    positions = range(sample.size) if logits_rows is None else logits_rows.tolist()
    return {staged.req_ids[i]: k for i, k in zip(sample.tolist(), positions)}
