"""Paged KV-cache write and paged attention in plain torch: the CPU path and
the reference the Triton kernels are tested against.

Decodes (one query token each) are gathered into one padded batch and run
as a single SDPA call, because a Python loop per decode would dominate the
step on CPU; prefill chunks run one SDPA call per request, each with the
causal mask shifted by the request's cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D].

    A negative slot marks a padding token and is skipped, as in the Triton kernel.
    """
    if key.shape[0] == 0:
        return
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` cached tokens of the blocks ``block_ids`` as [..., length, Hkv, D].

    ``index_select`` on the flattened ids: on CPU it copies whole blocks about
    much faster than advanced indexing with a 2-D index.
    """
    blocks = cache.index_select(0, block_ids.flatten())
    flat = blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])
    return flat[..., :length, :, :]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [T, Hq, D] over each request's paged context.

    This step's K/V must already be in the cache. Query ``i`` of request ``r``
    sits at position ``seq_lens[r] - query_len[r] + i`` and sees keys at
    positions up to its own. Hq may be a multiple of Hkv (GQA).
    """
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    block_size = k_cache.shape[1]
    qsl = meta.query_start_loc_cpu
    seq_lens = meta.seq_lens_cpu
    decode_reqs = [r for r in range(meta.num_reqs) if qsl[r + 1] - qsl[r] == 1]
    if len(decode_reqs) > 1:
        _batched_decode(query, k_cache, v_cache, meta, decode_reqs, scale, out)
        handled = set(decode_reqs)
    else:
        handled = set()

    for r in range(meta.num_reqs):
        if r in handled:
            continue
        start, end = qsl[r], qsl[r + 1]
        q_len, seq_len = end - start, seq_lens[r]
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        block_ids = meta.block_tables[r, :num_blocks].long()
        k = _gather_context(k_cache, block_ids, seq_len).transpose(0, 1)  # [Hkv, S, D]
        v = _gather_context(v_cache, block_ids, seq_len).transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [Hq, q_len, D]
        if q_len == 1:
            mask, causal = None, False  # a lone last token sees the whole context
        elif q_len == seq_len:
            mask, causal = None, True  # no cached prefix: the plain causal mask
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[start:end] = o.transpose(0, 1)
    return out


def _batched_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    reqs: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """All one-token queries in one SDPA call, contexts padded to the longest.

    With GQA the query heads that share a KV head are laid out as that head's
    queries ([B, Hkv, group, D]): one token's heads all see the same keys, so
    SDPA needs no K/V expansion (faster than ``enable_gqa`` on CPU).
    """
    device = query.device
    block_size = k_cache.shape[1]
    lens = torch.tensor([meta.seq_lens_cpu[r] for r in reqs], device=device)
    max_len = max(meta.seq_lens_cpu[r] for r in reqs)
    num_blocks = -(-max_len // block_size)
    rows = torch.tensor(reqs, device=device)
    tok = torch.tensor([meta.query_start_loc_cpu[r] for r in reqs], device=device)
    block_ids = meta.block_tables[rows, :num_blocks].long()  # padding ids are valid blocks, masked below
    k = _gather_context(k_cache, block_ids, max_len).transpose(1, 2)  # [B, Hkv, S, D]
    v = _gather_context(v_cache, block_ids, max_len).transpose(1, 2)
    num_kv_heads, head_dim = k.shape[1], k.shape[3]
    q = query[tok].view(len(reqs), num_kv_heads, -1, head_dim)  # [B, Hkv, group, D]
    mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out[tok] = o.reshape(len(reqs), -1, head_dim)
