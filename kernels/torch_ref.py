"""The kernels in plain torch: the reference the C (CPU) and Triton (GPU)
kernels are tested against, and the path wherever those do not apply.

Paged attention plans the work that is the same for every layer of a step
(which blocks to gather, the padding mask, which rows are decodes) once per
step (``CpuAttentionPlan``, cached on the step's metadata), so that each
layer does only the gathers and the products:

- decodes (one query token each) run as one batch: their contexts are
  gathered from the cache with one ``index_select`` per K and V, padded to
  the longest, and attended with two batched matmuls in the grouped-query
  layout (the query heads of one KV head are that head's queries, so K/V
  are never expanded);
- prefill chunks run one SDPA call per request, causal against the cached
  prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_format import from_storage, to_storage
from kernels.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in x's dtype (the Hugging Face formula; torch's
    fused kernel computes exactly that for float32)."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), with ``residual`` updated in place."""
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up rows [gate | up] (GeGLU)."""
    size = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :size], approximate="tanh") * gate_up[..., size:]


def rotary(
    qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate heads ``:heads`` of qkv [T, H, D] in place by their tokens' positions.

    ``cos``/``sin_signed`` are per-position tables [P, D] (sin with its first
    half negated): ``x·cos + roll(x)·sin±`` is ``x·cos + rotate_half(x)·sin``
    term by term, so bitwise the reference's result, in four calls.
    """
    x = qkv[:, :heads]
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin_signed.index_select(0, positions).unsqueeze(1)
    x.copy_(x * c + torch.roll(x, x.shape[-1] // 2, dims=-1) * s)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] -> [N, n]."""
    n = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :n]) * gate_up[:, n:]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    may_pad: bool = True,
) -> None:
    """Scatter key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, row] (rows as
    kernels/kv_format.py stores them).

    A negative slot marks a padding token and is skipped, as in the Triton
    kernel; ``may_pad=False`` says there is none, which saves the check.
    """
    if key.shape[0] == 0:
        return
    slots = slot_mapping
    if may_pad and bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, to_storage(key, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, to_storage(value, v_cache.dtype))


@dataclass
class _Prefill:
    start: int
    end: int
    block_ids: torch.Tensor  # int64, the blocks holding the request's context
    seq_len: int
    mask: torch.Tensor | None  # causal mask shifted by the cached prefix, when there is one
    causal: bool


@dataclass
class CpuAttentionPlan:
    """What every layer of one step needs to know, worked out once.

    ``query_*`` list the rows that the C kernel attends one query at a time
    (kernels/cpu): the decodes, plus, when the plan is built with a
    ``row_pairs_limit``, every token of the prefill chunks small enough
    (query length x context length at most the limit) for the C kernels to
    beat a batched SDPA call; with ``whole_chunks`` those chunks are instead
    listed in ``small_prefills``, for the C kernel that attends a chunk at
    once. ``prefills`` are the chunks left to SDPA. The torch path builds the
    plan with no limit and batches its decodes itself.
    """

    decode_rows: torch.Tensor | None  # token rows of the decodes; None when every token is a decode
    decode_blocks: torch.Tensor | None  # [num_decodes * blocks] int64, padded with valid ids
    num_decodes: int
    decode_len: int  # longest decode context: the padded length
    decode_mask: torch.Tensor | None  # [B, 1, 1, S] additive mask (-inf on padding), None if no padding
    query_rows: torch.Tensor | None  # int64 token row of each single query
    query_tables: torch.Tensor | None  # int64 block-table row of each
    query_seq_lens: torch.Tensor | None  # int64 context length each one sees (causal)
    query_max_len: int
    prefills: list[_Prefill]
    small_prefills: list[tuple[int, int, int, int]]  # (start, end, request, seq_len) of each

    @classmethod
    def build(
        cls,
        meta: AttentionMetadata,
        block_size: int,
        device: torch.device,
        row_pairs_limit: int = 0,
        whole_chunks: bool = False,
        window: int = 0,
    ) -> CpuAttentionPlan:
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        decodes = [r for r in range(meta.num_reqs) if qsl[r + 1] - qsl[r] == 1]
        tables = meta.block_tables
        decode_rows = decode_blocks = decode_mask = None
        decode_len = 0
        rows: list[int] = []
        row_tables: list[int] = []
        row_lens: list[int] = []
        if decodes:
            lens = [seq_lens[r] for r in decodes]
            decode_len = max(lens)
            num_blocks = -(-decode_len // block_size)
            reqs = torch.tensor(decodes, dtype=torch.int64, device=device)
            # Rows past a shorter context point at valid blocks (table padding), masked below.
            decode_blocks = tables.index_select(0, reqs)[:, :num_blocks].reshape(-1).long()
            rows = [qsl[r] for r in decodes]
            row_tables, row_lens = list(decodes), list(lens)
            if rows != list(range(qsl[meta.num_reqs])):
                decode_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            if min(lens) != decode_len or 0 < window < decode_len:
                at, ends = torch.arange(decode_len, device=device)[None, :], torch.tensor(lens, device=device)[:, None]
                pad = at >= ends
                if window > 0:  # keys before each decode's window
                    pad |= at < ends - window
                decode_mask = torch.zeros(pad.shape, device=device).masked_fill_(pad, float("-inf"))[:, None, None]
        prefills = []
        small_prefills = []
        for r in range(meta.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            q_len, seq_len = end - start, seq_lens[r]
            if q_len <= 1:
                continue
            if q_len * seq_len <= row_pairs_limit:
                if whole_chunks:
                    small_prefills.append((start, end, r, seq_len))
                    continue
                first = seq_len - q_len + 1  # token i sees the context up to its own position
                rows += range(start, end)
                row_tables += [r] * q_len
                row_lens += range(first, seq_len + 1)
                continue
            block_ids = tables[r, : -(-seq_len // block_size)].long()
            # No cached prefix and no window: the plain causal mask.
            mask, causal = None, q_len == seq_len and not 0 < window < seq_len
            if not causal:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
                keys = torch.arange(seq_len, device=device)[None, :]
                mask = keys <= q_pos
                if window > 0:
                    mask &= keys > q_pos - window
            prefills.append(_Prefill(start, end, block_ids, seq_len, mask, causal))
        query_rows = query_tables = query_lens = None
        if rows:
            query_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            query_tables = torch.tensor(row_tables, dtype=torch.int64, device=device)
            query_lens = torch.tensor(row_lens, dtype=torch.int64, device=device)
        return cls(
            decode_rows, decode_blocks, len(decodes), decode_len, decode_mask, query_rows, query_tables,
            query_lens, max(row_lens, default=0), prefills, small_prefills,
        )


def plan(
    meta: AttentionMetadata,
    block_size: int,
    device: torch.device,
    row_pairs_limit: int = 0,
    whole_chunks: bool = False,
    window: int = 0,
) -> CpuAttentionPlan:
    """The step's plan for layers of this sliding ``window`` (0: none), built by the first layer
    that asks and cached on ``meta``."""
    plans = meta.cpu_plan
    if plans is None:
        plans = meta.cpu_plan = {}
    plan = plans.get(window)
    if plan is None:
        plan = plans[window] = CpuAttentionPlan.build(meta, block_size, device, row_pairs_limit, whole_chunks, window)
    return plan


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of query [T, Hq, D] over each request's paged context (the last ``window``
    positions of it, up to the query's own, with a sliding window > 0).

    This step's K/V must already be in the cache. Query ``i`` of request ``r``
    sits at position ``seq_lens[r] - query_len[r] + i`` and sees keys at
    positions up to its own. Hq may be a multiple of Hkv (GQA).
    """
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return torch.empty_like(query) if out is None else out
    step = plan(meta, k_cache.shape[1], query.device, window=window)
    if step.num_decodes == num_tokens and out is None:
        return _decodes(query, k_cache, v_cache, step, scale)  # a pure decode step: no scatter
    if out is None:
        out = torch.empty_like(query)
    if step.num_decodes:
        rows = step.decode_rows
        q = query if rows is None else query.index_select(0, rows)
        o = _decodes(q, k_cache, v_cache, step, scale)
        if rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, rows, o)
    attend_prefills(query, k_cache, v_cache, step, scale, out)
    return out


def attend_prefills(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: CpuAttentionPlan, scale: float,
    out: torch.Tensor,
) -> None:
    """The step's prefill chunks, one SDPA call each, written into their rows of ``out``."""
    for p in step.prefills:
        k = _context(k_cache, p.block_ids, p.seq_len, query.dtype).transpose(0, 1)  # [Hkv, S, D]
        v = _context(v_cache, p.block_ids, p.seq_len, query.dtype).transpose(0, 1)
        q = query[p.start : p.end].transpose(0, 1)  # [Hq, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.causal, scale=scale, enable_gqa=True)
        out[p.start : p.end] = o.transpose(0, 1)


def _context(cache: torch.Tensor, block_ids: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` cached tokens of one request as [length, Hkv, D], in ``dtype``
    (a float16 or q8_0 cache serves float32 queries on a CPU).

    ``index_select`` on the block ids: on a CPU it copies whole blocks much
    faster than advanced indexing with a 2-D index.
    """
    return from_storage(cache.index_select(0, block_ids).view(-1, *cache.shape[2:])[:length], dtype)


def _decodes(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CpuAttentionPlan, scale: float
) -> torch.Tensor:
    """One-token queries [B, Hq, D] over their padded contexts -> [B, Hq, D]."""
    batch, num_kv_heads, head_dim = plan.num_decodes, k_cache.shape[2], query.shape[-1]
    length = plan.decode_len
    # [B, blocks * block_size, Hkv, D] -> [B, Hkv, S, D] (a view; the matmuls read it strided)
    # (a float16 or q8_0 cache is read as float32: the queries' dtype on a CPU)
    k = from_storage(k_cache.index_select(0, plan.decode_blocks), query.dtype)
    v = from_storage(v_cache.index_select(0, plan.decode_blocks), query.dtype)
    k = k.view(batch, -1, num_kv_heads, head_dim)[:, :length]
    v = v.view(batch, -1, num_kv_heads, head_dim)[:, :length]
    q = query.view(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, group, D]
    scores = torch.matmul(q, k.permute(0, 2, 3, 1))  # [B, Hkv, group, S]
    scores.mul_(scale)
    if plan.decode_mask is not None:
        scores.add_(plan.decode_mask)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.transpose(1, 2)).view(batch, -1, head_dim)
